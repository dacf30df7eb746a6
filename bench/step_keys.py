"""Which engine programs mixed server traffic needs: the soak's request generator (tests/test_server_soak.py:
random lengths, sampling options, logprobs, stops, streams, disconnects) against an in-process `flashnext serve`
app for a few minutes, recording the key of every model step and sampler the engine launched (step_programs.StepKey,
step_programs.SamplerKey), the distinct values of each key component, the compiles, and every XLA compile of the process
(jax.monitoring).

Before / after from the same launches: `one_program_keys` counts the distinct keys the engine had when the model
step and the sampler were one program (the model key's components + the sampler's: every sampling variant was a
model-step compile), `model_step_keys` / `sampler_keys` what the two programs now compile.

    python bench/step_keys.py [--seconds 180] [--model demo|toy] [--precompile] [--out FILE]

Default server: the 30-minute soak's (demo model, float32, 4 sequences, max_model_len 256, prefix caching). On a
2-core CPU a demo-model step compiles in ~10 s, so a few minutes see few keys; `--model toy` (the toy model, one
padded page-table width like the demo model's paged QSA) compiles in well under a second and shows the key set
of many more requests, under the same engine configuration.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from bench.results_io import save_result  # noqa: E402

_XLA = collections.Counter()
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: _XLA.update(["compiles"]) if event == "/jax/core/compile/backend_compile_duration"
    else None)


def record_keys(engine) -> list[dict]:
    """Every launch from now on: {"model": StepKey, "model_hit": compiled before, "sampler": SamplerKey or None,
    "sampler_hit": ..., "<program>_seconds": how long a call that compiled took}, in launch order (a step's sampler
    runs right after its model step, on the same thread)."""
    launched, steps, samplers = [], engine._steps.call, engine._samplers.call

    def timed(call, cache, key, args, record, name):
        record[name + "_hit"] = key in cache
        t0 = time.perf_counter()
        out = call(key, args)
        if not record[name + "_hit"]:
            record[name + "_seconds"] = time.perf_counter() - t0  # compile + dispatch
        return out

    def model(key, args):
        launched.append({"model": key, "sampler": None, "sampler_hit": None})
        return timed(steps, engine._steps, key, args, launched[-1], "model")

    def sampler(key, args):
        launched[-1]["sampler"] = key
        return timed(samplers, engine._samplers, key, args, launched[-1], "sampler")
    engine._steps.call, engine._samplers.call = model, sampler
    return launched


def _components(keys: list[tuple], fields: tuple[str, ...]) -> dict:
    """The distinct values of each named component, with how many launches used each."""
    out = {}
    for name in fields:
        values = collections.Counter(str(getattr(k, name)) for k in keys)
        out[name] = {"distinct": len(values), "launches": dict(values.most_common())}
    return out


def one_program_key(launch: dict) -> tuple:
    """The key this launch had when the model step and the sampler were one program: (rows, tokens, page-table
    width, device-sampling masks, logprobs, logit-bias width, prompt logprobs, grammar masks)."""
    m, s = launch["model"], launch["sampler"]
    return (m.rows, m.tokens, m.page_table_width, s and s.sampling, bool(s and s.logprobs),
            s.logit_bias_width if s else 0, m.prompt_logprobs, bool(s and s.grammar))


def _spread(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "median": xs[len(xs) // 2], "max": xs[-1], "total": sum(xs)} if xs else {"n": 0}


def summary(launched: list[dict]) -> dict:
    models = [x["model"] for x in launched]
    samplers = [x["sampler"] for x in launched if x["sampler"] is not None]
    fields = models[0]._fields[:-1] if models else ()
    return {
        "launches": len(launched), "launches_with_a_sampler": len(samplers),
        "one_program_keys": len({one_program_key(x) for x in launched}),
        "model_step_keys": len(set(models)), "sampler_keys": len(set(samplers)),
        "launches_of_uncompiled_model_steps": sum(not x["model_hit"] for x in launched),
        "launches_of_uncompiled_samplers": sum(x["sampler_hit"] is False for x in launched),
        "compile_seconds": {name: _spread([x[name + "_seconds"] for x in launched if name + "_seconds" in x])
                            for name in ("model", "sampler")},
        "model_step_components": _components(models, fields),
        "sampler_components": _components(samplers, samplers[0]._fields if samplers else ())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--model", choices=["demo", "toy"], default="demo")
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from serving.app import create_app
    from serving.cli import default_sampling, generation_defaults
    from flashnext_jax.api import DEMO_MODEL
    from flashnext_jax.llm import LLM
    from serving_harness import uvicorn_server
    from test_server_soak import Traffic

    defaults = generation_defaults("auto", DEMO_MODEL)
    t0 = time.perf_counter()
    toy = args.model == "toy"
    llm = LLM("toy" if toy else str(DEMO_MODEL), max_num_seqs=4, max_model_len=256, enable_prefix_caching=True,
              dtype="float32", precompile=args.precompile, precompile_sampling=[default_sampling(defaults)],
              **({"page_table_width": "max"} if toy else {}))
    eng = llm.engine
    startup = {"seconds": time.perf_counter() - t0, "xla_compiles": _XLA["compiles"],
               "model_steps": eng._steps.counters["compiled"], "samplers": eng._samplers.counters["compiled"]}
    launched = record_keys(eng)
    app = create_app(llm, "demo", generation_defaults=defaults)
    with uvicorn_server(app) as base:
        before = _XLA["compiles"]
        deadline = time.time() + args.seconds
        traffic = [Traffic(base, llm.runner.vocab_size, toy, deadline, seed, disconnects=seed == 0)
                   for seed in range(args.workers)]
        threads = [threading.Thread(target=t.run) for t in traffic]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    counts = {k: sum(t.counts[k] for t in traffic) for k in traffic[0].counts}
    errors = [e for t in traffic for e in t.errors]
    result = summary(launched) | {
        "startup": startup, "traffic": counts, "errors": errors[:10],
        "xla_compiles_during_traffic": _XLA["compiles"] - before,
        "model_step_compiles_during_traffic": eng.counters["compiles"],
        "sampler_compiles_during_traffic": eng.counters["sampler_compiles"],
        "model_step_compiles_ahead": eng.counters["compiles_ahead"],
        "evictions": {"model_steps": eng._steps.counters["evicted"], "samplers": eng._samplers.counters["evicted"]},
        "model_step_keys_seen": [k.components() for k in dict.fromkeys(x["model"] for x in launched)],
        "sampler_keys_seen": [k.components() for k in dict.fromkeys(x["sampler"] for x in launched) if k],
        "one_program_keys_seen": [str(k) for k in dict.fromkeys(one_program_key(x) for x in launched)]}
    path = save_result(f"step_keys_{args.model}_cpu.json", [], args.out, seconds=args.seconds, model=args.model,
                       precompile=args.precompile, **result)
    print({k: v for k, v in result.items() if not k.endswith(("_seen", "_components"))})
    for what in ("model_step_components", "sampler_components"):
        for name, c in result[what].items():
            print(f"{what} {name}: {c['distinct']} distinct: {c['launches']}")
    print("written", path)


if __name__ == "__main__":
    main()
