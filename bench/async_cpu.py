"""Async scheduling on the CPU (EngineConfig.async_scheduling, docs/real-size-decode.md): tokens/s of the embedded
demo model through `LLM.generate` with and without it, batch 1 and 2, greedy, a fixed number of new tokens (EOS
ignored). Both engines share one runner (its compiled steps) and run one after the other, alternating, `--reps`
times each (single CPU runs on the shared 2-core machine scatter: compare medians of interleaved runs). On the
CPU the "device" is XLA's own threads on the same cores, so the host's batch building and commit can overlap the
step only where a core is free: this shows the mechanism and its outputs, not the GPU's figure
(`bench/real_size.py --async-scheduling`). Writes bench/results/async_cpu.json (or --out) with a "summary".

    JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/async_cpu.py [--new-tokens 64] [--reps 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashnext_jax as fj  # noqa: E402
from bench.results_io import save_result  # noqa: E402
from flashnext_jax.runner import RealRunner  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    runner = RealRunner(fj.load(dtype=args.dtype), 0)
    prompts = [[(7 * i + 3 * b + 1) % 500 for i in range(args.prompt_len)] for b in range(2)]
    sp = fj.SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    rows, summary = [], {}
    for bs in (1, 2):
        engines = {mode: fj.LLM(runner, max_num_seqs=bs, max_num_batched_tokens=128, max_model_len=256, page_size=16,
                                num_pages=64, async_scheduling=mode == "async") for mode in ("sync", "async")}
        outputs = {}
        for mode, llm in engines.items():  # warm-up: every shape this run uses, compiled
            outputs[mode] = [o.token_ids for o in llm.generate(prompts[:bs], sp)]
            llm.engine._ahead.wait_all()
        assert outputs["async"] == outputs["sync"], "async scheduling changed the output"
        times = {mode: [] for mode in engines}
        for _ in range(args.reps):
            for mode, llm in engines.items():
                t0 = time.perf_counter()
                llm.generate(prompts[:bs], sp)
                times[mode].append(time.perf_counter() - t0)
        for mode, llm in engines.items():
            med = statistics.median(times[mode])
            rows.append(dict(batch=bs, mode=mode, seconds=times[mode], median_s=med,
                             tokens_per_s=bs * args.new_tokens / med,
                             chained_rows=llm.engine.counters["chained_rows"]))
            print(f"B={bs} {mode:<6} median {med * 1e3:8.1f} ms  {bs * args.new_tokens / med:7.1f} tok/s", flush=True)
        summary[f"async_over_sync_b{bs}"] = statistics.median(times["sync"]) / statistics.median(times["async"])
        del engines
    summary["load_average_1min"] = os.getloadavg()[0]
    path = save_result("async_cpu.json", rows, args.out, summary=summary, new_tokens=args.new_tokens,
                       prompt_len=args.prompt_len, reps=args.reps, dtype=args.dtype)
    print(f"wrote {path}\nsummary {summary}")
    return summary


if __name__ == "__main__":
    main()
