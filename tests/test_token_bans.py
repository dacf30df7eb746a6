"""min_tokens, allowed_token_ids and bad_words (flashnext_jax/token_bans.py) on the toy model, on every
token-choosing path: the device argmax (greedy), device sampling, device verification of MTP drafts (sampled), host
sampling with penalties, greedy MTP verification. Greedy outputs equal the argmax over the allowed tokens of the
pure-Python fold's logits (no engine code), computed per output index; sampled rows never take a banned token, equal
their solo runs, and (device sampling) equal a run with the ban written as a -100 logit bias (an independent path)."""

import numpy as np
import pytest

from flashnext_jax.llm import LLM
from flashnext_jax.sampling import SamplingParams
from flashnext_jax.token_bans import TokenBans, bad_words_token_ids
from flashnext_jax.tokenizer import toy_tokenizer
from flashnext_jax.toy_model import ToyConfig, fold, head, logits_row

MAX_LEN = 40
CFG = ToyConfig(vocab_size=64, max_model_len=MAX_LEN)
SHAPES = dict(min_batch_bucket=4, min_token_bucket=4, min_pool_capacity=(4, 64, 4))
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [1, 4, 1, 4, 2]]
MTP = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}
EOS = CFG.eos_token_id
PATHS = ["greedy", "greedy_mtp", "greedy_host_penalties"]


def _llm(path: str, **kw):
    return LLM(CFG, max_model_len=MAX_LEN, block_size=4, **SHAPES, **(MTP if "mtp" in path else {}), **kw)


def _pen(path: str) -> float:
    return 1.3 if "penalties" in path else 1.0


def _reference(prompt, n, banned_at, bias=None, repetition_penalty=1.0, stop=(EOS,)):
    """Greedy decoding on the fold's float64 logits: bias added, the repetition penalty, then the argmax among the
    tokens not in banned_at(index, output so far); stops after a token of `stop`."""
    out = []
    for i in range(n):
        s = fold(CFG, list(prompt) + out)
        x = logits_row(CFG, head(CFG, s.rec, s.att)).astype(np.float64)
        for t, b in (bias or {}).items():
            x[t] += b
        if repetition_penalty != 1.0:
            for t in set(list(prompt) + out):
                x[t] = x[t] / repetition_penalty if x[t] > 0 else x[t] * repetition_penalty
        x[list(banned_at(i, out))] = -np.inf
        out.append(int(np.argmax(x)))
        if out[-1] in stop:
            break
    return out


def _greedy(path, **kw):
    return SamplingParams(temperature=0.0, repetition_penalty=_pen(path), **kw)


@pytest.mark.parametrize("path", PATHS)
def test_greedy_allowed_token_ids_and_bad_words_equal_the_restricted_fold(path):
    """Batched: a request with allowed_token_ids, one with bad words (a two-token word taken from its own
    unrestricted output, so the ban changes it, and a one-token word), and an unrestricted one."""
    free = _reference(PROMPTS[1], 8, lambda i, out: (), repetition_penalty=_pen(path), stop=())
    pair = free[2:4]
    allowed = [t for t in range(5, 64, 3)]
    words = [f"w{pair[0]} w{pair[1]}", f"w{free[6]}"]
    params = [_greedy(path, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed),
              _greedy(path, max_tokens=8, ignore_eos=True, bad_words=words),
              _greedy(path, max_tokens=8, ignore_eos=True)]
    got = _llm(path, max_num_seqs=3).generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], params)

    want_allowed = _reference(PROMPTS[0], 8, lambda i, out: set(range(64)) - set(allowed), repetition_penalty=_pen(
        path), stop=())
    assert want_allowed != _reference(PROMPTS[0], 8, lambda i, out: (), repetition_penalty=_pen(path), stop=())
    assert got[0].token_ids == want_allowed

    def bad(i, out):
        return {free[6]} | ({pair[1]} if out and out[-1] == pair[0] else set())
    want_bad = _reference(PROMPTS[1], 8, bad, repetition_penalty=_pen(path), stop=())
    assert want_bad != free and got[1].token_ids == want_bad
    assert got[2].token_ids == _reference(PROMPTS[2], 8, lambda i, out: (), repetition_penalty=_pen(path), stop=())


@pytest.mark.parametrize("path", PATHS)
def test_min_tokens_bans_eos_and_stop_ids_until_exactly_min_tokens(path):
    """EOS (pushed up by +100, so it is the argmax at every position) and a stop token id (likewise) come exactly at
    output index min_tokens; under MTP the draft head proposes them earlier and the verification rejects them."""
    stop_tok = 23
    params = [_greedy(path, max_tokens=10, min_tokens=4, logit_bias={EOS: 100.0}),
              _greedy(path, max_tokens=10, min_tokens=3, logit_bias={stop_tok: 100.0}, stop_token_ids=[stop_tok]),
              _greedy(path, max_tokens=10, logit_bias={EOS: 100.0})]
    llm = _llm(path, max_num_seqs=3)
    got = llm.generate(PROMPTS, params)
    pen = _pen(path)
    assert got[0].token_ids == _reference(PROMPTS[0], 10, lambda i, out: {EOS} if i < 4 else (), {EOS: 100.0}, pen)
    assert len(got[0].token_ids) == 5 and got[0].token_ids[-1] == EOS and got[0].finish_reason == "stop"
    assert got[1].token_ids == _reference(PROMPTS[1], 10, lambda i, out: {EOS, stop_tok} if i < 3 else (),
                                          {stop_tok: 100.0}, pen, stop=(EOS, stop_tok))
    assert len(got[1].token_ids) == 4 and got[1].token_ids[-1] == stop_tok
    assert got[2].token_ids == [EOS]  # no min_tokens: the bias ends it at once
    if "mtp" in path:
        assert got[0].metrics["num_drafts"] > got[0].metrics["num_accepted"]  # EOS drafts were rejected


@pytest.mark.parametrize("path", PATHS)
def test_bans_are_exact_per_column(path):
    """Bans that start or end inside a step's columns (MTP: a draft accepted at column 0, column 1 choosing the
    next output index): min_tokens m with the free output's own token at index m as the stop token (the output is
    exactly the free output's first m + 1 tokens), and each consecutive pair of the free output as a bad word (its
    second token banned exactly after its first, drafts included)."""
    pen = _pen(path)
    free = _reference(PROMPTS[0], 8, lambda i, out: (), repetition_penalty=pen, stop=())
    ms = [m for m in range(1, 6) if free[m] not in free[:m] and free[m] != EOS]
    pairs = [free[j:j + 2] for j in range(0, 5)]
    params = [_greedy(path, max_tokens=8, min_tokens=m, stop_token_ids=[free[m]]) for m in ms]
    params += [_greedy(path, max_tokens=8, ignore_eos=True, bad_words=[f"w{a} w{b}"]) for a, b in pairs]
    got = _llm(path, max_num_seqs=len(params)).generate([PROMPTS[0]] * len(params), params)
    assert len(ms) >= 3
    for m, out in zip(ms, got):
        assert out.token_ids == free[: m + 1] and out.finish_reason == "stop", (m, out.token_ids)
    for (a, b), out in zip(pairs, got[len(ms):]):
        want = _reference(PROMPTS[0], 8, lambda i, o: {b} if o and o[-1] == a else (), repetition_penalty=pen,
                          stop=())
        assert out.token_ids == want, ((a, b), out.token_ids, want)
    if "mtp" in path:
        assert sum(o.metrics["num_accepted"] for o in got) > len(got)  # drafts were accepted across the bans


SAMPLED = ["sampled_device", "sampled_mtp", "sampled_host_penalties"]


def _sampled(path, **kw):
    extra = {"presence_penalty": 0.5} if "penalties" in path else {}
    return SamplingParams(temperature=1.0, seed=7, **extra, **kw)


@pytest.mark.parametrize("path", SAMPLED)
def test_sampled_rows_never_take_a_banned_token_and_equal_their_solo_runs(path):
    allowed = [11, 29, 50, EOS]
    params = [_sampled(path, max_tokens=10, allowed_token_ids=allowed, min_tokens=10),
              _sampled(path, max_tokens=10, min_tokens=3, logit_bias={EOS: 100.0}),
              _sampled(path, max_tokens=10, ignore_eos=True, bad_words=["w11", "w29 w50"])]
    llm = _llm(path, max_num_seqs=3)
    batched = llm.generate(PROMPTS, params)
    solo = [llm.generate([p], sp)[0] for p, sp in zip(PROMPTS, params)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in solo]
    a, m, b = (o.token_ids for o in batched)
    assert len(a) == 10 and set(a) <= set(allowed) - {EOS} and len(set(a)) > 1, a
    assert len(m) == 4 and m[-1] == EOS and EOS not in m[:3], m
    assert 11 not in b and all(b[i:i + 2] != [29, 50] for i in range(len(b))), b
    if path == "sampled_device":  # the same draws as the ban written as a -100 bias (exp(-100) is 0 in float32)
        (biased,) = llm.generate([PROMPTS[0]], _sampled(path, max_tokens=10, ignore_eos=True, logit_bias={
            t: -100.0 for t in range(64) if t not in allowed[:3]}))
        assert biased.token_ids == a


def test_bad_words_tokenization_and_masks():
    """vLLM's rule: with a leading space only where it gives another first token and as many tokens; the last token
    is banned after the word's other tokens, in the output (drafts included), not the prompt."""
    tok = toy_tokenizer()
    assert bad_words_token_ids(["w5 w7", " w9"], tok.encode) == ((5, 7), (9,))
    spaced = {"ab": [1, 2], " ab": [3, 2], "cd": [4], " cd": [5, 6]}
    assert bad_words_token_ids(["ab", "cd"], spaced.__getitem__) == ((1, 2), (3, 2), (4,))
    bans = TokenBans(64, min_tokens=2, min_tokens_ids=[EOS], bad_words=[(5, 7), (9,)])
    banned = lambda masks: [set(np.flatnonzero(~row)) for row in _unpack(masks)]  # noqa: E731
    assert banned(bans.column_masks([1], [5, 3])) == [{EOS, 9}, {7, 9}, {9}]  # index 1 < 2, then after 5
    assert banned(bans.column_masks([5], [])) == [{EOS, 7, 9}]  # after the output's 5 (a prompt's would not count)
    assert TokenBans(64, min_tokens=2, min_tokens_ids=[EOS]).column_masks([1, 2], [3]) is None  # past min_tokens


def _unpack(masks):
    from flashnext_jax.structured_output import allowed_tokens
    return allowed_tokens(masks, 64)


def test_validation():
    for bad, field in ((dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=17), "min_tokens"),
                       (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[-1]),
                                                                           "allowed_token_ids"),
                       (dict(bad_words=[""]), "bad_words"), (dict(truncate_prompt_tokens=0), "truncate_prompt"),
                       (dict(skip_special_tokens=None), "skip_special_tokens")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(max_tokens=16, **bad)
    llm = _llm("greedy")
    with pytest.raises(ValueError, match=r"allowed_token_ids token ids \[64\]"):
        llm.generate([PROMPTS[0]], SamplingParams(allowed_token_ids=[3, 64]))
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        llm.engine.add_request("x", PROMPTS[0], SamplingParams(bad_words=["w3"]))


def test_truncate_prompt_tokens_and_special_tokens_in_the_text():
    llm = _llm("greedy")
    greedy = dict(temperature=0.0, max_tokens=3, ignore_eos=True)
    (cut,) = llm.generate([PROMPTS[1]], SamplingParams(truncate_prompt_tokens=5, **greedy))
    (last5,) = llm.generate([PROMPTS[1][-5:]], SamplingParams(**greedy))
    assert cut.prompt_token_ids == PROMPTS[1][-5:] and cut.token_ids == last5.token_ids
    (whole,) = llm.generate([PROMPTS[1]], SamplingParams(truncate_prompt_tokens=-1, **greedy))
    assert whole.prompt_token_ids == PROMPTS[1]
    with pytest.raises(ValueError, match="greater than max_model_len"):
        llm.generate([PROMPTS[1]], SamplingParams(truncate_prompt_tokens=MAX_LEN + 1, **greedy))
    # EOS forced at output indices 1 to 3 (ignore_eos): kept in the text only without skip_special_tokens
    forced = dict(greedy, max_tokens=4, logit_bias={EOS: 100.0}, allowed_token_ids=[EOS, 9], min_tokens=1)
    outs = llm.generate([PROMPTS[0]] * 3, [
        SamplingParams(**forced), SamplingParams(**forced, skip_special_tokens=False),
        SamplingParams(**forced, skip_special_tokens=False, spaces_between_special_tokens=False)])
    assert [o.token_ids for o in outs] == [[9, EOS, EOS, EOS]] * 3
    assert [o.text for o in outs] == ["w9", "w9 <eos> <eos> <eos>", "w9 <eos><eos><eos>"]


def test_async_scheduling_chains_only_rows_no_ban_reaches():
    """Async scheduling (toy runner without MTP): a min_tokens row chains once min_tokens is past (its stop token
    comes exactly at index m, the free output's own token there), rows with bad words never chain; the outputs
    equal the synchronous engine's and the restricted fold's."""
    from flashnext_jax.engine import Engine, EngineConfig
    from flashnext_jax.toy_model import ToyRunner

    free = _reference(PROMPTS[0], 12, lambda i, out: (), stop=())
    m = next(m for m in range(5, 10) if free[m] not in free[:m] and free[m] != EOS)
    words = ((free[1], free[2]),)
    requests = [(PROMPTS[0], _greedy("greedy", max_tokens=12, min_tokens=m, stop_token_ids=[free[m]])),
                (PROMPTS[0], _greedy("greedy", max_tokens=4, ignore_eos=True, bad_words_token_ids=words)),
                (PROMPTS[1], _greedy("greedy", max_tokens=12, ignore_eos=True))]

    def run(**kw):
        eng = Engine(ToyRunner(CFG, 0), EngineConfig(max_model_len=MAX_LEN, max_num_seqs=4, batch_invariant=False,
                                                     **SHAPES, **kw))
        for i, (prompt, params) in enumerate(requests):
            eng.add_request(str(i), prompt, params)
        while eng.has_unfinished():
            eng.step()
        return [eng.requests[str(i)].output for i in range(len(requests))], eng
    sync, _ = run()
    asyn, eng = run(async_scheduling=True)
    assert asyn == sync and asyn[0] == free[: m + 1]
    assert asyn[1] == _reference(PROMPTS[0], 4, lambda i, o: {free[2]} if o and o[-1] == free[1] else (), stop=())
    assert eng.counters["chained_rows"] > 0
