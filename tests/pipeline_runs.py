"""The engine runs both pipeline check scripts compare (tests/pipeline_real_check.py: stages on simulated devices of
one process; tests/pipeline_multiprocess_check.py: stages in two processes): the demo model with two concurrent
requests of mixed lengths, MTP k=1, prefix caching, chunked prefill, rows permuted every step, then a prefix hit
and a sampled request (logprobs, a logit bias). Imports jax but sets nothing: each script places its devices first."""

import jax
import numpy as np

import flashnext_jax as fj
from flashnext_jax.runner import RealRunner

MAX_LEN = 48
PROMPTS = [[7 + 3 * i for i in range(13)], [101, 5, 77]]  # mixed lengths: chunked prefill vs early decode
PARTITIONS = {1: None, 2: (5, 3), 3: None}  # PP=3 default: 3/3/2 (stage 0 has no QSA layer, stage 2 no PLE)


def _device_ids(tree) -> list[int]:
    """The devices a stage's arrays (or, for another process's stage, their types) are placed on."""
    return sorted({d.id for a in jax.tree.leaves(tree) for d in a.sharding.device_set})


def run(model, pp, **engine_kwargs):
    if pp > 1:  # as LLM(path, pipeline_parallel_size=pp) loads: on the host, each stage's share to its device
        model = fj.load(dtype="float32", device="host")
    lm = fj.LLM(RealRunner(model, 1), speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                max_num_seqs=2, max_num_batched_tokens=6, max_model_len=MAX_LEN, page_size=4, block_size=4,
                enable_prefix_caching=True, permute_rows=11, min_batch_bucket=2, min_token_bucket=4,
                pipeline_parallel_size=pp, pp_layer_partition=PARTITIONS[pp], **engine_kwargs)
    logits = {}  # (request, absolute position) -> logits row: a function of the request's own tokens only
    commit = lm.engine._commit

    def recording_commit(ticket, out):
        if "logits" not in out:  # another process's last stage, in a step where no row samples on the host
            return commit(ticket, out)
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
        out["store_devices"] = [_device_ids(s) for s in stores]
        out["param_devices"] = [_device_ids(p) for p in lm.runner.params]
        out["held"] = [isinstance(jax.tree.leaves(s)[0], jax.Array) for s in stores]  # else another process's
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
    return out, logits, lm


def solo(model) -> list[list[int]]:
    """The oracle: Model.generate's 10 greedy tokens for each of PROMPTS (dense state, no store). The short prompt
    generates 14 and keeps the first 10: 3 + 14 tokens fall in the long prompt's buckets (api._bucket: a 16-token
    prompt, a 32-token state), so the two share one compiled prefill and one decode step instead of two each
    (greedy decoding: the first 10 tokens do not depend on how many follow)."""
    return [model.generate(PROMPTS[0], 10), model.generate(PROMPTS[1], 14)[:10]]


def logit_diff(a: dict, b: dict) -> dict:
    """Positions two runs' recorded logits share, and the largest |difference| over them."""
    common = sorted(set(a) & set(b))
    return {"positions": len(common), "max_abs": float(max(np.max(np.abs(a[k] - b[k])) for k in common))}
