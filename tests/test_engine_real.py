"""The engine running the REAL model (the embedded demo model in float32) through `flashnext_jax.runner.RealRunner`.

Oracle everywhere: each greedy request's tokens equal `Model.generate` run solo (an independent code path: dense
per-request state, no store, no pages, no scheduler). All tests share two runners (k = 0 and k = 1) and fixed shape
buckets so the jitted step compiles a handful of times per session.
"""

import random
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule, run_state_machine_as_test

import flashnext_jax as fj
from flashnext_jax.engine import Engine, EngineConfig
from flashnext_jax.runner import RealRunner
from state_machine import STEPS, EngineHarness, EngineMachine

MAX_LEN = 64
PAGE = 8
SHAPES = dict(min_batch_bucket=4, min_token_bucket=8, min_pool_capacity=(4, 64, 64))  # share compiled steps
GREEDY = dict(temperature=0.0, ignore_eos=True)
_STATE: dict = {}
COVER: dict = {}  # machine coverage: preemptions, prefix hits, accepted/rejected drafts, aborts, eos finishes


def model():
    if "model" not in _STATE:
        m = fj.load(dtype="float32")
        _STATE.update(model=m, runners={0: RealRunner(m, 0), 1: RealRunner(m, 1)}, solo={})
    return _STATE["model"]


def runner(k):
    model()
    return _STATE["runners"][k]


def solo(prompt, max_tokens, stop_at_eos=False):
    """Model.generate run alone (cached); stops at max_model_len like the engine."""
    key = (tuple(prompt), max_tokens, stop_at_eos)
    cache = model() and _STATE["solo"]
    if key not in cache:
        n = min(max_tokens, MAX_LEN - len(prompt))
        cache[key] = _STATE["model"].generate(list(prompt), n, stop_at_eos=stop_at_eos)
    return cache[key]


def llm(k=0, **kw):
    kw.setdefault("max_model_len", MAX_LEN)
    kw.setdefault("page_size", PAGE)
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    return fj.LLM(runner(k), speculative_config=spec, **SHAPES, **kw)


RNG = random.Random(7)
PROMPTS = [[RNG.randrange(1, 509) for _ in range(n)] for n in (13, 5, 16, 9)]


def gen(lm, prompts, max_tokens=10):
    return lm.generate(prompts, fj.SamplingParams(max_tokens=max_tokens, **GREEDY))


def test_llm_generate_equals_solo_with_chunked_prefill_sharing_steps():
    lm = llm(0, max_num_seqs=3, max_num_batched_tokens=5)
    outs = gen(lm, PROMPTS)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == solo(p, 10), o.request_id
        assert o.finish_reason == "length"
    assert lm.engine.counters["steps"] > 10


def test_greedy_mtp_equals_no_mtp_with_acceptance_counters():
    base = [o.token_ids for o in gen(llm(0, max_num_seqs=2, max_num_batched_tokens=6), PROMPTS)]
    lm = llm(1, max_num_seqs=2, max_num_batched_tokens=6)
    outs = gen(lm, PROMPTS)
    assert [o.token_ids for o in outs] == base
    m = outs[0].metrics
    assert m["num_drafts"] > 0 and m["acceptance_rate"] is not None  # trained demo head: some drafts accepted
    assert lm.engine.counters["drafts"] == sum(o.metrics["num_drafts"] for o in outs)

    # drafts forced right 70% of the time (a draft hook keyed by request/output index): accepted 2-token steps,
    # rejected drafts (rollback by checkpoint column) and the output still equals the non-MTP output
    lm = llm(1, max_num_seqs=2, max_num_batched_tokens=6)
    proposals = []

    def hook(req, proposed):
        j = len(req.output)
        proposals.append((tuple(req.tokens), list(proposed)))
        ref = solo(req.prompt, 10)
        r = random.Random(zlib.crc32(f"{req.request_id}/{j}".encode()))
        return [ref[j] if j < len(ref) and r.random() < 0.7 else (proposed[0] + 1) % 509]

    lm.engine.draft_hook = hook
    outs = gen(lm, PROMPTS)
    assert [o.token_ids for o in outs] == base
    c = lm.engine.counters
    assert 0 < c["accepted"] < c["drafts"], c
    assert c["steps"] < sum(len(p) for p in PROMPTS) + sum(len(b) for b in base)  # fewer steps than tokens
    # the MTP head's drafts are the teacher-forced MTP argmax (Model.mtp_logits) at the same position
    m = model()
    for tokens, proposed in proposals[:4]:
        ref = m.mtp_logits(list(tokens))[-1]
        assert ref[proposed[0]] >= ref.max() - 1e-4, (tokens, proposed, int(ref.argmax()))


@pytest.mark.parametrize("shared", [8, 10])  # prefix ends on the block grid (8) and off it (10 -> hit at 8)
def test_prefix_cache_hit_equals_cold(shared):
    first = PROMPTS[0] + PROMPTS[1][:3]  # 16 tokens
    second = first[:shared] + [17, 33, 250, 12][: 16 - shared]
    lm = llm(1, max_num_seqs=2, max_num_batched_tokens=8, enable_prefix_caching=True, block_size=4)
    a = gen(lm, [first])[0]
    b = gen(lm, [second])[0]
    assert b.metrics["num_cached_tokens"] >= 8
    assert a.token_ids == solo(first, 10)
    assert b.token_ids == solo(second, 10)
    cold = gen(llm(1, max_num_seqs=2, max_num_batched_tokens=8), [second])[0]
    assert cold.metrics["num_cached_tokens"] == 0 and cold.token_ids == b.token_ids


def test_chunked_prefill_equals_one_shot():
    p = PROMPTS[2]
    one = gen(llm(0, max_num_seqs=1, max_num_batched_tokens=32), [p])[0]
    chunked = gen(llm(0, max_num_seqs=1, max_num_batched_tokens=3), [p])[0]
    assert one.token_ids == chunked.token_ids == solo(p, 10)


def test_pipeline_delay_and_row_permutation_do_not_change_output():
    ref = [o.token_ids for o in gen(llm(1, max_num_seqs=3, max_num_batched_tokens=6), PROMPTS)]
    outs = gen(llm(1, max_num_seqs=3, max_num_batched_tokens=6, pipeline_delay=3, permute_rows=5), PROMPTS)
    assert [o.token_ids for o in outs] == ref


def test_seeded_sampling_with_mtp_is_independent_of_batch_composition():
    sp = fj.SamplingParams(temperature=0.9, top_k=50, top_p=0.95, max_tokens=8, seed=11, ignore_eos=True)
    alone = llm(1, max_num_seqs=1, max_num_batched_tokens=8).generate([PROMPTS[0]], sp)[0]
    mixed = llm(1, max_num_seqs=3, max_num_batched_tokens=6, pipeline_delay=2, permute_rows=1).generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[3]], [fj.SamplingParams(max_tokens=8, seed=3, temperature=1.0), sp,
                                               fj.SamplingParams(max_tokens=5, **GREEDY)])[1]
    assert mixed.token_ids == alone.token_ids and len(alone.token_ids) == 8


def test_bad_inputs_raise_clear_errors():
    lm = llm(0, max_num_seqs=2, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="max_model_len"):
        gen(lm, [list(range(1, MAX_LEN + 1))])
    with pytest.raises(ValueError, match="empty prompt"):
        gen(lm, [[]])
    with pytest.raises(ValueError, match="outside vocab"):
        gen(lm, [[1, 512]])
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(max_tokens=0), dict(min_p=2.0)):
        with pytest.raises(ValueError, match="SamplingParams"):
            fj.SamplingParams(**bad)
    with pytest.raises(ValueError, match="drafts at most 0 tokens"):
        fj.LLM(runner(0), speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    # the engine still works after rejected requests
    assert gen(lm, [PROMPTS[1]], 3)[0].token_ids == solo(PROMPTS[1], 10)[:3]


def test_llm_from_checkpoint_path_builds_the_real_runner():
    lm = fj.LLM(str(fj.DEMO_MODEL), dtype="float32", max_num_seqs=2, max_num_batched_tokens=8, max_model_len=MAX_LEN,
                page_size=PAGE, **SHAPES)
    assert isinstance(lm.runner, RealRunner) and lm.tokenizer is not None
    out = lm.generate("hello world", fj.SamplingParams(max_tokens=4, **GREEDY))[0]
    ids = lm.tokenizer.encode("hello world")
    assert out.prompt_token_ids == ids and out.token_ids == solo(ids, 4)
    assert isinstance(out.text, str)
    assert isinstance(fj.LLM(None, dtype="float32", max_model_len=MAX_LEN).runner, RealRunner)  # None -> demo


def test_poisoned_state_faults_visibly():
    lm = llm(0, max_num_seqs=2, max_num_batched_tokens=8)
    eng = lm.engine
    eng.add_request("a", PROMPTS[0], fj.SamplingParams(max_tokens=10, **GREEDY))
    eng.step()
    eng.ledger.flush()
    import dataclasses as dc
    s = eng.requests["a"].slot.slot
    st_ = eng.ledger.store
    eng.ledger.store = dc.replace(st_, slot={n: (a.at[s].set(jnp_nan(a)) if n == "gdn_rec" else a)
                                             for n, a in st_.slot.items()})
    with pytest.raises(FloatingPointError):
        for _ in range(5):
            eng.step()
    assert eng.requests["a"].finish_reason == "error"


def jnp_nan(a):
    return np.float32("nan")


# ------------------------------------------------------------------------------ hypothesis state machine


class RealHarness(EngineHarness):
    """The engine on the real model with k = 1 MTP; oracle `Model.generate` solo. After the drain, freed slots and
    pages are poisoned and the machine's coverage (preemptions, prefix hits, drafts, aborts, eos) is counted."""

    vocab, max_prompt, corpus_len, drain_limit = 509, 21, 24, 3000

    def __init__(self, D, slots, budget, prefix, block, seed, tight, accept_p):
        super().__init__(seed, block, accept_p)
        mml = 32  # prompts <= 21 + outputs <= 10 always fit; a short max_model_len allows a 4-page pool
        mp = mml // PAGE
        pages = mp if tight else mp * slots + mp  # tight: 4 pages for up to 3 requests of <= 4 pages -> preemption
        self.eng = Engine(runner(1), EngineConfig(
            max_num_seqs=slots, num_slots=slots, max_num_batched_tokens=budget, max_model_len=mml,
            num_speculative_tokens=1, enable_prefix_caching=prefix, block_size=block, page_size=PAGE,
            num_pages=pages, num_snapshots=3, pipeline_delay=D, permute_rows=seed, **SHAPES), draft_hook=self.hook)

    def add(self, m, delta, corpus, mutate, max_tokens, ignore_eos):
        self.submit(self.prompt(m, delta, corpus, mutate),
                    fj.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos))

    def solo_greedy(self, prompt, params):
        return solo(prompt, params.max_tokens, stop_at_eos=not params.ignore_eos)

    def check_drained(self):
        for rid, req in self.eng.requests.items():
            m = req.metrics
            for key, hit in (("preempted", m["num_preemptions"] > 0), ("prefix_hit", m["num_cached_tokens"] > 0),
                             ("accepted", m["num_accepted"] > 0), ("rejected", m["num_accepted"] < m["num_drafts"]),
                             ("aborted", rid in self.aborted), ("eos", req.finish_reason == "stop")):
                COVER[key] = COVER.get(key, 0) + hit
        led = self.eng.ledger
        store = led.store
        for s in list(led.free_slots) + [store.num_slots]:  # freed and null slots stay poisoned
            assert np.all(np.isnan(np.asarray(store.slot["gdn_rec"][s])))
        for p in led.free_pages:
            assert np.all(np.isnan(np.asarray(store.page["qsa_k"][p])))


class RealEngineMachine(EngineMachine):
    @initialize(D=st.integers(0, 3), slots=st.sampled_from([1, 2, 3, 3]), budget=st.integers(2, 8),
                prefix=st.booleans(), block=st.integers(2, 5), seed=st.integers(0, 2**16),
                tight=st.sampled_from([False, True, True]),
                accept_p=st.sampled_from([0.0, 0.5, 0.9]))
    def setup(self, D, slots, budget, prefix, block, seed, tight, accept_p):
        self.h = RealHarness(D, slots, budget, prefix, block, seed, tight, accept_p)

    @rule(m=st.integers(0, 5), delta=st.sampled_from([-1, 0, 0, 1]), corpus=st.integers(0, 1),
          mutate=st.booleans(), max_tokens=st.integers(1, 10), ignore_eos=st.booleans())
    def arrive(self, m, delta, corpus, mutate, max_tokens, ignore_eos):
        self.h.add(m, delta, corpus, mutate, max_tokens, ignore_eos)


def _machine(examples, steps, derandomize=False):
    run_state_machine_as_test(RealEngineMachine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, database=None, derandomize=derandomize,
        suppress_health_check=list(HealthCheck)))


def test_real_engine_machine_short():
    start = STEPS["n"]
    _machine(90, 30, derandomize=True)  # reproducible default run; the slow one draws fresh examples
    print(f"real-model machine: {STEPS['n'] - start} launched engine steps, coverage {COVER}")
    assert all(COVER.get(k, 0) > 0 for k in ("preempted", "prefix_hit", "accepted", "rejected", "aborted")), COVER
    assert STEPS["n"] - start >= 2000, STEPS["n"] - start


@pytest.mark.slow
def test_real_engine_machine_long():
    start, rounds = STEPS["n"], 0
    while STEPS["n"] - start < 10_000 and rounds < 8:  # fresh random examples each round
        _machine(150, 40)
        rounds += 1
    print(f"real-model machine: {STEPS['n'] - start} launched engine steps in {rounds} rounds")
    assert STEPS["n"] - start >= 10_000


def test_logprobs_equal_the_models_log_softmax():
    """The real model behind the engine (MTP on, greedy and seeded sampling): each token's logprob and top-2 equal
    the float64 log-softmax of Model.logits on the prompt and the tokens before it."""
    lm = llm(1, max_num_seqs=2, max_num_batched_tokens=8)
    params = [fj.SamplingParams(max_tokens=4, logprobs=2, **GREEDY),
              fj.SamplingParams(max_tokens=4, logprobs=2, temperature=0.8, seed=3, ignore_eos=True)]
    for out in lm.generate(PROMPTS[:2], params):
        full = list(out.prompt_token_ids) + out.token_ids
        x = model().logits(full[:-1])[len(out.prompt_token_ids) - 1:].astype(np.float64)
        ref = x - (x.max(-1, keepdims=True) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)))
        for i, got in enumerate(out.logprobs):
            assert got.token_id == out.token_ids[i]
            np.testing.assert_allclose(got.logprob, ref[i, got.token_id], atol=1e-4)
            top = np.argsort(-ref[i], kind="stable")[:2]
            assert [t for t, _ in got.top] == list(top)
            np.testing.assert_allclose([v for _, v in got.top], ref[i, top], atol=1e-4)


def _log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))


# the default run keeps one budget that binds and one that does not; the other two pairings are slow
@pytest.mark.parametrize("k,budget", [(0, 64), pytest.param(0, 8, marks=pytest.mark.slow),
                                      pytest.param(1, 64, marks=pytest.mark.slow), (1, 6)])
def test_prompt_logprobs_equal_model_logits(k, budget):
    """prompt_logprobs of the real model behind the engine, one-shot (budget 64) and in chunks of 8 / 6 tokens,
    without and with MTP: each prompt token's logprob and the top-3 equal the log-softmax of Model.logits of the
    prompt (float32, <= 1e-5); the first entry is None."""
    lm = llm(k, max_num_seqs=2, max_num_batched_tokens=budget)
    params = [fj.SamplingParams(max_tokens=2, prompt_logprobs=3, **GREEDY), fj.SamplingParams(max_tokens=2, **GREEDY)]
    outs = lm.generate([PROMPTS[0], PROMPTS[2]], params)
    assert outs[1].prompt_logprobs is None
    prompt = outs[0].prompt_token_ids
    ref = _log_softmax(model().logits(prompt))
    got = outs[0].prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):
        assert got[pos].token_id == prompt[pos]
        np.testing.assert_allclose(got[pos].logprob, ref[pos - 1, prompt[pos]], atol=1e-5)
        top = np.argsort(-ref[pos - 1], kind="stable")[:3]
        assert [t for t, _ in got[pos].top] == list(top)
        np.testing.assert_allclose([v for _, v in got[pos].top], ref[pos - 1, top], atol=1e-5)


@pytest.mark.parametrize("k", [pytest.param(0, marks=pytest.mark.slow), 1])  # k = 1 biases the drafts too
def test_logit_bias_greedy_equals_biased_model_logits(k):
    """Greedy decoding with a logit_bias equals the argmax of Model.logits + the bias, token by token (with MTP:
    greedy verification of drafts against the biased target)."""
    prompt = PROMPTS[1]
    plain = solo(prompt, 4)
    bias = {plain[0]: -30.0, plain[1]: -30.0, 7: 4.0}
    (out,) = llm(k, max_num_seqs=1).generate([prompt], fj.SamplingParams(max_tokens=4, logit_bias=bias, **GREEDY))
    want = []
    for _ in range(4):
        x = model().logits(prompt + want)[-1].astype(np.float64)
        for t, b in bias.items():
            x[t] += b
        want.append(int(np.argmax(x)))
    assert want != plain and out.token_ids == want
