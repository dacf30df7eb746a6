"""The serving engine at the real model size: decode tokens/s as users of `LLM` / `flashnext serve` get them.

bench/decode_step.py times `model.forward` alone. This runs the whole engine (`LLM` over `RealRunner`): scheduler,
tickets, the store (GDN state updated in place by the kernels, QSA K/V in pages), the host side (PLE rows, greedy
tokens, commit), with the same random INT4-Mixed weights (`decode_step.build`, 32 of 512 experts
kept: bytes per step as the full model). There is no real n-gram table here, so `host_prepare` returns random PLE
rows of the right shape (the real one gathers 8 rows per token from a host table). For each batch size: B
requests with `--prompt`-token prompts, greedy, `--tokens` new tokens each; reported: ms per engine step and
tokens/s over the steps where every request is decoding (compiles and prefill excluded), and the same step's
jitted device time.

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 bench/engine_step.py    # JSON to $OUT or bench/results
  ENGINE_BENCH_SMOKE=1 JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/engine_step.py # CPU check of this script
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from bench import decode_step
from bench.results_io import save_result
from flashnext_jax import api
from flashnext_jax.config import from_hf_config
from flashnext_jax.llm import LLM
from flashnext_jax.runner import RealRunner
from flashnext_jax.sampling import SamplingParams

SMOKE = bool(os.environ.get("ENGINE_BENCH_SMOKE"))


class RandomPleRunner(RealRunner):
    """RealRunner whose PLE rows come from a small random table (no n-gram table at this size here); everything
    else is the engine's. A row's PLE input depends only on its own token and position, as the real table's does,
    so a request's tokens do not change with the batch it is in (bench/pp_gpus.py compares PP=2 with PP=1)."""

    TABLE_ROWS = 4096

    @functools.cached_property
    def _random_table(self) -> np.ndarray:
        rng = np.random.default_rng(0)
        return (rng.standard_normal((self.TABLE_ROWS, self.cfg.ple_embed_dim)) * 0.02).astype(np.float32)

    def _ngram_rows(self, rows, T: int):
        if not self.n_ple:
            return {}
        out = np.zeros((len(rows), T, self.cfg.ple_embed_dim), np.float32)
        for b, row in enumerate(rows):
            if row is not None and len(row.tokens):
                pos = row.start + np.arange(len(row.tokens))
                out[b, : len(row.tokens)] = self._random_table[(np.asarray(row.tokens) * 7919 + pos) % self.TABLE_ROWS]
        return {"ple_rows": out}


def run_batch(model, bsz: int, prompt_len: int, new_tokens: int, page_size: int = 16,
              sampling: dict | None = None) -> dict:
    sampling = sampling or {"temperature": 0.0}
    max_len = prompt_len + new_tokens + 16
    lm = LLM(RandomPleRunner(model, 0), max_num_seqs=bsz, max_num_batched_tokens=bsz * prompt_len,
             max_model_len=max_len, page_size=page_size,  # all prompts in one prefill step
             num_pages=bsz * -(-max_len // page_size) + 8)  # a pool of what the rows need: runs stay independent
    phases = {"build_batch": [], "dispatch": [], "device_wait": [], "sampler": [], "commit": []}
    eng = lm.engine

    def timed(name, fn, wait=None):  # host-time breakdown of the engine step (wall time per phase)
        def run(*a):
            t0 = time.perf_counter()
            out = fn(*a)
            phases[name].append(time.perf_counter() - t0)
            if wait:
                t0 = time.perf_counter()
                jax.block_until_ready(out)
                phases[wait].append(time.perf_counter() - t0)
            return out
        return run

    eng._build_batch = timed("build_batch", eng._build_batch)
    eng._launch_model_step = timed("dispatch", eng._launch_model_step, wait="device_wait")
    # the second program of a step (engine.choose_tokens: device sampling, logprobs, bias), launch to result
    eng._choose_tokens = timed("sampler", eng._choose_tokens, wait="sampler")
    eng._commit = timed("commit", eng._commit)
    rng = np.random.default_rng(bsz)
    reqs = [lm._add(rng.integers(0, model.cfg.vocab_size, prompt_len).tolist(),
                    SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=i, **sampling)) for i in range(bsz)]
    step_times, profile, phase_ms, t_start = [], {}, {}, time.perf_counter()
    while any(not r.finished for r in reqs):
        decoding = all(len(r.output) >= 2 for r in reqs)  # every row past its prompt and its first decode step
        if decoding and len(step_times) == 8 and not profile and not SMOKE:
            # device time of a decode engine step (4 steps: 1 warm + 3 profiled; host work excluded)
            from bench.quant_matmul import device_time
            dev, top = device_time(lambda: lm.engine.step() and jnp.zeros(()), reps=3, top=8)
            profile = {"device_ms_per_step": dev * 1e3 if dev else None,
                       "top_kernels_ms_per_step": {k: v * 1e3 for k, v in top.items()}}
            continue
        for v in phases.values():
            v.clear()
        t0 = time.perf_counter()
        lm.engine.step()
        if decoding and not any(r.finished for r in reqs):
            step_times.append(time.perf_counter() - t0)
            for name, v in phases.items():
                phase_ms.setdefault(name, []).append(sum(v) * 1e3)
    total_s = time.perf_counter() - t_start
    ms = float(np.median(step_times)) * 1e3 if step_times else float("nan")
    row = dict(batch=bsz, prompt=prompt_len, new_tokens=new_tokens, sampling=sampling,
               decode_steps_timed=len(step_times), compiles_ahead=eng.counters["compiles_ahead"],
               ms_per_step=ms, mean_ms_per_step=float(np.mean(step_times)) * 1e3 if step_times else float("nan"),
               tokens_per_s=bsz / ms * 1e3, total_s=total_s, engine_steps=lm.engine.counters["steps"],
               host_phase_median_ms={k: float(np.median(v)) for k, v in phase_ms.items()}, **profile)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--batch", default="1,2")
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sampling", action="append", default=None,
                    help='SamplingParams fields, e.g. "temperature=0.7,top_p=0.9"; repeat for several runs (default '
                         'greedy)')
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(threadName)s %(name)s: %(message)s")
    logging.getLogger("flashnext_jax").setLevel(logging.INFO)  # the engine's compiles (ahead or not)
    with open(decode_step.DEMO_CONFIG if SMOKE else decode_step.REAL_CONFIG) as f:
        cfg = from_hf_config(json.load(f))
    cfg = dataclasses.replace(cfg, num_experts=min(args.experts, cfg.num_experts))
    dev = jax.devices()[0]
    print(f"{dev.device_kind} jax {jax.__version__} kernels={os.environ.get('FLASHNEXT_KERNELS', 'auto')}", flush=True)
    t0 = time.perf_counter()
    params, always, per_expert = decode_step.build(cfg, jax.random.key(0))
    jax.block_until_ready(params)
    print(f"built params in {time.perf_counter() - t0:.1f} s", flush=True)
    model = api.Model(cfg, params, table=None, dtype=jnp.bfloat16)
    rows = []
    samplings = [{k: float(v) if "." in v else int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
                 for spec in args.sampling or ["temperature=0.0"]]
    for bsz, sampling in ((int(b), sp) for b in args.batch.split(",") for sp in samplings):
        try:
            row = run_batch(model, bsz, 16 if SMOKE else args.prompt, 6 if SMOKE else args.tokens, args.page_size,
                            sampling)
            row["weight_bytes_per_step"] = always + min(cfg.num_experts, cfg.num_experts_per_tok * bsz) * per_expert
        except Exception as e:  # noqa: BLE001
            row = dict(batch=bsz, error=repr(e)[:400])
        print(row, flush=True)
        rows.append(row)
    save_result("engine_step.json", rows, args.out, smoke=SMOKE, prompt=args.prompt, page_size=args.page_size)
    print(f"\n{'B':>3} {'sampling':<28} {'ms/step':>8} {'tok/s':>8} {'device ms':>9} {'steps timed':>11}")
    for r in rows:
        sp = ",".join(f"{k}={v}" for k, v in r.get("sampling", {}).items())
        print(f"{r['batch']:3d} {sp:<28} {r.get('ms_per_step', float('nan')):8.2f} "
              f"{r.get('tokens_per_s', float('nan')):8.1f} {r.get('device_ms_per_step', float('nan')):9.2f} "
              f"{r.get('decode_steps_timed', 0):11d}")


if __name__ == "__main__":
    main()
