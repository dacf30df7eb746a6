"""Run by tests/test_pipeline.py in a subprocess with 3 simulated CPU devices (XLA_FLAGS must be set before jax
is imported; the other test files keep seeing one device). Prints one JSON line of results; asserts nothing
itself, so the test names what failed."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=3").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import flashnext_jax as fj  # noqa: E402
from flashnext_jax.runner import RealRunner  # noqa: E402
from flashnext_jax.stages import StagePlanError  # noqa: E402
from pipeline_runs import MAX_LEN, PROMPTS, logit_diff, run, solo  # noqa: E402


def precompiled(pp=3):
    """LLM(..., pipeline_parallel_size=pp, precompile=True): every stage's programs of the startup shapes and the
    samplers compiled before any request; the requests then compile no model step and no sampler."""
    model = fj.load(dtype="float32", device="host")
    lm = fj.LLM(RealRunner(model, 1), speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                max_num_seqs=2, max_num_batched_tokens=6, max_model_len=MAX_LEN, page_size=4, block_size=4,
                enable_prefix_caching=True, min_batch_bucket=2, min_token_bucket=4, pipeline_parallel_size=pp,
                precompile=True)
    before = {"steps": len(lm.engine._steps), "samplers": len(lm.engine._samplers),
              "stage_programs": len(lm.engine._steps.get(lm.engine._steps.keys()[0]).stages)}
    params = fj.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ids = [lm._add(p, params, f"p{i}").request_id for i, p in enumerate(PROMPTS)]
    while lm.engine.has_unfinished():
        lm.engine.step()
    tokens = [lm.engine.requests[i].output for i in ids]
    return {"before": before, "tokens": tokens, "compiles_in_requests": lm.engine.counters["compiles"],
            "steps_after": len(lm.engine._steps), "samplers_after": len(lm.engine._samplers)}


def errors():
    from flashnext_jax.pipeline import make_pipeline

    model = fj.load(dtype="float32")
    got = {}
    for name, (n, part) in {"sum": (2, (4, 3)), "empty": (3, (8, 0, 0)), "devices": (4, None)}.items():
        try:
            make_pipeline(RealRunner(model, 0), n, part)
            got[name] = None
        except StagePlanError as e:
            got[name] = str(e)
    return got


def main():
    model = fj.load(dtype="float32")
    res, logits = {}, {}
    # PP=2 (and the token-kind run below) on one page-table width, as PP=1 runs (RealRunner.one_page_width): one
    # step shape instead of 4; PP=3 and precompiled() on the pipeline's default, widths of 1, 2, 4, 8 pages
    for pp, width in ((1, "auto"), (2, "max"), (3, "auto")):
        res[pp], logits[pp], _ = run(model, pp, page_table_width=width)
    diffs = {pp: logit_diff(logits[1], logits[pp]) for pp in (2, 3)}
    # the token-kind scheduling (EngineConfig.token_kinds) through the stages: each stage's program traced with
    # the rows' kinds (pipeline._StageFn)
    kinds, _, _ = run(model, 2, batch_invariant=True, token_kinds=True, page_table_width="max")
    print(json.dumps({"results": {str(k): v for k, v in res.items()}, "logit_diffs": {str(k): v for k, v in
                                                                                    diffs.items()},
                      "solo": solo(model), "errors": errors(), "precompiled": precompiled(),
                      "token_kinds": {k: kinds[k] for k in ("tokens", "again", "sampled", "prefix_hits")},
                      "devices": len(jax.devices())}))


if __name__ == "__main__":
    sys.exit(main())
