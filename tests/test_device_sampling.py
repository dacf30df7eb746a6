"""Device-side sampling (flashnext_jax/device_sampling.py) against the host reference (sampling.probs_from_logits),
its distribution, its independence of the batch, and the engine's use of it."""

import jax.numpy as jnp
import numpy as np
import pytest

import jax

from flashnext_jax.device_sampling import (LogitBias, SamplerInputs, SamplingInputs, device_sampled,
                                           mask_modes, masked_probs, sample_tokens, verify_tokens,
                                           verify_with_uniforms)
from flashnext_jax import sampling
from flashnext_jax.sampling import verify_sampled
from flashnext_jax.engine import Engine, EngineConfig
from flashnext_jax.sampling import SamplingParams, probs_from_logits
from flashnext_jax.structured_output import StructuredOutputsParams
from flashnext_jax.toy_model import ToyConfig, ToyRunner

PARAMS = [dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.3, top_k=5), dict(temperature=0.9, top_p=0.8),
          dict(temperature=1.0, min_p=0.05), dict(temperature=0.7, top_k=40, top_p=0.95, min_p=0.01),
          dict(temperature=1.0, top_p=0.3), dict(temperature=2.0, top_k=1),
          dict(temperature=4.0, top_p=0.99), dict(temperature=1.0, top_k=280)]  # past TOP_CAP = 256 of 300: the sort


@pytest.mark.parametrize("kw", PARAMS)
def test_masked_probs_equal_the_host_distribution(kw):
    rng = np.random.default_rng(len(str(kw)))
    logits = (rng.standard_normal((4, 300)) * 3).astype(np.float32)
    p = SamplingParams(**kw)
    one = lambda v: jnp.full((4,), v)  # noqa: E731
    modes = dict(zip(("top_k_mode", "use_top_p"), mask_modes(np.full(4, max(p.top_k, 0)), np.full(4, p.top_p))))
    got = np.asarray(masked_probs(jnp.asarray(logits), one(p.temperature), one(max(p.top_k, 0)), one(p.top_p),
                                  one(p.min_p), **modes))
    if kw.get("top_p", 1) == 0.99:  # this case must take the full-sort fallback
        ref0 = probs_from_logits(logits[0].astype(np.float64), p)
        assert np.count_nonzero(ref0) > 256
    for row in range(4):
        ref = probs_from_logits(logits[row].astype(np.float64), p)
        assert np.array_equal(got[row] > 0, ref > 0), kw  # the same support (top-k / top-p / min-p sets)
        np.testing.assert_allclose(got[row], ref, rtol=2e-5, atol=1e-7)


def test_tied_logits_follow_the_host_tie_rules():
    logits = np.array([[2.0, 1.0, 2.0, 1.0, 1.0, 0.0]], np.float32)
    for kw in (dict(top_k=2), dict(top_k=3), dict(top_p=0.5), dict(top_p=0.75)):
        p = SamplingParams(temperature=1.0, **kw)
        one = lambda v: jnp.full((1,), v)  # noqa: E731
        got = np.asarray(masked_probs(jnp.asarray(logits), one(1.0), one(p.top_k), one(p.top_p), one(p.min_p),
                                      top_k_mode="cap" if p.top_k > 0 else "off", use_top_p=p.top_p < 1))[0]
        assert np.array_equal(got > 0, probs_from_logits(logits[0].astype(np.float64), p) > 0), kw


def test_rows_without_a_mask_are_unchanged_by_another_rows_mask():
    """A batch's mask modes are the union of its rows' masks: a row without top-k / top-p gets the same
    probabilities in any mode (so its tokens do not depend on what its batch neighbours ask for)."""
    rng = np.random.default_rng(7)
    logits = jnp.asarray((rng.standard_normal((3, 300)) * 3).astype(np.float32))
    temperature, top_k, top_p, min_p = (jnp.asarray(a) for a in ([0.7, 1.0, 1.0], [0, 20, 0], [1.0, 1.0, 0.9],
                                                                 [0.0, 0.0, 0.0]))
    plain = np.asarray(masked_probs(logits[:1], temperature[:1], top_k[:1], top_p[:1], min_p[:1],
                                    top_k_mode="off", use_top_p=False))[0]
    for top_k_mode in ("off", "cap", "sort"):
        for use_top_p in (False, True):
            got = np.asarray(masked_probs(logits, temperature, top_k, top_p, min_p, top_k_mode=top_k_mode,
                                          use_top_p=use_top_p))
            np.testing.assert_array_equal(got[0], plain)
    with pytest.raises(ValueError, match="top_k_mode"):
        masked_probs(logits, temperature, top_k, top_p, min_p, top_k_mode="all", use_top_p=False)


def test_mask_modes_and_the_traced_branches():
    """The masks a batch uses are chosen on the host, so a step that samples with a temperature or top-k alone has
    no device-value branch (lax.cond: on the H200 it made the jitted call wait for the step to run); only top-p keeps
    one (its nucleus may end past the TOP_CAP largest entries: the full-sort fallback)."""
    def rows(*params):
        return [(SamplingParams(**kw), 0) for kw in params]
    cases = [(rows(dict(temperature=0.7)), ("off", False), 0, 0),
             (rows(dict(temperature=0.7), dict(temperature=1.0, top_k=50)), ("cap", False), 0, 0),
             (rows(dict(temperature=1.0, top_k=257)), ("sort", False), 0, 1),
             (rows(dict(temperature=0.7), dict(temperature=1.0, top_p=0.9)), ("off", True), 1, 1),
             (rows(dict(temperature=1.0, top_k=5, top_p=0.9, min_p=0.1)), ("cap", True), 1, 1)]
    for rs, masks, conds, sorts in cases:
        inputs = SamplingInputs.for_rows(rs + [None], len(rs) + 1)
        assert inputs.masks == masks
        jaxpr = str(jax.make_jaxpr(sample_tokens)(jnp.zeros((len(rs) + 1, 2, 300)), inputs))
        assert jaxpr.count("cond[") == conds, (masks, jaxpr.count("cond["))
        assert jaxpr.count(" sort[") == sorts, (masks, jaxpr.count(" sort["))


def test_samples_follow_the_distribution_and_ignore_the_batch():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(6) * 1.5).astype(np.float32)
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    n = 6000
    inputs = SamplingInputs.for_rows([(p, j) for j in range(n)], n)  # output indices 0..n-1 of one request
    tokens = np.asarray(sample_tokens(jnp.broadcast_to(jnp.asarray(logits), (n, 1, 6)), inputs))[:, 0]
    expect = probs_from_logits(logits.astype(np.float64), p)
    counts = np.bincount(tokens, minlength=6)
    assert counts[expect == 0].sum() == 0
    keep = expect > 0
    chi2 = (((counts[keep] - n * expect[keep]) ** 2) / (n * expect[keep])).sum()
    assert chi2 < 25.0, (counts, expect * n)  # 5 dof at most: p(chi2 > 25) < 2e-4
    # token j of the request is the same in any row, next to any other rows
    other = SamplingParams(temperature=1.0, seed=5)
    rows = [(other, 3), None, (p, 17), (other, 0)]
    batched = np.asarray(sample_tokens(jnp.broadcast_to(jnp.asarray(logits), (4, 1, 6)),
                                       SamplingInputs.for_rows(rows, 4)))[2, 0]
    assert batched == tokens[17]


@pytest.mark.parametrize("parts", [(1, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (2, 0, 0),
                                   (2, 1, 1)])
def test_sampler_inputs_cross_in_one_array_and_unpack_to_the_same_bits(parts):
    """Every part of a step's sampler inputs that is present comes back bit for bit inside jit (floats and key
    words bit-cast through int32), and which parts are present is static (parts[0] = 2: the verify form)."""
    rows = [(SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, top_k=7, seed=3), 5), None,
            (SamplingParams(temperature=1.3, seed=2**31 + 7), 0)]
    inputs = SamplingInputs.for_rows(rows, 3) if parts[0] == 1 else None
    if parts[0] == 2:  # 3 columns: row 0's last known token at column 0 with two drafts, row 2's at column 2
        inputs = SamplingInputs.for_verify_rows([rows[0] + (0, [11, 12]), None, rows[2] + (2, [])], 3, 3)
        assert inputs.key_data.shape == (3, 3, 2) and inputs.drafts.tolist() == [[11, 12, -1], [-1] * 3, [-1] * 3]
        assert inputs.masks[2] == 3
    bias = LogitBias.for_rows([{5: -1.5, 9: 2.25}, None, {1: float("-inf")}], 3) if parts[1] else None
    mask = np.random.default_rng(0).integers(-2**31, 2**31, (3, 2, 4), dtype=np.int64).astype(np.int32) \
        if parts[2] else None
    packed = SamplerInputs.pack(inputs, bias, mask)
    assert packed.words.dtype == np.int32 and packed.words.shape[0] == 3
    got = jax.jit(lambda p: p.unpack())(jax.device_put(packed))
    for want, have in zip((inputs, bias, mask), got):
        assert (want is None) == (have is None)
        if want is not None:
            for w, h in zip(jax.tree.leaves(want), jax.tree.leaves(have)):
                h = np.asarray(h)
                assert h.dtype == w.dtype and np.array_equal(h.view(np.int32), w.view(np.int32))
    if inputs is not None:
        assert got[0].masks == inputs.masks
    assert SamplerInputs.pack(None, None, None) is None


def test_which_rows_sample_on_the_device():
    assert device_sampled(SamplingParams(temperature=0.7, top_p=0.9), 0)
    assert device_sampled(SamplingParams(temperature=0.7), 1)  # MTP drafts verified on the device
    grammar = StructuredOutputsParams(regex="[ab]+")
    assert device_sampled(SamplingParams(temperature=0.7, structured_outputs=grammar), 0)
    assert not device_sampled(SamplingParams(temperature=0.7, structured_outputs=grammar), 1)  # host-drawn drafts
    assert not device_sampled(SamplingParams(temperature=0.7, presence_penalty=0.5), 0)
    assert not device_sampled(SamplingParams(temperature=0.0), 0)  # greedy: the device argmax


def _reference_verify(p: np.ndarray, drafts: list[int], u_accept, u_draw) -> list[int]:
    """Rejection sampling of one row's drafts (q one-hot at each draft), written from the textbook rule in numpy
    float64: accept d_i iff u < p_i(d_i); at the first rejection draw from p_i without d_i by the inverse CDF;
    after nd acceptances draw the bonus from p_nd."""
    out = []
    for i in range(len(drafts) + 1):
        pi = p[i].astype(np.float64)
        if i < len(drafts):
            if u_accept[i] < pi[drafts[i]]:
                out.append(drafts[i])
                continue
            pi = pi.copy()
            pi[drafts[i]] = 0.0
        c = np.cumsum(pi)
        return out + [int(min(np.searchsorted(c, u_draw[i] * c[-1], side="right"), len(pi) - 1))]
    raise AssertionError("unreachable")


def test_verify_with_uniforms_equals_the_textbook_rule():
    """The device's decision per row (tokens per column, acceptances, read up to the first rejection by the host's
    verify_sampled) equals the reference on random distributions, drafts and uniforms, over rows with 0-3 drafts."""
    rng = np.random.default_rng(3)
    b, k1, v = 64, 4, 12
    p = rng.dirichlet(np.full(v, 0.3), size=(b, k1)).astype(np.float32)
    nds = rng.integers(0, k1, b)
    drafts = np.full((b, k1), -1, np.int32)
    for row, nd in enumerate(nds):  # drafts that are often the most likely token, as an MTP head's are
        for i in range(nd):
            drafts[row, i] = int(np.argmax(p[row, i])) if rng.random() < 0.6 else int(rng.integers(v))
    u_accept, u_draw = rng.random((b, k1)).astype(np.float32), rng.random((b, k1)).astype(np.float32)
    tokens, accepted = (np.asarray(a) for a in jax.jit(verify_with_uniforms)(p, drafts, u_accept, u_draw))
    decided = rejected = 0
    for row, nd in enumerate(nds):
        d = drafts[row, :nd].tolist()
        m, got = verify_sampled(tokens[row], accepted[row, :nd], np.ones(nd + 1, bool), d, str(row))
        assert got == _reference_verify(p[row], d, u_accept[row], u_draw[row]), row
        decided, rejected = decided + 1, rejected + (m < nd)
    assert decided == b and 10 < rejected < b - 10  # both outcomes exercised


def test_device_verification_is_distributed_as_the_target():
    """Over many keys, the first committed token of a column that tests a draft d is distributed as p (accepted
    with probability p(d), else a draw from p without d), and the acceptance rate is p(d); a draft with p(d) = 0 is
    never accepted. A control: taking the draw from p (not without d) puts too much mass on d."""
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05, 1e-30], np.float32))
    n, draft = 4000, 1
    params = SamplingParams(temperature=1.0, seed=11)
    rows = [(params, j, 0, [draft]) for j in range(n)]  # output index j: every row its own keys
    inputs = SamplingInputs.for_verify_rows(rows, n, 2)
    tokens, accepted = (np.asarray(a) for a in jax.jit(verify_tokens)(jnp.broadcast_to(jnp.asarray(logits),
                                                                                       (n, 2, 6)), inputs))
    expect = np.exp(logits) / np.exp(logits).sum()
    first = tokens[:, 0]
    assert abs(accepted[:, 0].mean() - expect[draft]) < 4 * np.sqrt(expect[draft] * (1 - expect[draft]) / n)
    assert np.array_equal(first[accepted[:, 0]], np.full(accepted[:, 0].sum(), draft))
    counts = np.bincount(first, minlength=6)
    keep = expect > 1e-6
    assert counts[~keep].sum() == 0
    chi2 = (((counts[keep] - n * expect[keep]) ** 2) / (n * expect[keep])).sum()
    assert chi2 < 25.0, (counts, expect * n)
    # the control: a draw from p itself where the draft was rejected gives d probability p(d) + (1 - p(d)) p(d)
    u_draw = np.asarray(jax.random.uniform(jax.random.key(0), (n, 2)))
    wrong = np.where(accepted[:, 0], draft, [int(np.searchsorted(np.cumsum(expect), u * expect.sum(), "right"))
                                             for u in u_draw[:, 0]])
    counts = np.bincount(wrong, minlength=6)
    assert (((counts[keep] - n * expect[keep]) ** 2) / (n * expect[keep])).sum() > 25.0
    # a draft the target gives no mass is never accepted
    inputs0 = SamplingInputs.for_verify_rows([(params, j, 0, [5]) for j in range(200)], 200, 2)
    _, acc0 = jax.jit(verify_tokens)(jnp.broadcast_to(jnp.asarray(logits), (200, 2, 6)), inputs0)
    assert not np.asarray(acc0)[:, 0].any()


@pytest.mark.parametrize("k", [0, 1, 2])
def test_engine_samples_on_the_device_batch_invariant(monkeypatch, k):
    """Seeded sampled requests (no penalties; k MTP drafts, verified on the device) give the same tokens batched as
    solo, never copy logits (or draft logits) to the host, and the same seed gives the same tokens twice."""
    from flashnext_jax import host_outputs

    cfg = ToyConfig(vocab_size=64, max_model_len=32)
    runner = ToyRunner(cfg, max(k, 1))
    fetched = set()
    real = host_outputs.HostOutputs.__getitem__
    monkeypatch.setattr(host_outputs.HostOutputs, "__getitem__",
                        lambda self, name: fetched.add(name) or real(self, name))

    masks = [dict(top_k=20), dict(), dict(top_p=0.8)]  # each row its own: the batched steps use their union

    engines = []

    def run(prompts, seeds, masks=masks):
        eng = Engine(runner, EngineConfig(max_model_len=32, min_batch_bucket=4, min_token_bucket=4,
                                          min_pool_capacity=(4, 64, 4), num_speculative_tokens=k))
        engines.append(eng)
        for i, (prompt, seed, mask) in enumerate(zip(prompts, seeds, masks)):
            eng.add_request(str(i), prompt, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=seed,
                                                           **mask))
        while eng.has_unfinished():
            eng.step()
        return [eng.requests[str(i)].output for i in range(len(prompts))]

    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1], [1, 4, 1, 4, 2, 1, 3, 5, 6]]
    batched = run(prompts, [1, 2, 3])
    assert batched == [run([p], [s], [m])[0] for p, s, m in zip(prompts, [1, 2, 3], masks)]
    assert batched == run(prompts, [1, 2, 3])
    assert len({tuple(o) for o in batched + run(prompts, [4, 5, 6])}) == 6  # different seeds, different tokens
    assert "logits" not in fetched and "draft_logits" not in fetched and "logits_sample" in fetched
    if k:  # drafts were verified, some accepted and some rejected
        drafts = sum(e.counters["drafts"] for e in engines)
        accepted = sum(e.counters["accepted"] for e in engines)
        assert "logits_accept" in fetched and 0 < accepted < drafts, (accepted, drafts)


def test_mtp_engine_samples_from_the_same_distribution_as_without_mtp(monkeypatch):
    """The engine with MTP drafts verified on the device against the engine without MTP, sampling at temperature 1
    on a toy model of 8 tokens: over 2,000 seeds each, the distribution of the second and third output tokens (those
    an accepted draft or a rejection's draw can give) is the same (chi-square two-sample test). A control: the MTP
    engine that commits every draft (acceptance forced) differs."""
    runner = ToyRunner(ToyConfig(vocab_size=8, max_model_len=32), 1)
    prompt, n = [3, 1, 4, 1, 5], 2000

    def tokens(k):
        eng = Engine(runner, EngineConfig(max_model_len=32, max_num_seqs=64, min_batch_bucket=64,
                                          min_token_bucket=4, num_speculative_tokens=k))
        for i in range(n):
            eng.add_request(str(i), prompt, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=i))
        while eng.has_unfinished():
            eng.step()
        out = np.array([eng.requests[str(i)].output for i in range(n)])
        return out, eng.counters["accepted"], eng.counters["drafts"]

    plain, _, _ = tokens(0)
    mtp, accepted, drafts = tokens(1)
    assert 0 < accepted < drafts

    def chi2(a, b):
        ca, cb = np.bincount(a, minlength=8), np.bincount(b, minlength=8)
        keep = (ca + cb) > 0
        return (((ca - cb)[keep] ** 2) / (ca + cb)[keep]).sum(), int(keep.sum()) - 1  # equal sample sizes

    for j in (1, 2):
        stat, dof = chi2(plain[:, j], mtp[:, j])
        assert stat < dof + 5 * np.sqrt(2 * dof), (j, stat, dof)  # ~p < 1e-3 under the same distribution
    # every draft committed whatever the device decided
    monkeypatch.setattr(sampling, "verify_sampled", lambda tokens, accepted, finite, drafts, rid: (
        len(drafts), list(drafts) + [int(tokens[len(drafts)])]))
    forced, _, _ = tokens(1)
    stat, dof = chi2(plain[:, 1], forced[:, 1])
    assert stat > dof + 5 * np.sqrt(2 * dof), (stat, dof)
