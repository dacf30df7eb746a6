"""SamplingParams.logit_bias and SamplingParams.prompt_logprobs on the toy model, against the pure-Python fold
(an independent computation of the logits): the bias is honoured on every token-choosing path (device argmax,
device sampling, host sampling with penalties, MTP verification greedy and by rejection sampling), logprobs stay
those of the raw logits, and prompt logprobs equal the fold's log-softmax at every prompt position, one-shot,
chunked, with MTP and with the prefix cache on (a request asking for them never takes a prefix hit)."""

import numpy as np
import pytest

from flashnext_jax.llm import LLM
from flashnext_jax.sampling import SamplingParams
from flashnext_jax.toy_model import ToyConfig, fold, head, logits_row

MAX_LEN = 32
CFG = ToyConfig(vocab_size=64, max_model_len=MAX_LEN)
SHAPES = dict(min_batch_bucket=4, min_token_bucket=4, min_pool_capacity=(4, 64, 4))  # share compiled steps
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [1, 4, 1, 4, 2]]
MTP = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}


def _llm(**kw):
    return LLM(CFG, max_model_len=MAX_LEN, block_size=4, **SHAPES, **kw)


def _raw_logits(tokens) -> np.ndarray:
    """float64 logits of the toy model after `tokens` (the fold: no engine code)."""
    s = fold(CFG, list(tokens))
    return logits_row(CFG, head(CFG, s.rec, s.att)).astype(np.float64)


def _log_softmax(x):
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def _greedy_with_bias(prompt, n, bias, repetition_penalty=1.0):
    """Greedy decoding with the bias added to the logits first, then the repetition penalty (vLLM's order)."""
    out = []
    for _ in range(n):
        x = _raw_logits(prompt + out)
        for t, b in bias.items():
            x[t] += b
        if repetition_penalty != 1.0:
            for t in set(prompt + out):
                x[t] = x[t] / repetition_penalty if x[t] > 0 else x[t] * repetition_penalty
        out.append(int(np.argmax(x)))
    return out


@pytest.mark.parametrize("case", ["greedy", "greedy_mtp", "greedy_host_penalties"])
def test_logit_bias_greedy_equals_the_biased_fold(case):
    """Greedy tokens equal the argmax of fold logits + bias (device argmax; MTP greedy verification; host argmax
    after penalties), batched with an unbiased request that keeps its own tokens; logprobs are the raw ones."""
    prompt = PROMPTS[0]
    unbiased = _greedy_with_bias(prompt, 6, {})
    # push the unbiased choices down and two other tokens up, so the biased run must differ
    bias = {unbiased[0]: -50.0, unbiased[1]: -7.5, 40: 2.5, 17: 3.0}
    pen = 1.3 if case == "greedy_host_penalties" else 1.0
    llm = _llm(max_num_seqs=2, **(MTP if case.endswith("mtp") else {}))
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias=bias, logprobs=2,
                             repetition_penalty=pen),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=pen)]
    got, plain = llm.generate([prompt, PROMPTS[1]], params)
    want = _greedy_with_bias(prompt, 6, bias, pen)
    assert want != _greedy_with_bias(prompt, 6, {}, pen)  # the bias matters for this prompt
    assert got.token_ids == want
    assert plain.token_ids == _greedy_with_bias(PROMPTS[1], 6, {}, pen)
    for i, lp in enumerate(got.logprobs):  # raw log-softmax, not the biased one
        ref = _log_softmax(_raw_logits(prompt + want[:i]))
        assert lp.token_id == want[i] and abs(lp.logprob - ref[want[i]]) < 1e-5
        assert [t for t, _ in lp.top] == list(np.argsort(-ref, kind="stable")[:2])


@pytest.mark.parametrize("case", ["sampled_device", "sampled_host_penalties", "sampled_mtp"])
def test_logit_bias_sampling_only_draws_allowed_tokens(case):
    """-100 on every token but three: each sampled token (device sampling; host sampling with penalties; MTP
    rejection sampling, whose target and draft distributions both carry the bias) is one of the three, and its
    logprob is still the raw log-softmax of the fold."""
    allowed = [11, 29, 50]
    bias = {t: -100.0 for t in range(CFG.vocab_size) if t not in allowed}
    kw = dict(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=0)
    if case == "sampled_host_penalties":
        kw["presence_penalty"] = 0.5
    llm = _llm(max_num_seqs=2, **(MTP if case.endswith("mtp") else {}))
    got, plain = llm.generate(PROMPTS[:2], [SamplingParams(logit_bias=bias, **kw), SamplingParams(**kw)])
    assert set(got.token_ids) <= set(allowed) and len(set(got.token_ids)) > 1, got.token_ids
    assert not set(plain.token_ids) <= set(allowed), plain.token_ids  # the unbiased neighbour is unaffected
    for i, lp in enumerate(got.logprobs):
        ref = _log_softmax(_raw_logits(PROMPTS[0] + got.token_ids[:i]))
        assert abs(lp.logprob - ref[got.token_ids[i]]) < 1e-5


def test_logit_bias_validation():
    assert SamplingParams(logit_bias={3: 1e6, 4: -1e6}).logit_bias == {3: 100.0, 4: -100.0}  # clamped like vLLM
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad in ({3: float("nan")}, {3: float("inf")}, {-1: 1.0}, {"3": 1.0}, {True: 1.0}, {3: "x"}, [(3, 1.0)]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="logit_bias token ids .*64"):
        _llm().generate([PROMPTS[0]], SamplingParams(logit_bias={64: 1.0}))


def _check_prompt_logprobs(out, n_top):
    prompt = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        got, ref = out.prompt_logprobs[pos], _log_softmax(_raw_logits(prompt[:pos]))
        assert got.token_id == prompt[pos] and abs(got.logprob - ref[prompt[pos]]) < 1e-5, (pos, got)
        top = np.argsort(-ref, kind="stable")[:n_top]
        assert [t for t, _ in got.top] == list(top)
        np.testing.assert_allclose([x for _, x in got.top], ref[top], atol=1e-5)


@pytest.mark.parametrize("budget,mtp", [(64, False), (4, False), (5, True)])
def test_prompt_logprobs_equal_the_fold(budget, mtp):
    """One-shot (budget 64) and chunked prefill (chunks of 4 and 5 tokens), without and with MTP; batched with a
    request that asks for none (its prompt_logprobs is None) and one with a bias (prompt logprobs stay raw)."""
    llm = _llm(max_num_seqs=3, max_num_batched_tokens=budget, **(MTP if mtp else {}))
    params = [SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=3),
              SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0, logit_bias={5: 9.0})]
    outs = llm.generate(PROMPTS, params)
    _check_prompt_logprobs(outs[0], 3)
    assert outs[1].prompt_logprobs is None
    _check_prompt_logprobs(outs[2], 0)


def test_prompt_logprobs_skip_the_prefix_cache():
    """With the prefix cache on, a repeated prompt hits the cache, except for a request asking for prompt
    logprobs: it computes (and reports) every position, as vLLM does."""
    llm = _llm(max_num_seqs=1, enable_prefix_caching=True)
    prompt = PROMPTS[1]
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate([prompt], greedy)
    (hit,) = llm.generate([prompt], greedy)
    assert hit.metrics["num_cached_tokens"] > 0  # the cache does hit for this prompt
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))
    assert out.metrics["num_cached_tokens"] == 0
    _check_prompt_logprobs(out, 2)
    assert out.token_ids == hit.token_ids


def test_prompt_logprobs_validation():
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
