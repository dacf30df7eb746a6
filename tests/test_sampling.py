"""Sampling params validation, logits processing, seeding, and MTP verification (exact greedy, unbiased sampled)."""

import numpy as np
import pytest

from flashnext_jax.sampling import (SamplingParams, apply_penalties, nucleus_mask, probs_from_logits, propose,
                                    propose_argmax, sample, verify, verify_argmax)


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"),
    (dict(min_p=1.1), "min_p"), (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(max_tokens=0), "max_tokens"), (dict(seed=-1), "seed"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(n=2), "n"),
])
def test_invalid_values_raise_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kw)


def test_stop_normalised_to_tuple():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop_token_ids=[np.int64(3)]).stop_token_ids == (3,)


def test_greedy_is_argmax_after_penalties():
    logits = np.array([1.0, 3.0, 2.9, 0.0])
    p = SamplingParams(temperature=0.0)
    assert sample(logits, p, [0], 0) == 1
    pen = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample(logits, pen, [0, 1], 1) == 2  # 3.0 / 2 < 2.9


def test_presence_and_frequency_apply_to_output_only():
    x = apply_penalties(np.zeros(4), SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), [1, 1, 2, 2, 2],
                        num_prompt=2)
    assert list(x) == [0.0, 0.0, -2.5, 0.0]


def test_top_k_top_p_min_p_masks():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert np.count_nonzero(probs_from_logits(logits, SamplingParams(top_k=2))) == 2
    assert np.count_nonzero(probs_from_logits(logits, SamplingParams(top_p=0.79))) == 2
    assert np.count_nonzero(probs_from_logits(logits, SamplingParams(top_p=0.81))) == 3
    p = probs_from_logits(logits, SamplingParams(min_p=0.5))
    assert np.count_nonzero(p) == 2 and np.isclose(p.sum(), 1.0)


def test_seed_fixes_the_stream_per_output_index():
    logits = np.zeros(50)
    p = SamplingParams(temperature=1.0, seed=11)
    a = [sample(logits, p, [], i) for i in range(20)]
    assert a == [sample(logits, p, [], i) for i in range(20)]
    assert a != [sample(logits, SamplingParams(temperature=1.0, seed=12), [], i) for i in range(20)]
    assert SamplingParams(temperature=1.0).with_defaults().seed is not None


def test_nan_logits_are_an_error_not_a_token():
    with pytest.raises(FloatingPointError):
        sample(np.array([0.0, np.nan]), SamplingParams(temperature=0.0), [], 0)


def test_greedy_verify_is_exact():
    target = np.array([[0, 5, 0], [0, 0, 5], [5, 0, 0]], float)
    g = SamplingParams(temperature=0.0)
    assert verify(target, [1, 2], [None, None], g, [0], 0) == (2, [1, 2, 0])  # all accepted + bonus
    assert verify(target, [1, 0], [None, None], g, [0], 0) == (1, [1, 2])  # second rejected -> target's token
    assert verify(target, [2, 2], [None, None], g, [0], 0) == (0, [1])
    # penalties see the accepted drafts: token 1 is penalised after it was accepted (5 / 2 < 4.9)
    t2 = np.array([[0, 5, 4.9], [0, 5, 4.9]], np.float32)
    rep = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert verify(t2, [1], [None], rep, [0], 0) == (1, [1, 2])
    assert verify(t2, [1], [None], g, [0], 0) == (1, [1, 1])
    assert t2.tolist() == np.array([[0, 5, 4.9], [0, 5, 4.9]], np.float32).tolist()  # logits never modified


@pytest.mark.parametrize("q_kind", ["sampled", "deterministic"])
def test_rejection_sampling_matches_target_distribution(q_kind):
    """First emitted token ~ p exactly, whatever the draft distribution q (chi-square, 6 bins, 20k draws)."""
    p_logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    q_logits = np.log(np.array([0.05, 0.1, 0.5, 0.05, 0.2, 0.1]))
    p_true = np.exp(p_logits)
    counts = np.zeros(6)
    n = 20000
    for seed in range(n):
        sp = SamplingParams(temperature=1.0, seed=seed)
        if q_kind == "sampled":
            drafts, qs = propose(q_logits[None], sp, 0)
        else:
            drafts, qs = [seed % 3], [None]
        m, toks = verify(np.stack([p_logits, p_logits]), drafts, qs, sp, [], 0)
        counts[toks[0]] += 1
    chi2 = float(((counts - n * p_true) ** 2 / (n * p_true)).sum())
    assert chi2 < 20.5, (chi2, counts / n)  # 5 dof, p ~ 0.001


def test_sampled_acceptance_rate_is_sum_of_min_p_q():
    p_logits = np.log(np.array([0.5, 0.5, 1e-9]))
    q_logits = np.log(np.array([0.5, 0.25, 0.25]))
    acc = 0
    for seed in range(4000):
        sp = SamplingParams(temperature=1.0, seed=seed)
        d, q = propose(q_logits[None], sp, 0)
        acc += verify(np.stack([p_logits, p_logits]), d, q, sp, [], 0)[0]
    assert abs(acc / 4000 - 0.75) < 0.03


def _full_sort_nucleus(p, top_p):
    order = np.argsort(-p, kind="stable")
    csum = np.cumsum(p[order])
    mask = np.zeros(p.shape[0], dtype=bool)
    mask[order[(csum - p[order]) < top_p]] = True
    return mask


@pytest.mark.parametrize("vocab", [1000, 248320])
@pytest.mark.parametrize("shape", ["peaked", "medium", "flat", "ties"])
def test_nucleus_equals_the_full_sort(vocab, shape):
    """The thresholded partial sort picks exactly the full sort's top-p set (ties broken by token id)."""
    rng = np.random.default_rng()
    x = rng.standard_normal(vocab)
    if shape == "peaked":
        x = x * 8
    elif shape == "medium":
        x = x * 3.5
    elif shape == "ties":  # few distinct values: ties straddle every threshold
        x = np.round(x * 4) / 2
    p = np.exp(x - x.max())
    p /= p.sum()
    for top_p in (1e-9, 0.3, 0.9, 0.95, 0.999999):
        np.testing.assert_array_equal(nucleus_mask(p, top_p), _full_sort_nucleus(p, top_p), err_msg=f"top_p={top_p}")


def test_device_argmax_commit_equals_host_verify_and_propose():
    """Greedy rows without penalties commit from the step's device argmax and finite flags
    (step_programs.with_device_sampling): the same tokens as verify / propose on the full logits, ties included."""
    import jax.numpy as jnp

    from flashnext_jax.device_sampling import SamplingInputs
    from flashnext_jax.step_programs import with_device_sampling

    rng = np.random.default_rng(7)
    g = SamplingParams(temperature=0.0)
    assert g.device_argmax and not SamplingParams(temperature=0.0, repetition_penalty=1.1).device_argmax
    assert not SamplingParams(temperature=0.7).device_argmax
    none = SamplingInputs.for_rows([None] * 3, 3)

    def step_outputs(logits, dlogits):
        fake_step = lambda p, s, b: (s, {"logits": jnp.asarray(logits), "draft_logits": jnp.asarray(dlogits)})  # noqa: E731
        return {k: np.asarray(v) for k, v in with_device_sampling(fake_step)(None, None, None, none)[1].items()}

    for trial in range(40):
        logits = rng.integers(0, 4, size=(3, 4, 9)).astype(np.float32)  # [B, K1, V], small integers: many ties
        dlogits = rng.integers(0, 4, size=(3, 4, 2, 9)).astype(np.float32)
        out = step_outputs(logits, dlogits)
        for row in range(3):
            drafts = [int(np.argmax(logits[row, i])) if trial % 2 else int(rng.integers(9)) for i in range(3)]
            assert verify_argmax(out["logits_argmax"][row], out["logits_finite"][row], drafts, "r") == verify(
                logits[row], drafts, [None] * 3, g, [1], 0, "r")
            assert propose_argmax(out["draft_logits_argmax"][row, 1], out["draft_logits_finite"][row, 1], "r") == \
                propose(dlogits[row, 1], g, 0, "r")
    bad = np.full((3, 1, 3), 1.0, np.float32)
    bad[0, 0, 1] = np.nan
    out = step_outputs(bad, bad[:, :, None])
    with pytest.raises(FloatingPointError):
        verify_argmax(out["logits_argmax"][0], out["logits_finite"][0], [], "r")
    with pytest.raises(FloatingPointError):
        propose_argmax(out["draft_logits_argmax"][0, 0], out["draft_logits_finite"][0, 0], "r")
