"""What batch invariance costs a long prompt's prefill (issue 19 beside issue 14): time to first token of one
prompt in the invariant mode (token kinds: prompt tokens on the tensor-core kernels in one configuration per
weight, `quant_matmul.invariant_config`) against the fast mode (XLA's dot / the auto dispatch).

`LLM` over `RealRunner` (`engine_step.RandomPleRunner`) on the real config with random INT4-Mixed weights, cut to
`--layers` layers and `--experts` routed experts, chunked prefill of `--chunk` tokens, B = 1, greedy, one token.
Per mode: one engine, every step shape precompiled, one warm request, then `--reps` requests of each `--lengths`
prompt, timed from add to first token (median). The modes alternate per length. JSON (`--out`, default $OUT or
bench/results, invariant_prefill.json) with a "summary" {ttft_s: {mode: {tokens: s}}, invariant_over_fast: {tokens:
x}, device, jax_version, date}; a table last.

  PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/invariant_prefill.py --layers 4   (~3 min, H100)
  JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/invariant_prefill.py --tiny --out /tmp/ip.json        (CPU check)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from bench import decode_step
from bench.engine_step import RandomPleRunner
from bench.real_size import tiny_config
from bench.results_io import save_result
from flashnext_jax import api
from flashnext_jax.config import from_hf_config
from flashnext_jax.llm import LLM
from flashnext_jax.sampling import SamplingParams

MODES = {"invariant": True, "fast": False}


def ttft(lm: LLM, prompt: list[int]) -> float:
    """Seconds from adding the request to its first token (the engine stepped here, nothing else running)."""
    t0 = time.perf_counter()
    req = lm._add(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while not req.finished:
        lm.engine.step()
    lm._forget(req.request_id)
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="real_size.py's 2-layer demo-sized model (a CPU check)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--lengths", default="8192,16384")
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (the prefill chunk)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        cfg, lengths, chunk = tiny_config(), [96, 200], 64
    else:
        with open(decode_step.REAL_CONFIG) as f:
            cfg = decode_step.cut_config(from_hf_config(json.load(f)), args.layers, args.experts)
        lengths, chunk = [int(n) for n in args.lengths.split(",")], args.chunk
    print(f"{jax.devices()[0].device_kind} jax {jax.__version__} layers={cfg.num_hidden_layers} "
          f"experts={cfg.num_experts} chunk={chunk}", flush=True)
    params, _, _ = decode_step.build(cfg, jax.random.key(0))
    model = api.Model(cfg, params, table=None, dtype=jnp.bfloat16)
    runner = RandomPleRunner(model, 0)
    engines = {}
    for mode, on in MODES.items():
        t0 = time.perf_counter()
        engines[mode] = LLM(runner, max_num_seqs=1, max_num_batched_tokens=chunk, page_size=64,
                            max_model_len=max(lengths) + 64, num_pages=-(-max(lengths) // 64) + 4,
                            batch_invariant=on, precompile=True)
        print(f"{mode}: engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    for lm in engines.values():  # one warm request each (any first-use work out of the timings)
        ttft(lm, rng.integers(0, cfg.vocab_size, chunk).tolist())
    times = {mode: {n: [] for n in lengths} for mode in MODES}
    for n in lengths:
        for _ in range(args.reps):
            prompt = rng.integers(0, cfg.vocab_size, n).tolist()
            for mode, lm in engines.items():
                times[mode][n].append(ttft(lm, prompt))
    ttft_s = {mode: {str(n): statistics.median(v) for n, v in per.items()} for mode, per in times.items()}
    ratio = {str(n): ttft_s["invariant"][str(n)] / ttft_s["fast"][str(n)] for n in lengths}
    summary = dict(ttft_s=ttft_s, invariant_over_fast=ratio, device=jax.devices()[0].device_kind,
                   jax_version=jax.__version__, date=time.strftime("%Y-%m-%d", time.gmtime()))
    path = save_result("invariant_prefill.json", [{"mode": m, "tokens": n, "ttft_s": v}
                                                  for m, per in times.items() for n, v in per.items()],
                       args.out, summary=summary, layers=cfg.num_hidden_layers, experts=cfg.num_experts, chunk=chunk,
                       tiny=args.tiny, token_kinds=engines["invariant"].engine.cfg.token_kinds)
    print(f"wrote {path}\n{'tokens':>8} {'invariant s':>12} {'fast s':>8} {'ratio':>6}")
    for n in lengths:
        print(f"{n:8d} {ttft_s['invariant'][str(n)]:12.3f} {ttft_s['fast'][str(n)]:8.3f} {ratio[str(n)]:6.2f}")


if __name__ == "__main__":
    main()
