"""Batch invariance of the real engine (issue 19): is a request's greedy output (tokens, and its logprobs, which are
functions of the logits) bitwise the same as its solo run whatever runs beside it, and what does the invariant mode
cost in decode speed?

What runs: `LLM` over `RealRunner` (`engine_step.RandomPleRunner`) on the real config with random INT4-Mixed weights
(`decode_step.build`), cut to `--layers` layers (default 12: the layer kinds in the real mix, 9 GDN + 3 QSA, PLE at
layer 2) and `--experts` routed experts (default 32), bf16 activations; `--tiny`: real_size.py's 2-layer demo-sized
model (the CPU check). One engine per mode, EngineConfig.batch_invariant True ("invariant") and False
("non_invariant"), each with max_num_seqs = 8, one prefill bucket (`--chunk`), page_table_width="max", no prefix
caching, all its step shapes (B = 1, 2, 4, 8 x decode and x the chunk) and samplers compiled before any request.

Eight random-token prompts of varied lengths, greedy, `--tokens` new tokens, logprobs=5. Each request runs alone
first (its solo run, `lm.generate([p])`); then on the same engine, each case compared with the solo runs:
  B=2     requests 0 and 1 submitted together (the second prompt is cut into chunks beside the first),
  B=8     all eight submitted together,
  mixed   requests 0-3 submitted; once all four decode, 4-7 arrive (their prefill chunks share steps with decode rows),
  repeat  requests 0 and 1 alone again (run-to-run determinism, not batching).
Per case: requests whose tokens equal solo, requests whose logprobs (the chosen token's and the top-5 list, ids and
values) are bitwise equal, the first differing output index, the largest logprob difference before the tokens part,
and the step shapes the case ran (rows x tokens, steps holding prefill and decode rows together).

Cost: ms per engine step in steady decode at B = 1 and 2 per mode (greedy, no logprobs; `--warm` steps, then
`--steps` timed one by one; `--rounds` rounds alternating the modes; median), and invariant / non-invariant (the
fastest configuration) per B. Past `--deadline-s` the remaining work is skipped and the JSON still written (after
every part). JSON: `--out` (default $OUT or bench/results, batch_invariance.json) with the "summary" (equal_tokens,
equal_logprobs, first_difference, decode_ms, cost_invariant_over_fastest), the rows, the timings; a table last.

  H200 (~4-5 min at 12 layers: weights ~0.5 min, 16 model steps + 8 samplers compiled 4 at a time ~2-3 min):
    PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/batch_invariance.py
  CPU check (2-layer demo-sized model, ~1-2 min on 2 cores; tests/test_bench_batch_invariance.py):
    JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/batch_invariance.py --tiny --out /tmp/batch_invariance_tiny.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import statistics
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from bench import decode_step, device_profile
from bench.engine_step import RandomPleRunner
from bench.real_size import _COMPILES, tiny_config  # importing real_size also counts backend compiles
from bench.results_io import save_result
from flashnext_jax import api
from flashnext_jax.config import from_hf_config
from flashnext_jax.llm import LLM
from flashnext_jax.sampling import SamplingParams

MODES = {"invariant": True, "non_invariant": False}
CASES = ("B=2", "B=8", "mixed", "repeat")
BATCHES = (1, 2)  # decode timing
NUM_PROMPTS = 8


# ---------------------------------------------------------------------------------------------------- setup


def model_config(args):
    """The real config cut to --layers layers and --experts experts (or real_size's tiny one)."""
    if args.tiny:
        cfg = tiny_config()
    else:
        with open(decode_step.REAL_CONFIG) as f:
            cfg = decode_step.cut_config(from_hf_config(json.load(f)), args.layers)
    return dataclasses.replace(cfg, num_experts=min(args.experts, cfg.num_experts))


def plan_of(args) -> dict:
    """The sizes of this run (`--tiny` scales them down for the CPU)."""
    if args.tiny:
        return dict(chunk=128, page_size=16, max_model_len=256, prompt_min=10, prompt_max=100, tokens=8, warm=2,
                    steps=6, rounds=1)
    return dict(chunk=args.chunk, page_size=args.page_size, max_model_len=args.max_model_len,
                prompt_min=args.prompt_min, prompt_max=args.prompt_max, tokens=args.tokens, warm=args.warm,
                steps=args.steps, rounds=args.rounds)


def prompt_lengths(plan: dict) -> list[int]:
    """Eight lengths spread over [prompt_min, prompt_max], the two longest first (B=2 then needs two chunks), the
    rest interleaved short/long (the mixed case's groups each hold short and long prompts)."""
    lo, hi = plan["prompt_min"], plan["prompt_max"]
    spread = [round(lo + (hi - lo) * i / (NUM_PROMPTS - 1)) for i in range(NUM_PROMPTS)]  # ascending
    return [spread[7], spread[6], spread[0], spread[3], spread[5], spread[1], spread[4], spread[2]]


def make_llm(model, mode: bool, plan: dict, rows: int = NUM_PROMPTS) -> LLM:
    ps, mml = plan["page_size"], plan["max_model_len"]
    pages = rows * -(-mml // ps) + 8  # every row at max_model_len, and slack (never 0.9 of the device)
    return LLM(RandomPleRunner(model, 0), max_num_seqs=rows, max_num_batched_tokens=plan["chunk"],
               max_model_len=mml, page_size=ps, block_size=ps, num_pages=pages, num_snapshots=2,
               enable_prefix_caching=False, prefill_buckets=(plan["chunk"],), page_table_width="max",
               compile_ahead=False, batch_invariant=mode)


def precompile(lms: dict, params: list[SamplingParams], threads: int, expired) -> dict:
    """Every engine's step shapes (startup_shapes: each row bucket x decode and x the chunk), `threads` at a time,
    then the samplers of `params` at each row bucket; a job past the deadline is skipped."""
    n0, t0 = len(_COMPILES), time.perf_counter()
    jobs = [(lm.engine, key) for lm in lms.values() for key in lm.engine.startup_shapes()]
    skipped = []

    def one(eng, keys, sampling=()):
        if expired():
            skipped.append(str(keys))
            return
        eng.precompile(keys, False, sampling_params=sampling)

    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for f in [pool.submit(one, eng, [key]) for eng, key in jobs]:
            f.result()
        for f in [pool.submit(one, lm.engine, [], params) for lm in lms.values()]:
            f.result()
    info = dict(model_steps=len(jobs), wall_s=time.perf_counter() - t0, backend_compiles=len(_COMPILES) - n0,
                backend_compile_s=sum(_COMPILES[n0:]), threads=threads, skipped=skipped)
    print(f"precompiled {len(jobs)} model steps and the samplers in {info['wall_s']:.1f} s "
          f"({info['backend_compiles']} backend compiles, {threads} at a time)", flush=True)
    return info


# ------------------------------------------------------------------------------------------------- the cases


class StepLog:
    """Records each step's rows (prefill or decode) and shape (B x T) while installed on an engine."""

    def __init__(self, eng):
        self.eng, self.steps = eng, []
        real = eng._make_ticket

        def make_ticket(plans):
            t = real(plans)
            decode = sum(1 for p in plans if p.start >= len(p.request.prompt))
            self.steps.append((t.batch_size, t.num_tokens, len(plans) - decode, decode))
            return t
        eng._make_ticket = make_ticket

    def close(self) -> dict:
        self.eng.__dict__.pop("_make_ticket", None)
        shapes: dict = {}
        for b, t, _, _ in self.steps:
            shapes[f"{b}x{t}"] = shapes.get(f"{b}x{t}", 0) + 1
        return dict(steps=len(self.steps), shapes=shapes,
                    mixed_steps=sum(1 for s in self.steps if s[2] and s[3]),
                    max_rows=max((s[2] + s[3] for s in self.steps), default=0))


def result_of(out) -> dict:
    return dict(tokens=list(out.token_ids),
                logprobs=[(lp.token_id, lp.logprob, tuple(lp.top)) for lp in out.logprobs or ()])


def run_together(lm: LLM, prompts: list, sp: SamplingParams) -> list[dict]:
    return [result_of(o) for o in lm.generate(prompts, sp)]


def run_mixed(lm: LLM, prompts: list, sp: SamplingParams) -> list[dict]:
    """The first half submitted; once each of them has its first token (all decoding), the second half arrives,
    so its prefill chunks run in steps beside decode rows."""
    half = len(prompts) // 2
    reqs = [lm._add(p, sp) for p in prompts[:half]]
    while not all(r.output or r.finished for r in reqs):
        lm.engine.step()
    reqs += [lm._add(p, sp) for p in prompts[half:]]
    while not all(r.finished for r in reqs):
        lm.engine.step()
    outs = [lm._output(r) for r in reqs]
    for r in reqs:
        lm._forget(r.request_id)
    return [result_of(o) for o in outs]


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)  # a float32 logprob is exact as a double: bitwise equality of the float32


def compare(solo: dict, got: dict) -> dict:
    """One request's output against its solo run: tokens equal, logprobs bitwise equal, first differing index of
    each, the largest |logprob difference| over the positions before the tokens part."""
    ts, tg = solo["tokens"], got["tokens"]
    first_tok = next((i for i, (a, b) in enumerate(zip(ts, tg)) if a != b), None)
    if first_tok is None and len(ts) != len(tg):
        first_tok = min(len(ts), len(tg))

    def key(entry):
        tok, lp, top = entry
        return tok, _bits(lp), tuple((i, _bits(v)) for i, v in top)
    ls, lg = solo["logprobs"], got["logprobs"]
    first_lp = next((i for i, (a, b) in enumerate(zip(ls, lg)) if key(a) != key(b)), None)
    if first_lp is None and len(ls) != len(lg):
        first_lp = min(len(ls), len(lg))
    upto = len(ls) if first_tok is None else first_tok
    diffs = [abs(a[1] - b[1]) for a, b in zip(ls[:upto], lg[:upto])]
    diffs += [abs(x - y) for a, b in zip(ls[:upto], lg[:upto]) for (i, x), (j, y) in zip(a[2], b[2]) if i == j]
    return dict(tokens_equal=first_tok is None, logprobs_equal=first_lp is None, first_token_diff=first_tok,
                first_logprob_diff=first_lp, max_abs_logprob_diff=max(diffs, default=0.0), outputs=len(tg))


def case_row(mode: str, case: str, idx: list[int], solos: list[dict], got: list[dict], steps: dict,
             seconds: float) -> dict:
    per = [dict(request=i, **compare(solos[i], g)) for i, g in zip(idx, got)]
    firsts = [min(x for x in (p["first_token_diff"], p["first_logprob_diff"]) if x is not None) for p in per
              if not (p["tokens_equal"] and p["logprobs_equal"])]
    return dict(mode=mode, case=case, requests=len(per), equal_tokens=sum(p["tokens_equal"] for p in per),
                equal_logprobs=sum(p["logprobs_equal"] for p in per), first_difference=min(firsts, default=None),
                max_abs_logprob_diff=max(p["max_abs_logprob_diff"] for p in per), per_request=per, steps=steps,
                seconds=seconds)


# ------------------------------------------------------------------------------------------------ the timing


def decode_ms(lm: LLM, prompts: list, warm: int, steps: int, around=contextlib.nullcontext) -> list[float]:
    """ms of each of `steps` engine steps in steady decode of len(prompts) rows (greedy, no logprobs); the timed
    steps run inside `around()` (the profiler's capture)."""
    eng = lm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=warm + steps + 4, ignore_eos=True)
    reqs = [lm._add(p, sp) for p in prompts]
    try:
        while not all(r.output for r in reqs):
            eng.step()
        for _ in range(warm):
            eng.step()
        times = []
        with around():
            for _ in range(steps):
                t0 = time.perf_counter()
                eng.step()
                times.append((time.perf_counter() - t0) * 1e3)
        if any(r.finished for r in reqs):
            raise RuntimeError("a request finished during the timed steps")
    finally:
        for r in reqs:
            eng.abort(r.request_id)
            lm._forget(r.request_id)
    return times


# ------------------------------------------------------------------------------------------------ the report


def summarize(rows: list[dict], timing: dict, modes) -> dict:
    frac = lambda a, n: f"{a}/{n}"  # noqa: E731
    summary: dict = {"equal_tokens": {}, "equal_logprobs": {}, "first_difference": {}, "decode_ms": {},
                     "cost_invariant_over_fastest": {}}
    for mode in modes:
        for key in ("equal_tokens", "equal_logprobs", "first_difference"):
            summary[key][mode] = {}
        for case in CASES:
            r = next((r for r in rows if r["mode"] == mode and r["case"] == case), None)
            if r is None or "error" in r:
                why = "not run" if r is None else r["error"][:80]
                for key in ("equal_tokens", "equal_logprobs", "first_difference"):
                    summary[key][mode][case] = why
                continue
            summary["equal_tokens"][mode][case] = frac(r["equal_tokens"], r["requests"])
            summary["equal_logprobs"][mode][case] = frac(r["equal_logprobs"], r["requests"])
            summary["first_difference"][mode][case] = r["first_difference"]
        summary["decode_ms"][mode] = {f"B={b}": (statistics.median(timing[mode][b]) if timing.get(mode, {}).get(b)
                                                 else None) for b in BATCHES}
    for b in BATCHES:
        inv = summary["decode_ms"].get("invariant", {}).get(f"B={b}")
        fast = summary["decode_ms"].get("non_invariant", {}).get(f"B={b}")
        summary["cost_invariant_over_fastest"][f"B={b}"] = inv / fast if inv and fast else None
    return summary


def table(summary: dict, rows: list[dict]) -> str:
    lines = [f"{'mode':<14} {'case':<7} {'tokens':>7} {'logprobs':>8} {'1st diff':>8} {'max |dlp|':>10} "
             f"{'steps':>5} {'mixed':>5} shapes"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['mode']:<14} {r['case']:<7} ERROR {r['error'][:120]}")
            continue
        first = "-" if r["first_difference"] is None else str(r["first_difference"])
        shapes = " ".join(f"{k}:{v}" for k, v in r["steps"]["shapes"].items())
        lines.append(f"{r['mode']:<14} {r['case']:<7} {r['equal_tokens']:>3}/{r['requests']:<3} "
                     f"{r['equal_logprobs']:>4}/{r['requests']:<3} {first:>8} {r['max_abs_logprob_diff']:10.3g} "
                     f"{r['steps']['steps']:5d} {r['steps']['mixed_steps']:5d} {shapes}")
    lines.append("")
    lines.append(f"{'mode':<14} " + " ".join(f"{'ms/step B=' + str(b):>13}" for b in BATCHES))
    for mode, ms in summary["decode_ms"].items():
        lines.append(f"{mode:<14} " + " ".join(f"{ms[f'B={b}']:13.3f}" if ms[f"B={b}"] else f"{'-':>13}"
                                               for b in BATCHES))
    cost = summary["cost_invariant_over_fastest"]
    lines.append(f"{'inv / fastest':<14} " + " ".join(f"{cost[f'B={b}']:13.3f}" if cost[f"B={b}"] else f"{'-':>13}"
                                                      for b in BATCHES))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ main


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="2-layer demo-sized model, short prompts: the CPU check")
    ap.add_argument("--layers", type=int, default=12, help="decoder layers kept of the real 48")
    ap.add_argument("--experts", type=int, default=32, help="routed experts kept (real: 512)")
    ap.add_argument("--modes", default=",".join(MODES), help="of " + ",".join(MODES))
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens, the one prefill bucket")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prompt-min", type=int, default=40)
    ap.add_argument("--prompt-max", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens per request")
    ap.add_argument("--warm", type=int, default=3, help="untimed decode steps before the timed ones")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per mode, B and round")
    ap.add_argument("--rounds", type=int, default=2, help="timing rounds, the modes alternating")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="per mode, that many B = 1 decode steps under the profiler: device time by kernel")
    ap.add_argument("--compile-threads", type=int, default=4, help="model steps compiled at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=480,
                    help="skip the work left once this many seconds have passed since the start (the JSON is\n"
                         "written after every part)")
    ap.add_argument("--timing-only", default="",
                    help="modes (comma-separated) that only time decode, on an engine of max_num_seqs = 2 (half the\n"
                         "step shapes to compile: the fast mode's side of the cost at the real size)")
    ap.add_argument("--merge", default=None,
                    help="comma-separated JSONs of earlier runs (e.g. one per mode, same machine): their rows and\n"
                         "timings in one JSON with the summary of all; nothing runs")
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT or bench/results, batch_invariance.json)")
    return ap.parse_args(argv)


def merge(paths: list[str], out: str | None) -> dict:
    """One result from runs that each held some of the modes (the real size compiles one mode per device call)."""
    runs = [json.load(open(p)) for p in paths]
    devices = {r["device"] for r in runs}
    if len(devices) != 1:
        raise SystemExit(f"--merge: runs on different devices {sorted(devices)}: their timings don't compare")
    rows = [row for r in runs for row in r["rows"]]
    timing = {m: {int(b.split("=")[1]): v for b, v in t.items()} for r in runs for m, t in r["timing_ms"].items()}
    modes = [m for m in MODES if m in timing]
    summary = summarize(rows, timing, modes)
    keep = {k: runs[0][k] for k in ("config", "tiny")}
    path = save_result("batch_invariance.json", rows, out, summary=summary, merged_from=[
        {k: r.get(k) for k in ("date", "device", "engines", "compile", "build_s", "timing_rounds", "total_s",
                               "decode_profile_b1")} | {"path": os.path.basename(p)} for p, r in zip(paths, runs)],
        timing_ms={m: {f"B={b}": v for b, v in t.items()} for m, t in timing.items()}, **keep)
    print(f"wrote {path}\nsummary {json.dumps(summary)}\n")
    print(table(summary, rows))
    return dict(summary=summary, rows=rows, path=path)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.merge:
        return merge([p for p in args.merge.split(",") if p], args.out)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(threadName)s %(name)s: %(message)s")
    logging.getLogger("flashnext_jax").setLevel(logging.INFO)  # the engine's compiles
    t_start = time.perf_counter()
    expired = lambda: time.perf_counter() - t_start > args.deadline_s  # noqa: E731
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES):
        raise SystemExit(f"--modes takes {','.join(MODES)}")
    plan = plan_of(args)
    cfg = model_config(args)
    dev = jax.devices()[0]
    print(f"{dev.device_kind} jax {jax.__version__} kernels={os.environ.get('FLASHNEXT_KERNELS', 'auto')} "
          f"layers={cfg.num_hidden_layers} experts={cfg.num_experts} plan={plan}", flush=True)

    t0 = time.perf_counter()
    params, _, _ = decode_step.build(cfg, jax.random.key(args.seed))
    jax.block_until_ready(params)
    build_s = time.perf_counter() - t0
    print(f"built params in {build_s:.1f} s", flush=True)
    model = api.Model(cfg, params, table=None, dtype=jnp.bfloat16)
    del params

    rng = np.random.default_rng(args.seed)
    lengths = prompt_lengths(plan)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    timing_prompts = [rng.integers(0, cfg.vocab_size, plan["prompt_max"]).tolist() for _ in BATCHES]
    sp = SamplingParams(temperature=0.0, max_tokens=plan["tokens"], ignore_eos=True, logprobs=5)
    sp_timing = SamplingParams(temperature=0.0, max_tokens=plan["warm"] + plan["steps"] + 4, ignore_eos=True)

    timing_only = [m for m in args.timing_only.split(",") if m]
    if set(timing_only) - set(modes):
        raise SystemExit(f"--timing-only takes modes of --modes ({','.join(modes)})")
    lms = {m: make_llm(model, MODES[m], plan, max(BATCHES) if m in timing_only else NUM_PROMPTS) for m in modes}
    compile_info = precompile(lms, [sp, sp_timing], args.compile_threads, expired)
    engines = {m: dict(batch_invariant=MODES[m], page_table_width=lm.engine.max_pages_per_row,
                       num_pages=lm.engine.cfg.num_pages, prefill_align=lm.engine.sched.cfg.prefill_align,
                       token_kinds=lm.engine.cfg.token_kinds, step_shapes=len(lm.engine.startup_shapes())) for m, lm in lms.items()}
    rows: list[dict] = []
    timing: dict = {m: {b: [] for b in BATCHES} for m in modes}
    timing_rounds: list[dict] = []
    profiles: dict = {}  # mode -> device time of B = 1 decode steps by kernel (--profile-steps)

    def save():
        summary = summarize(rows, timing, modes)
        for m, lm in lms.items():
            engines[m].update(model_steps_compiled_in_runs=lm.engine.counters["compiles"],
                              sampler_compiles=lm.engine.counters["sampler_compiles"])
        path = save_result("batch_invariance.json", rows, args.out, summary=summary, tiny=args.tiny,
                           config=dict(layers=cfg.num_hidden_layers, experts=cfg.num_experts,
                                       layer_types=list(cfg.layer_types), ple_layers=list(cfg.ple_layers),
                                       dtype="bfloat16", max_num_seqs=NUM_PROMPTS, prompt_lengths=lengths,
                                       logprobs=5, seed=args.seed, **plan),
                           engines=engines, compile=compile_info, timing_only=timing_only, build_s=build_s,
                           timing_rounds=timing_rounds,
                           timing_ms={m: {f"B={b}": v for b, v in t.items()} for m, t in timing.items()},
                           decode_profile_b1=profiles,
                           total_s=time.perf_counter() - t_start)
        return path, summary

    for m, lm in lms.items():  # the store's ops and first launches, before anything is timed or compared
        if not expired():
            engines[m]["warm_up_s"] = lm.engine.warm_up()

    # the cost first (seconds once compiled), the modes alternating within each round
    for rnd in range(plan["rounds"]):
        for b in BATCHES:
            for m in modes if rnd % 2 == 0 else modes[::-1]:
                if expired():
                    timing_rounds.append(dict(round=rnd, mode=m, batch=b, error="skipped: past --deadline-s"))
                    continue
                try:
                    times = decode_ms(lms[m], timing_prompts[:b], plan["warm"], plan["steps"])
                    timing[m][b] += times
                    timing_rounds.append(dict(round=rnd, mode=m, batch=b, ms_median=statistics.median(times),
                                              ms_min=min(times), ms=times))
                    print(f"{m:<14} B={b} round {rnd}: {statistics.median(times):.3f} ms/step", flush=True)
                except Exception as e:  # noqa: BLE001 - the comparisons still run
                    timing_rounds.append(dict(round=rnd, mode=m, batch=b, error=repr(e)[:400]))
                    print(f"{m} B={b} timing failed: {e!r}", flush=True)
    save()

    for m in modes if args.profile_steps > 0 else ():  # where the modes' B = 1 decode steps spend device time
        if expired():
            break
        traced: list = []

        @contextlib.contextmanager
        def around():
            with device_profile.capture() as trace:
                yield
            traced.append(trace.xspace)

        decode_ms(lms[m], timing_prompts[:1], plan["warm"], args.profile_steps, around)
        prof = device_profile.summarize(traced[0], None, top=20)
        profiles[m] = dict(steps=args.profile_steps, timeline=device_profile.timeline(traced[0]),
                           top_kernels=prof["top_kernels"])
        device_profile.print_summary(prof, f"{m} B=1 x {args.profile_steps} steps")
    save()

    for m, lm in ((m, lm) for m, lm in lms.items() if m not in timing_only):
        solos: list[dict | None] = [None] * NUM_PROMPTS
        try:
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                if expired():
                    break
                solos[i] = run_together(lm, [p], sp)[0]
            print(f"{m}: {sum(s is not None for s in solos)} solo runs in {time.perf_counter() - t0:.1f} s",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{m}: solo runs failed: {e!r}", flush=True)
            rows += [dict(mode=m, case=c, error=f"solo runs failed: {e!r}"[:400]) for c in CASES]
            save()
            continue
        for case in CASES:
            idx = {"B=2": [0, 1], "B=8": list(range(NUM_PROMPTS)), "mixed": list(range(NUM_PROMPTS)),
                   "repeat": [0, 1]}[case]
            if expired() or any(solos[i] is None for i in idx):
                rows.append(dict(mode=m, case=case, error="skipped: past --deadline-s"))
                continue
            log = StepLog(lm.engine)
            try:
                t0 = time.perf_counter()
                if case == "mixed":
                    got = run_mixed(lm, [prompts[i] for i in idx], sp)
                elif case == "repeat":
                    got = [run_together(lm, [prompts[i]], sp)[0] for i in idx]
                else:
                    got = run_together(lm, [prompts[i] for i in idx], sp)
                rows.append(case_row(m, case, idx, solos, got, log.close(), time.perf_counter() - t0))
            except Exception as e:  # noqa: BLE001 - one failed case must not hide the others
                log.close()
                rows.append(dict(mode=m, case=case, error=repr(e)[:400]))
            r = rows[-1]
            print(f"{m:<14} {case:<7} " + (f"ERROR {r['error']}" if "error" in r else
                                          f"tokens {r['equal_tokens']}/{r['requests']} logprobs "
                                          f"{r['equal_logprobs']}/{r['requests']} first diff {r['first_difference']}"),
                  flush=True)
            save()

    path, summary = save()
    print(f"\nwrote {path} in {time.perf_counter() - t_start:.0f} s\nsummary {json.dumps(summary)}\n")
    print(table(summary, rows))
    return dict(summary=summary, rows=rows, path=path)


if __name__ == "__main__":
    main()
