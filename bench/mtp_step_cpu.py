"""What an MTP decode step costs against a plain one on the CPU, program by program (issue 20).

The engine's compiled decode steps of the demo model (batch 1, float32) are captured after a short generation
and run on their own arguments, one call at a time (each waited for): the plain step (T = 1), the MTP step (T = 2:
the trunk's verify tokens, the MTP fold and the drafts) and the MTP step with its MTP head cut out (`trunk`: the
T = 2 trunk and its K1 = 2 checkpoint columns only; timing only, its drafts are the trunk's logits). Samples of
`--calls` calls alternate the programs `--samples` times, so that a slow period of the shared machine hits all of
them; min and quartiles per program, and MTP / plain. docs/demo-model.md ("MTP speed on the CPU") reads it.

    JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/mtp_step_cpu.py [--out bench/results/mtp_step_cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

import flashnext_jax as fj
from bench.engine_cpu import PROMPT_TEXTS
from flashnext_jax import runner, step_cache

PROGRAMS = ("plain", "mtp", "trunk")


def _trunk_only(self, params, store, batch, mtp_h, hyper, h_tail, logits, tail, live, L, mrope=None):
    """RealRunner._mtp cut out: no fold, no drafts (the draft logits are the trunk's)."""
    return store, jnp.broadcast_to(logits[:, :, None], (*logits.shape[:2], self.k, logits.shape[-1]))


def capture(name: str, spec_k: int, new_tokens: int):
    """(compiled decode step, its arguments) of an engine after one generation."""
    got = {}
    real_call = step_cache.StepCache.call

    def call(cache, key, args):
        out = real_call(cache, key, args)
        if cache._name == "run" and key.tokens <= 1 + spec_k:
            got["step"] = (cache.get(key), args)  # the store (args[1]) is donated: capture copies the ledger's
        return out

    real_mtp = runner.RealRunner._mtp
    step_cache.StepCache.call = call
    if name == "trunk":
        runner.RealRunner._mtp = _trunk_only
    try:
        llm = fj.LLM(None, dtype="float32", max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256,
                     page_size=16, speculative_config={"method": "mtp", "num_speculative_tokens": spec_k}
                     if spec_k else None)
        llm.generate([PROMPT_TEXTS[0]], fj.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
        llm.engine._ahead.wait_all()
    finally:
        step_cache.StepCache.call = real_call
        runner.RealRunner._mtp = real_mtp
    compiled, (params, _, batch, targets) = got["step"]
    store = jax.tree.map(lambda a: a.copy(), llm.engine.ledger.store)  # the step donates it: a private copy
    return compiled, [params, store, batch, targets]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=25)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    steps = {name: capture(name, 0 if name == "plain" else 1, 40) for name in PROGRAMS}
    times = {name: [] for name in PROGRAMS}
    for _ in range(a.samples):
        for name, (compiled, args) in steps.items():
            t0 = time.perf_counter()
            for _ in range(a.calls):
                args[1], out = compiled(*args)
                jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / a.calls * 1e3)
    stats = {}
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        stats[name] = dict(min_ms=min(ts), q25_ms=q[0], median_ms=q[1])
    ratio = {k: stats["mtp"][k] / stats["plain"][k] for k in ("min_ms", "q25_ms", "median_ms")}
    trunk = {k: stats["trunk"][k] / stats["plain"][k] for k in ("min_ms", "q25_ms", "median_ms")}
    res = dict(summary=dict(mtp_over_plain_min=ratio["min_ms"], mtp_over_plain_q25=ratio["q25_ms"],
                            trunk_over_plain_min=trunk["min_ms"], plain_min_ms=stats["plain"]["min_ms"],
                            mtp_min_ms=stats["mtp"]["min_ms"], device="cpu", jax=jax.__version__,
                            date=datetime.date.today().isoformat()),
               programs=stats, samples_ms=times, setup=dict(samples=a.samples, calls=a.calls, batch=1,
                                                            dtype="float32", model="embedded demo model"),
               machine=dict(platform=platform.platform(), cpu_count=os.cpu_count(), load_1min=os.getloadavg()[0]))
    out = a.out or os.path.join(os.environ.get("OUT", "/tmp"), "mtp_step_cpu.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{'program':8s} {'min':>8s} {'q25':>8s} {'median':>8s}  (ms per call)")
    for name, s in stats.items():
        print(f"{name:8s} {s['min_ms']:8.3f} {s['q25_ms']:8.3f} {s['median_ms']:8.3f}")
    print(f"MTP / plain: min {ratio['min_ms']:.2f}x, q25 {ratio['q25_ms']:.2f}x; trunk / plain min "
          f"{trunk['min_ms']:.2f}x; wrote {out}")


if __name__ == "__main__":
    main()
