"""Where the engine step's host time goes when the jitted call returns (bench/engine_step.py "dispatch" phase).

Two hypotheses for the ~5 ms the call takes before returning:
  1. per-argument cost: the params tree has ~1660 leaves, and each array argument costs the runtime work
     (buffer hold, usage events) on every call;
  2. CUDA-graph updates: XLA re-records its command buffers when an argument's address changes (a fresh batch).
Part A times jitted calls over N small leaves (N = 1 .. 2000). Part B calls the engine's own jitted step with the
batch reused (same addresses) and re-sent each call (fresh addresses, as the engine does).

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 bench/dispatch_probe.py   # JSON to $OUT or bench/results
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from bench import decode_step
from bench.engine_step import RandomPleRunner
from bench.results_io import save_result
from flashnext_jax import api
from flashnext_jax.config import from_hf_config
from flashnext_jax.llm import LLM
from flashnext_jax.sampling import SamplingParams

SMOKE = bool(os.environ.get("ENGINE_BENCH_SMOKE"))


def timed_calls(call, reps=20):
    """Median host ms until the call returns, and until its outputs are ready."""
    disp, total = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = call()
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        disp.append(t1 - t0)
        total.append(t2 - t0)
    return float(np.median(disp)) * 1e3, float(np.median(total)) * 1e3


def part_a():
    rows = []
    for n in (1, 10, 100, 500, 1000, 2000):
        xs = [jnp.full((256,), i, jnp.bfloat16) for i in range(n)]
        f = jax.jit(lambda xs: sum(x[0].astype(jnp.float32) for x in xs))
        jax.block_until_ready(f(xs))
        d, t = timed_calls(lambda: f(xs), 30)
        rows.append(dict(part="leaves", n_leaves=n, dispatch_ms=d, total_ms=t))
        print(rows[-1], flush=True)
    return rows


def part_b(model, prompt_len=1):
    lm = LLM(RandomPleRunner(model, 0), max_num_seqs=1, max_num_batched_tokens=max(prompt_len, 16),
             max_model_len=prompt_len + 64, page_size=64)
    eng = lm.engine
    captured = {}
    step = eng._step

    def spy(params, store, batch, *rest):
        captured["np"] = jax.tree.map(np.asarray, batch)
        return step(params, store, batch, *rest)

    eng._step = spy
    lm._add(list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        eng.step()
    eng._step = step
    params, nb = eng.runner.params, captured["np"]
    state = {"store": eng.ledger.store}

    def call(batch):
        state["store"], out = step(params, state["store"], batch)
        return out

    fixed = jax.device_put(nb)
    rows = []
    t0 = time.perf_counter()
    leaves = jax.tree.leaves(params)
    flat_ms = (time.perf_counter() - t0) * 1e3
    for name, fn in (("batch reused", lambda: call(fixed)), ("batch re-sent", lambda: call(jax.device_put(nb))),
                     ("batch reused again", lambda: call(fixed))):
        d, t = timed_calls(fn, 20)
        rows.append(dict(part="engine step", variant=name, dispatch_ms=d, total_ms=t, param_leaves=len(leaves),
                         flatten_ms=flat_ms))
        print(rows[-1], flush=True)
    return rows


def main():
    rows = part_a()
    with open(decode_step.DEMO_CONFIG if SMOKE else decode_step.REAL_CONFIG) as f:
        cfg = from_hf_config(json.load(f))
    cfg = dataclasses.replace(cfg, num_experts=min(32, cfg.num_experts))
    params, _, _ = decode_step.build(cfg, jax.random.key(0))
    model = api.Model(cfg, params, table=None, dtype=jnp.bfloat16)
    rows += part_b(model)
    save_result(os.environ.get("PROBE_NAME", "dispatch_probe.json"), rows, smoke=SMOKE)
    print(f"\n{'what':<34} {'dispatch ms':>11} {'total ms':>9}")
    for r in rows:
        what = f"{r['n_leaves']} leaves" if r["part"] == "leaves" else r["variant"]
        print(f"{what:<34} {r['dispatch_ms']:11.3f} {r['total_ms']:9.3f}")


if __name__ == "__main__":
    main()
