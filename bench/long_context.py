"""Long context end to end (issue 14): TTFT and decode ms/step of the real engine at 4K-262K-token prompts.

The real config with random weights in the INT4-Mixed scheme and ALL 512 routed experts (`decode_step.build`,
~67 GB), `LLM` over `RealRunner` (sparse QSA straight from the pages, qsa_paged.py), chunked prefill of
`--chunk` tokens (8192), page size 64, B=1, greedy. Random PLE rows as in bench/engine_step.py (no n-gram table
at this size). Per prompt length: a first request (its TTFT, and how many XLA compiles ran inside it), then a
second request of the same length (TTFT, then `--decode-steps` decode steps timed one by one: median ms/step) and
the device's peak memory. With `--profile-length N` a third request of N tokens runs its prefill under the
profiler: GPU time by model scope (bench/device_profile.py; give `XLA_FLAGS=--xla_dump_to=DIR` and `--hlo-dump DIR`
for the scopes); `--profile-decode` does the same for the decode steps of one more request per length. Writes
bench/results/long_context.json (or $OUT/...) with the issue's `summary` keys.

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 bench/long_context.py      # one H200
  LONG_BENCH_SMOKE=1 JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/long_context.py --out /tmp/lc.json  # CPU check
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from bench import decode_step, device_profile
from bench.engine_step import RandomPleRunner
from bench.results_io import save_result
from flashnext_jax import api
from flashnext_jax.config import from_hf_config
from flashnext_jax.llm import LLM
from flashnext_jax.sampling import SamplingParams

SMOKE = bool(os.environ.get("LONG_BENCH_SMOKE"))
_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: _COMPILES.append(secs) if event == "/jax/core/compile/backend_compile_duration" else None)


def peak_gb():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", 0) / 1e9 or None


def one_request(lm, prompt, decode_steps: int, profile_decode: bool = False) -> dict:
    """Step the engine for one request: TTFT (add -> first token), compiles inside it, decode step times.
    profile_decode: the decode steps after the first two run under the profiler ("trace", "profiled_steps")."""
    n_compiles = len(_COMPILES)
    t0 = time.perf_counter()
    req = lm._add(prompt, SamplingParams(max_tokens=1 + decode_steps, temperature=0.0, ignore_eos=True))
    ttft, steps, trace = None, [], None
    with contextlib.ExitStack() as profiling:
        while not req.finished:
            if profile_decode and trace is None and len(steps) == 2:
                trace = profiling.enter_context(device_profile.capture())
            ts = time.perf_counter()
            lm.engine.step()
            if ttft is None and req.output:
                ttft = time.perf_counter() - t0
                first_compiles = len(_COMPILES) - n_compiles
                first_compile_s = sum(_COMPILES[n_compiles:])
            elif ttft is not None:
                steps.append(time.perf_counter() - ts)
    return dict(ttft_s=ttft, compiles_before_first_token=first_compiles, compile_s_before_first_token=first_compile_s,
                decode_ms=statistics.median(steps) * 1e3 if steps else None, decode_steps=len(steps),
                trace=trace, profiled_steps=max(len(steps) - 2, 0) if trace else 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=512, help="routed experts kept (real: 512)")
    ap.add_argument("--lengths", default="4096,32768,131072,262144")
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--twice-up-to", type=int, default=32768,
                    help="lengths up to this run a first and a second request; longer ones one (no new shapes)")
    ap.add_argument("--num-pages", type=int, default=None,
                    help="the KV page pool's size (default: the engine's sizing from --gpu-memory-utilization); "
                         "needed under XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async, which reports no memory limit")
    ap.add_argument("--no-precompile", action="store_true",
                    help="compile in the requests instead of at startup (a quick memory check of the default pool)")
    ap.add_argument("--profile-length", type=int, default=None,
                    help="profile the prefill of one more request of this many tokens (must be one of --lengths)")
    ap.add_argument("--profile-decode", action="store_true",
                    help="per length, one more request whose decode steps (after two) run under the profiler: "
                         "GPU time per decode step by model scope")
    ap.add_argument("--hlo-dump", default=None, help="the --xla_dump_to directory (maps kernels to model scopes)")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="EngineConfig.batch_invariant (default: the engine's, on; GPU results before stop 46 ran with it off)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    with open(decode_step.DEMO_CONFIG if SMOKE else decode_step.REAL_CONFIG) as f:
        cfg = from_hf_config(json.load(f))
    cfg = dataclasses.replace(cfg, num_experts=min(args.experts, cfg.num_experts))
    lengths = [64, 160] if SMOKE else [int(n) for n in args.lengths.split(",")]
    chunk, decode = (32, 3) if SMOKE else (args.chunk, args.decode_steps)
    print(f"{jax.devices()[0].device_kind} jax {jax.__version__} experts={cfg.num_experts} chunk={chunk}", flush=True)
    t0 = time.perf_counter()
    params, _, _ = decode_step.build(cfg, jax.random.key(0))
    jax.block_until_ready(params)
    print(f"built params in {time.perf_counter() - t0:.1f} s, peak {peak_gb()} GB", flush=True)
    model = api.Model(cfg, params, table=None, dtype=jnp.bfloat16)

    n0, t0 = len(_COMPILES), time.perf_counter()
    max_len = min(max(lengths) + decode + 64, cfg.max_position_embeddings)  # prompt + output <= the model's
    pool_sizing = f"gpu_memory_utilization {args.gpu_memory_utilization} (the engine's default sizing)"
    if args.num_pages:
        pool_sizing = f"num_pages {args.num_pages} (given)"

    def start(num_pages=None):
        return LLM(RandomPleRunner(model, 0), max_num_seqs=1, max_num_batched_tokens=chunk,
                   page_size=args.page_size, max_model_len=max_len, num_pages=num_pages,
                   gpu_memory_utilization=args.gpu_memory_utilization, precompile=not args.no_precompile,
                   batch_invariant=args.batch_invariant)

    lm = start(args.num_pages)
    startup = dict(startup_s=time.perf_counter() - t0, startup_compiles=len(_COMPILES) - n0,
                   startup_compile_s=sum(_COMPILES[n0:]), num_pages=lm.engine.cfg.num_pages)
    print(startup, flush=True)
    rng = np.random.default_rng(0)
    rows = []

    def save(summary=None):
        return save_result("long_context.json", rows, args.out, summary=summary, smoke=SMOKE, chunk=chunk,
                           page_size=args.page_size, experts=cfg.num_experts, pool_sizing=pool_sizing,
                           batch_invariant=lm.engine.cfg.batch_invariant, **startup)

    for n in lengths:
        row = dict(prompt_tokens=n)
        n = min(n, max_len - decode - 1)  # the 262K row: a 262,127-token prompt, so that its decode fits too
        row["prompt_tokens_run"] = n
        try:
            if lm.engine.dead is not None:  # an earlier length killed it (e.g. out of memory): a smaller pool
                del lm
                pages = -(-max_len // args.page_size) + 8
                pool_sizing = f"num_pages {pages} (one max_model_len row: the default sizing failed)"
                lm = start(pages)
            if n <= args.twice_up_to:
                first = one_request(lm, rng.integers(0, cfg.vocab_size, n).tolist(), 0)
                row.update(ttft_first_s=first["ttft_s"],
                           compiles_in_first_request=first["compiles_before_first_token"],
                           compile_s_in_first_request=first["compile_s_before_first_token"])
            second = one_request(lm, rng.integers(0, cfg.vocab_size, n).tolist(), decode)
            row.update(ttft_s=second["ttft_s"], compiles_in_request=second["compiles_before_first_token"],
                       decode_ms=second["decode_ms"], decode_steps=second["decode_steps"], peak_mem_gb=peak_gb(),
                       pool_sizing=pool_sizing)
            if n == args.profile_length:
                with device_profile.capture() as trace:
                    profiled = one_request(lm, rng.integers(0, cfg.vocab_size, n).tolist(), 0)
                row["profile"] = device_profile.summarize(trace.xspace, args.hlo_dump)
                row["profile"]["ttft_s_under_profiler"] = profiled["ttft_s"]
                device_profile.print_summary(row["profile"], f"prefill of {n} tokens")
            if args.profile_decode:
                profiled = one_request(lm, rng.integers(0, cfg.vocab_size, n).tolist(), decode, profile_decode=True)
                steps = max(profiled["profiled_steps"], 1)
                prof = device_profile.summarize(profiled["trace"].xspace, args.hlo_dump)
                row["decode_profile"] = dict(
                    steps=profiled["profiled_steps"], decode_ms_under_profiler=profiled["decode_ms"],
                    ms_per_step=prof["total_ms"] / steps,
                    by_scope_ms_per_step={k: v / steps for k, v in prof["by_scope"].items()},
                    top_kernels=[k | {"ms_per_step": k["ms"] / steps} for k in prof["top_kernels"]])
                device_profile.print_summary(prof, f"{profiled['profiled_steps']} decode steps at {n} tokens")
        except Exception as e:  # noqa: BLE001  (an OOM at one length must not hide the others)
            row["error"] = repr(e)[:400]
        print({k: v for k, v in row.items() if k not in ("profile", "decode_profile")}, flush=True)
        rows.append(row)
        save()

    by = {r["prompt_tokens"]: r for r in rows}
    key = {4096: "4k", 32768: "32k", 131072: "128k", 262144: "262k"}
    summary = {f"ttft_s_{key[n]}": by.get(n, {}).get("ttft_s") for n in key}
    summary |= {f"decode_ms_{key[n]}": by.get(n, {}).get("decode_ms") for n in key}
    ratio = lambda a, b: a / b if a and b else None
    summary |= dict(decode_128k_over_4k=ratio(summary["decode_ms_128k"], summary["decode_ms_4k"]),
                    first_over_second_ttft_32k=ratio(by.get(32768, {}).get("ttft_first_s"), summary["ttft_s_32k"]),
                    peak_mem_gb_262k=by.get(262144, {}).get("peak_mem_gb"),
                    startup_compile_s=startup["startup_compile_s"], device=jax.devices()[0].device_kind,
                    jax_version=jax.__version__, date=time.strftime("%Y-%m-%d", time.gmtime()))
    path = save(summary)
    print(f"wrote {path}\n{'tokens':>8} {'TTFT 1st s':>10} {'TTFT s':>8} {'compiles 1st':>12} {'decode ms':>9} "
          f"{'peak GB':>8}")
    for r in rows:
        f = lambda k, w, p: f"{r[k]:{w}.{p}f}" if isinstance(r.get(k), (int, float)) else f"{'-':>{w}}"
        print(f"{r['prompt_tokens']:8d} {f('ttft_first_s', 10, 2)} {f('ttft_s', 8, 2)} "
              f"{f('compiles_in_first_request', 12, 0)} {f('decode_ms', 9, 2)} {f('peak_mem_gb', 8, 1)}")


if __name__ == "__main__":
    main()
