"""Where an async engine step's host time goes on the GPU (issue 16; docs/real-size-decode.md, "Async scheduling"):
bench/real_size.py measured the async twin's launch phase at 3.5-7 ms against 0.7 ms plain, with its phase timer
blocking after each launch. Here nothing blocks: each part of `Engine.step` (building the batch, the chain program's
launch inside it, the ledger flush, the model step's launch, the sampler, the commit) is timed on the host as the
engine runs it, and a cProfile pass names the host functions with the most own time (a blocking wait shows there), for the plain engine and its async twin (one runner: shared compiled steps), decode at B = 1 and 2.
The real config cut to --layers layers, 32 experts, random INT4-Mixed weights. Prints a table; JSON to --out.

    PYTHONPATH=. python3 bench/async_probe.py --layers 4 --out $OUT/async_probe.json     (~3 min on an H100)
    JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/async_probe.py --tiny --out /tmp/async_probe.json  (CPU check)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import decode_step  # noqa: E402
from bench.engine_step import RandomPleRunner  # noqa: E402
from bench.results_io import save_result  # noqa: E402
from flashnext_jax import api  # noqa: E402
from flashnext_jax.config import from_hf_config  # noqa: E402
from flashnext_jax.llm import LLM  # noqa: E402
from flashnext_jax.sampling import SamplingParams  # noqa: E402

PARTS = ("_build_batch", "_run_chain", "_launch_model_step", "_choose_tokens", "_commit")


def timed_parts(eng) -> dict[str, list[float]]:
    """Wrap the engine's step parts (on the instance) to record their host time, without blocking."""
    times: dict[str, list[float]] = {p: [] for p in PARTS + ("flush",)}

    def wrap(name, fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            times[name].append(time.perf_counter() - t0)
            return out
        return run
    for p in PARTS:
        setattr(eng, p, wrap(p, getattr(eng, p)))
    eng.ledger.flush = wrap("flush", eng.ledger.flush)
    return times


def run(lm: LLM, batch: int, steps: int, vocab: int) -> dict:
    eng = lm.engine
    reqs = [lm._add([(31 * i + 7 * b) % vocab for i in range(200)],
                    SamplingParams(temperature=0.0, max_tokens=2 * steps + 20, ignore_eos=True)) for b in range(batch)]
    # max_tokens covers the warm steps, the profiled pass and the timed pass: every timed step decodes every row
    for _ in range(8):  # prefill, then warm decode steps
        eng.step()
    hot = profiled_functions(eng, steps)
    times = timed_parts(eng)
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t0)
    assert all(not r.finished for r in reqs), "a request finished inside the timed steps"
    for r in reqs:
        eng.abort(r.request_id)
        lm._forget(r.request_id)
    for p in PARTS + ("flush",):
        eng.__dict__.pop(p, None)
    eng.ledger.__dict__.pop("flush", None)
    return {"step_ms": statistics.median(walls) * 1e3,
            **{f"{k.strip('_')}_ms": statistics.median(v) * 1e3 if v else 0.0 for k, v in times.items()},
            **{f"{k.strip('_')}_calls": len(v) for k, v in times.items()}, "hot_functions": hot}


def profiled_functions(eng, steps: int, top: int = 12) -> list[dict]:
    """The host functions with the most own time over `steps` engine steps (cProfile): a call that waits on the
    device (a transfer, a launch held by a buffer still in use) shows up here with its wait as own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    prof.disable()
    stats = pstats.Stats(prof).stats
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{fn}:{line}({name})".split("site-packages/")[-1], "calls_per_step": v[1] / steps,
             "own_ms_per_step": v[2] / steps * 1e3, "cum_ms_per_step": v[3] / steps * 1e3}
            for (fn, line, name), v in rows]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="real_size.py's 2-layer demo-sized model (a CPU check)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--engines", default="plain,async", help="which engines to probe (comma-separated, in order)")
    ap.add_argument("--batches", default="1,2", help="decode batch sizes (comma-separated)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        from bench.real_size import tiny_config
        cfg = tiny_config()
    else:
        with open(decode_step.REAL_CONFIG) as f:
            cfg = decode_step.cut_config(from_hf_config(json.load(f)), args.layers, 32)
    params, _, _ = decode_step.build(cfg, jax.random.key(0))
    model = api.Model(cfg, params, table=None, dtype=jnp.bfloat16)
    runner = RandomPleRunner(model, 0)
    rows = []
    engines = args.engines.split(",")
    if set(engines) - {"plain", "async"}:
        raise SystemExit(f"--engines: plain and/or async, got {args.engines!r}")
    for name in engines:
        lm = LLM(runner, max_num_seqs=2, max_num_batched_tokens=512, max_model_len=1024, page_size=64, num_pages=48,
                 prefill_buckets=(512,), page_table_width="max", compile_ahead=False, batch_invariant=False,
                 async_scheduling=name != "plain")
        for batch in [int(b) for b in args.batches.split(",")]:
            row = {"engine": name, "batch": batch, **run(lm, batch, args.steps, cfg.vocab_size)}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "hot_functions"}), flush=True)
            for h in row["hot_functions"][:6]:
                print(f"    {h['own_ms_per_step']:7.3f} ms own {h['cum_ms_per_step']:7.3f} cum "
                      f"{h['calls_per_step']:5.1f}x  {h['function']}", flush=True)
    cols = ["step_ms", "build_batch_ms", "run_chain_ms", "flush_ms", "launch_model_step_ms", "choose_tokens_ms",
            "commit_ms"]
    print("engine   B " + " ".join(f"{c[:-3]:>18}" for c in cols))
    for r in rows:
        print(f"{r['engine'][:8]:<8} {r['batch']} " + " ".join(f"{r[c]:18.3f}" for c in cols))
    save_result("async_probe.json", rows, args.out, layers=args.layers, tiny=args.tiny)


if __name__ == "__main__":
    main()
