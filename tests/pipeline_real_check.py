"""Run by tests/test_pipeline.py in a subprocess with 3 simulated CPU devices (XLA_FLAGS must be set before jax
is imported; the other test files keep seeing one device). Prints one JSON line of results; asserts nothing
itself, so the test names what failed."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=3"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import flashnext_jax as fj  # noqa: E402
from flashnext_jax.runner import RealRunner  # noqa: E402
from flashnext_jax.stages import StagePlanError  # noqa: E402

MAX_LEN = 48
PROMPTS = [[7 + 3 * i for i in range(13)], [101, 5, 77]]  # mixed lengths: chunked prefill vs early decode
PARTITIONS = {1: None, 2: (5, 3), 3: None}  # PP=3 default: 3/3/2 (stage 0 has no QSA layer, stage 2 no PLE)


def run(model, pp):
    if pp > 1:  # as LLM(path, pipeline_parallel_size=pp) loads: on the host, each stage's share to its device
        model = fj.load(dtype="float32", device="host")
    lm = fj.LLM(RealRunner(model, 1), speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                max_num_seqs=2, max_num_batched_tokens=6, max_model_len=MAX_LEN, page_size=4, block_size=4,
                enable_prefix_caching=True, permute_rows=11, min_batch_bucket=2, min_token_bucket=4,
                pipeline_parallel_size=pp, pp_layer_partition=PARTITIONS[pp])
    logits = {}  # (request, absolute position) -> logits row: a function of the request's own tokens only
    commit = lm.engine._commit

    def recording_commit(ticket, out):
        lg = np.asarray(out["logits"])
        for r in ticket.rows:
            for c in range(lg.shape[1]):
                if r.base + c < r.n:
                    logits[(r.request_id, r.start + r.base + c)] = lg[r.row, c]
        return commit(ticket, out)
    lm.engine._commit = recording_commit
    params = fj.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ids = [lm._add(p, params, f"r{i}").request_id for i, p in enumerate(PROMPTS)]
    while lm.engine.has_unfinished():
        lm.engine.step()
    out = {"tokens": [lm.engine.requests[i].output for i in ids], "counters": dict(lm.engine.counters)}
    if pp > 1:
        stores = lm.engine.ledger.store
        out["store_devices"] = [sorted({d.id for a in jax.tree.leaves(s) for d in a.devices()}) for s in stores]
        out["param_devices"] = [sorted({d.id for a in jax.tree.leaves(p) for d in a.devices()})
                                for p in lm.runner.params]
        out["gdn_layers_per_stage"] = [int(s.slot["gdn_rec"].shape[2]) for s in stores]
        out["bytes_between_stages"] = lm.runner.bytes_between_stages
    # the second request restarts from the first one's prefix: a prefix hit on every stage's snapshot
    lm2_ids = lm._add(PROMPTS[0] + [9], params, "again").request_id
    while lm.engine.has_unfinished():
        lm.engine.step()
    out["again"] = lm.engine.requests[lm2_ids].output
    out["prefix_hits"] = lm.engine.ledger.stats["prefix_hits"]
    # logprobs and a logit bias: the engine's sampler after the model step, on the last stage's devices
    biased = fj.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, logit_bias={5: 3.0})
    req = lm.engine.requests[lm._add(PROMPTS[1], biased, "biased").request_id]
    while lm.engine.has_unfinished():
        lm.engine.step()
    out["sampled"] = {"tokens": req.output, "top": [[i for i, _ in lp.top] for lp in req.logprobs],
                      "samplers": len(lm.engine._samplers)}
    return out, logits


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
    for pp in (1, 2, 3):
        res[pp], logits[pp] = run(model, pp)
    diffs = {}
    for pp in (2, 3):
        common = sorted(set(logits[1]) & set(logits[pp]))
        diffs[pp] = {"positions": len(common),
                     "max_abs": float(max(np.max(np.abs(logits[1][k] - logits[pp][k])) for k in common))}
    solo = [model.generate(p, 10) for p in PROMPTS]
    print(json.dumps({"results": {str(k): v for k, v in res.items()}, "logit_diffs": {str(k): v for k, v in
                                                                                    diffs.items()},
                      "solo": solo, "errors": errors(), "precompiled": precompiled(),
                      "devices": len(jax.devices())}))


if __name__ == "__main__":
    sys.exit(main())
