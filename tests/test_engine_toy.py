"""The engine against the exactly-checkable toy model: a hypothesis state machine plus a long random soak.

Randomised: arrivals, finishes (eos / stop ids / max_tokens / max_model_len), aborts, preemption (tiny page pool),
batch-row permutation every step, pipeline delay D in 0..3, MTP k in 0..2 with per-draft acceptance chosen by a
draft hook (so 0..k+1 tokens accepted), prompt lengths clustered at mB-1, mB, mB+1 of a small snapshot block,
page size independent of the block, prefixes drawn from a small corpus (exact-boundary prefix hits), a tiny slot
pool (freed slots reused at once), chunked prefill under small token budgets.
Oracles after every step: every committed state, page and snapshot equals the pure-Python fold; free slots, pages
and the null slot are poisoned; the shadow ledger accepts every write (engine debug mode); at the end every
request's tokens equal its solo run (a prefix of it when aborted).
"""

import random

import numpy as np

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule, run_state_machine_as_test

from flashnext_jax.engine import Engine, EngineConfig
from flashnext_jax.sampling import SamplingParams
from flashnext_jax.toy_model import ToyConfig, ToyRunner, check_engine_against_fold, solo_greedy
from state_machine import STEPS, EngineHarness, EngineMachine

MAX_LEN = 32
CFG = ToyConfig(vocab_size=64, max_model_len=MAX_LEN)
RUNNERS = {0: ToyRunner(CFG, 0), 1: ToyRunner(CFG, 1), 2: ToyRunner(CFG, 2)}
SHAPES = dict(min_batch_bucket=4, min_token_bucket=4, min_pool_capacity=(4, 64, 4))  # share compiled steps


class Harness(EngineHarness):
    """The engine on the toy model (k = 0..2 MTP); shared by the state machine and the soak test. Oracles: the
    pure-Python fold after every step; greedy requests equal `solo_greedy`, seeded sampled ones their solo engine
    run (the same draft decisions, batch size 1)."""

    vocab, max_prompt, corpus_len, drain_limit = 64, MAX_LEN - 1, MAX_LEN, 2000

    def __init__(self, D, k, block, page, slots, budget, prefix, seed, tight_pages, async_scheduling=False):
        super().__init__(seed, block)  # accept_p drawn from the seed
        mp = -(-MAX_LEN // page)
        pages = mp + (mp // 2 if tight_pages else mp * slots)
        self.engine_args = (k, budget, page)
        # async scheduling (decode rows chained to their in-flight step) needs a runner without MTP and no delay
        async_scheduling = async_scheduling and k == 0 and D == 0
        self.eng = self.build_engine(0 if async_scheduling else max(k, 1), EngineConfig(
            max_num_seqs=slots, num_slots=slots, max_num_batched_tokens=max(budget, k + 1), max_model_len=MAX_LEN,
            num_speculative_tokens=k, enable_prefix_caching=prefix, block_size=block, page_size=page,
            num_pages=pages, num_snapshots=3, pipeline_delay=D, permute_rows=seed, async_scheduling=async_scheduling,
            **SHAPES))

    def build_engine(self, runner: int, cfg: EngineConfig) -> Engine:
        """The engine under test on RUNNERS[runner] (test_pipeline_toy.py's harness: on the toy pipeline)."""
        return Engine(RUNNERS[runner], cfg, draft_hook=self.hook)

    def add(self, prompt, max_tokens, ignore_eos, stop_id, seed=None):
        stop = [stop_id] if stop_id is not None else None
        if seed is not None:  # seeded sampling: the oracle is the request's solo engine run (checked at drain)
            # odd seeds without penalties: with k = 0 they sample on the device (device_sampling.py)
            params = SamplingParams(temperature=0.8, top_k=20, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                    stop_token_ids=stop, seed=seed, repetition_penalty=1.0 if seed % 2 else 1.1)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                    stop_token_ids=stop)
        self.submit(prompt, params)

    def solo_greedy(self, prompt, params):
        return solo_greedy(CFG, prompt, params.max_tokens, stop_ids=params.stop_token_ids, max_len=MAX_LEN,
                           ignore_eos=params.ignore_eos)

    def solo_sampled(self, rid):
        k, budget, page = self.engine_args
        prompt, params = self.requests[rid]
        solo = Engine(RUNNERS[max(k, 1)], EngineConfig(
            max_num_seqs=1, max_num_batched_tokens=max(budget, k + 1), max_model_len=MAX_LEN,
            num_speculative_tokens=k, page_size=page, **SHAPES), draft_hook=self.hook)
        solo.add_request(rid, prompt, params)
        while solo.has_unfinished():
            solo.step()
        return solo.requests[rid].output

    def check_step(self):
        check_engine_against_fold(self.eng, CFG)


class ToyEngineMachine(EngineMachine):
    @initialize(D=st.integers(0, 3), k=st.sampled_from([0, 1, 1, 2]), block=st.integers(2, 5),
                page=st.sampled_from([2, 4]), slots=st.integers(1, 3), budget=st.integers(3, 12),
                prefix=st.booleans(), seed=st.integers(0, 2**16), tight=st.booleans(), asyn=st.booleans())
    def setup(self, D, k, block, page, slots, budget, prefix, seed, tight, asyn):
        self.h = Harness(D, k, block, page, slots, budget, prefix, seed, tight, asyn)

    @rule(m=st.integers(0, 5), delta=st.sampled_from([-1, 0, 0, 1]), corpus=st.integers(0, 1),
          mutate=st.booleans(), max_tokens=st.integers(1, 12), ignore_eos=st.booleans(),
          stop=st.one_of(st.none(), st.integers(1, 63)), seed=st.one_of(st.none(), st.none(), st.integers(0, 99)))
    def arrive(self, m, delta, corpus, mutate, max_tokens, ignore_eos, stop, seed):
        self.h.add(self.h.prompt(m, delta, corpus, mutate), max_tokens, ignore_eos, stop, seed)


# Slow (~70 s of the suite, stop 48): test_soak_2000_steps_with_coverage below is the default suite's run of this
# Harness, its rules (arrivals with greedy, seeded and stopped requests, aborts, steps, the drain) and its oracles
# after every step, over the same drawn configurations (D, k, block, page, slots, budget, prefix, tight pages,
# async), >= 2000 steps, with every kind of event asserted met; test_engine_machine_long is the slow machine too.
@pytest.mark.slow
def test_engine_machine_2000_steps():
    start = STEPS["n"]
    # derandomize seeds from the machine class's source, so editing it redraws the examples; their step counts vary
    # widely (80 examples: 1.9k-2.7k steps on the last two sources), hence 90 for a margin over the 2000 floor
    run_state_machine_as_test(ToyEngineMachine, settings=settings(
        max_examples=90, stateful_step_count=25, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck)))
    assert STEPS["n"] - start >= 2000, STEPS["n"] - start


def _soak(total_steps, seed):
    """Random driver without shrinking: many configurations, >= total_steps engine steps, coverage counted."""
    rng = random.Random(seed)
    seen = {"preemptions": 0, "prefix_hits": 0, "snapshots": 0, "bubbles": 0, "aborts": 0, "accepted": 0,
            "rejected": 0, "reuse": 0, "chained_rows": 0}
    start = STEPS["n"]
    while STEPS["n"] - start < total_steps:
        D, k = rng.randrange(4), rng.choice([0, 1, 2])
        asyn = rng.random() < 0.5
        if asyn:  # async scheduling's configurations (no delay, no MTP) as often as the others
            D = k = 0
        h = Harness(D, k, rng.randrange(2, 6), rng.choice([2, 4]), rng.randrange(1, 4), rng.randrange(3, 13),
                    rng.random() < 0.7, rng.randrange(2**16), rng.random() < 0.5, asyn)
        for _ in range(rng.randrange(20, 60)):
            x = rng.random()
            if x < 0.25:
                h.add(h.prompt(rng.randrange(6), rng.choice([-1, 0, 1]), rng.randrange(2), rng.random() < 0.3),
                      rng.randrange(1, 13), rng.random() < 0.5, rng.choice([None, rng.randrange(1, 64)]),
                      rng.randrange(100) if rng.random() < 0.3 else None)
            elif x < 0.3:
                h.abort_some(rng.randrange(8))
            else:
                h.step()
        h.drain()
        c, s = h.eng.counters, h.eng.ledger.stats
        seen["preemptions"] += sum(r.metrics["num_preemptions"] for r in h.eng.requests.values())
        seen["prefix_hits"] += s["prefix_hits"]
        seen["snapshots"] += s["snapshots_published"]
        seen["bubbles"] += c["bubbles"]
        seen["aborts"] += len(h.aborted)
        seen["accepted"] += c["accepted"]
        seen["rejected"] += c["drafts"] - c["accepted"]
        seen["reuse"] += max(0, h.n - h.eng.cfg.num_slots)
        seen["chained_rows"] += c["chained_rows"]
    return seen


def test_soak_2000_steps_with_coverage():
    seen = _soak(2000, seed=1)
    assert all(v > 0 for v in seen.values()), seen


@pytest.mark.slow
def test_soak_10000_steps():
    seen = _soak(10000, seed=2)
    assert all(v > 0 for v in seen.values()), seen


@pytest.mark.slow
def test_engine_machine_long():
    start = STEPS["n"]
    run_state_machine_as_test(ToyEngineMachine, settings=settings(
        max_examples=400, stateful_step_count=40, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))
    assert STEPS["n"] - start >= 10000


# ------------------------------------------------------------------------------- end-to-end equivalences


def _generate(prompts, params, **cfg):
    k = cfg.get("num_speculative_tokens", 0)
    eng = Engine(RUNNERS[max(k, 1)], EngineConfig(max_model_len=MAX_LEN, **SHAPES, **cfg))
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params[i] if isinstance(params, list) else params)
    while eng.has_unfinished():
        eng.step()
    return [eng.requests[str(i)].output for i in range(len(prompts))], eng


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9], [1, 4, 1, 4, 2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_greedy_mtp_equals_no_mtp_and_solo():
    base, _ = _generate(PROMPTS, GREEDY)
    for k in (1, 2):
        out, eng = _generate(PROMPTS, GREEDY, num_speculative_tokens=k)
        assert out == base
        assert eng.counters["accepted"] > 0 and eng.counters["drafts"] > eng.counters["accepted"]
    assert base == [solo_greedy(CFG, p, 12, ignore_eos=True, max_len=MAX_LEN) for p in PROMPTS]


def test_greedy_rows_never_copy_logits_to_the_host(monkeypatch):
    """Greedy rows without penalties commit from the device's argmax (engine.model_step); rows that sample
    or apply penalties still read the full logits."""
    from flashnext_jax import engine as engine_module

    fetched = set()
    real = engine_module.HostOutputs.__getitem__
    monkeypatch.setattr(engine_module.HostOutputs, "__getitem__", lambda self, name: fetched.add(name) or real(self, name))
    out, _ = _generate(PROMPTS, GREEDY, num_speculative_tokens=1)
    assert out == [solo_greedy(CFG, p, 12, ignore_eos=True, max_len=MAX_LEN) for p in PROMPTS]
    assert fetched == {"logits_argmax", "logits_finite", "draft_logits_argmax", "draft_logits_finite"}
    fetched.clear()
    _generate(PROMPTS[:1], SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=4, ignore_eos=True))
    assert "logits" in fetched


def test_each_new_step_shape_is_logged_once_as_a_compile(caplog):
    """A new (rows, tokens, page-table width) shape compiles the step (about a minute at the real size): the engine
    says so once per shape, also across engines over the same runner."""
    runner = ToyRunner(CFG)
    caplog.set_level("INFO", logger="flashnext_jax.engine")
    for _ in range(2):
        eng = Engine(runner, EngineConfig(max_num_seqs=4, max_model_len=MAX_LEN))
        eng.add_request("a", PROMPTS[0], GREEDY)
        while eng.has_unfinished():
            eng.step()
    compiles = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling the engine step")]
    shapes = {m.split(" (once")[0] for m in compiles}
    assert compiles and len(shapes) == len(compiles), compiles  # prefill shape and decode shape(s), each once
    assert "x 16 tokens" in compiles[0] and len(compiles) >= 2  # the prefill, then decode steps


def test_chunked_prefill_equals_one_shot():
    one, _ = _generate(PROMPTS, GREEDY, max_num_batched_tokens=64)
    chunked, _ = _generate(PROMPTS, GREEDY, max_num_batched_tokens=3)
    assert one == chunked


def test_prefix_cache_hit_equals_cold():
    shared = PROMPTS[1]
    prompts = [shared, shared + [7, 7], shared[:8] + [1]]
    cold, _ = _generate(prompts, GREEDY, max_num_seqs=1)
    warm, eng = _generate(prompts, GREEDY, max_num_seqs=1, enable_prefix_caching=True, block_size=4, page_size=2)
    assert warm == cold
    assert eng.ledger.stats["prefix_hits"] >= 1


def test_pipeline_delay_and_row_order_do_not_change_output():
    base, _ = _generate(PROMPTS, GREEDY, num_speculative_tokens=1)
    for D in (1, 3):
        out, _ = _generate(PROMPTS, GREEDY, num_speculative_tokens=1, pipeline_delay=D, permute_rows=D)
        assert out == base


@pytest.mark.parametrize("k", [0, 1])  # k = 0: sampled on the device (device_sampling.py); k = 1: on the host
def test_seeded_sampling_is_independent_of_batch_composition(k):
    p = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    alone, _ = _generate([PROMPTS[0]], [p], num_speculative_tokens=k)
    other = SamplingParams(temperature=1.0, max_tokens=7, seed=7, ignore_eos=True)
    mixed, _ = _generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [other, p, other], num_speculative_tokens=k,
                         pipeline_delay=2, permute_rows=5, max_num_batched_tokens=4)
    assert mixed[1] == alone[0]


def test_bad_inputs_raise_clear_errors():
    eng = Engine(RUNNERS[1], EngineConfig(max_model_len=MAX_LEN))
    with pytest.raises(ValueError, match="empty prompt"):
        eng.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("b", list(range(1, 33)), GREEDY)
    with pytest.raises(ValueError, match="outside vocab"):
        eng.add_request("c", [1, 99], GREEDY)
    with pytest.raises(ValueError, match="pipeline_delay"):
        Engine(RUNNERS[1], EngineConfig(pipeline_delay=4))


def test_engine_fault_fails_every_request_visibly():
    eng = Engine(RUNNERS[1], EngineConfig(max_model_len=MAX_LEN, num_speculative_tokens=1))
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, GREEDY)
    eng.step()
    eng.step()
    s = eng.requests["0"].slot.slot
    eng.ledger.flush()
    import dataclasses as dc
    st = eng.ledger.store  # corrupt a live slot behind the engine's back: its logits become NaN
    eng.ledger.store = dc.replace(st, slot={n: a.at[s].set(-5) for n, a in st.slot.items()})
    with pytest.raises(FloatingPointError):
        for _ in range(10):
            eng.step()
    assert all(r.finish_reason == "error" and r.error for r in eng.requests.values())
    from flashnext_jax.engine import EngineDeadError
    with pytest.raises(EngineDeadError):
        eng.step()


# ------------------------------------------------------------------------------------------ the LLM API


def _llm(**kw):
    from flashnext_jax.llm import LLM

    return LLM(CFG, max_model_len=MAX_LEN, block_size=4, **SHAPES, **kw)


def test_llm_generate_text_and_ids_with_mtp_metrics(capsys):
    llm = _llm(max_num_seqs=2, speculative_config={"method": "mtp", "num_speculative_tokens": 1},
               enable_prefix_caching=True)
    outs = llm.generate(["w3 w1 w4 w1 w5", PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=10,
                                                                       ignore_eos=True), use_tqdm=True)
    assert "2/2" in capsys.readouterr().err  # the progress bar counted both requests
    tok = llm.get_tokenizer()
    assert outs[0].prompt_token_ids == [3, 1, 4, 1, 5]
    for o, p in zip(outs, [[3, 1, 4, 1, 5], PROMPTS[1]]):
        assert o.token_ids == solo_greedy(CFG, p, 10, ignore_eos=True, max_len=MAX_LEN)
        assert o.text == tok.decode(o.token_ids) and o.finish_reason == "length" and o.finished
        assert o.metrics["num_drafts"] > 0 and 0 <= o.metrics["acceptance_rate"] <= 1
        assert o.metrics["num_generated_tokens"] == 10


def test_llm_stop_strings_and_stop_ids():
    llm = _llm()
    p = [3, 1, 4, 1, 5]
    ref = solo_greedy(CFG, p, 12, ignore_eos=True, max_len=MAX_LEN)
    word = llm.get_tokenizer().decode([ref[3]])
    (o,) = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[word]))
    assert o.finish_reason == "stop" and word not in o.text and o.token_ids == ref[: ref.index(ref[3]) + 1]
    (o,) = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                            stop_token_ids=[ref[2]]))
    assert o.token_ids == ref[: ref.index(ref[2]) + 1] and o.finish_reason == "stop"


def test_llm_streaming_matches_generate():
    import asyncio

    llm = _llm(max_num_seqs=2, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)

    async def collect(prompt):
        deltas, last = [], None
        async for out in llm.stream(prompt, params):
            deltas += out.delta_token_ids
            last = out
        return deltas, last

    async def main():
        return await asyncio.gather(collect(PROMPTS[0]), collect("w7 w8 w9"))

    (d0, o0), (d1, o1) = asyncio.run(main())
    assert d0 == o0.token_ids == solo_greedy(CFG, PROMPTS[0], 9, ignore_eos=True, max_len=MAX_LEN)
    assert d1 == o1.token_ids and o1.finish_reason == "length"


def test_llm_bad_inputs():
    llm = _llm()
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(1, 40))], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="method"):
        _llm(speculative_config={"method": "eagle"})
    out = llm.chat([{"role": "user", "content": "w4 w5"}], SamplingParams(temperature=0.0, max_tokens=3))
    assert len(out[0].token_ids) >= 1


def test_llm_loads_tokenizer_and_chat_template_from_a_checkpoint_dir(tmp_path):
    import json

    from flashnext_jax.llm import LLM
    from flashnext_jax.tokenizer import toy_tokenizer

    toy_tokenizer(64).tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<eos>", "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}w9"}))
    (tmp_path / "toy_config.json").write_text(json.dumps({"vocab_size": 64, "max_model_len": MAX_LEN}))
    llm = LLM(str(tmp_path), max_model_len=MAX_LEN, **SHAPES)
    tok = llm.get_tokenizer()
    assert tok.eos_token_id == 0 and tok.encode("w5 w6") == [5, 6]
    assert tok.apply_chat_template([{"role": "user", "content": "w4 w5"}]) == "w4 w5 w9"
    (o,) = llm.chat([{"role": "user", "content": "w4 w5"}], SamplingParams(temperature=0.0, max_tokens=4))
    assert o.prompt_token_ids == [4, 5, 9]
    assert o.token_ids == solo_greedy(CFG, [4, 5, 9], 4, max_len=MAX_LEN)


def _reference_logprobs(prompt, output, n_top):
    """Each output token's float64 log-softmax under the toy model's logits after the tokens before it (the Python
    fold, independent of the engine), and the n_top most likely (ties by ascending id)."""
    from flashnext_jax.toy_model import fold, head, logits_row

    ref = []
    for i, t in enumerate(output):
        s = fold(CFG, list(prompt) + list(output[:i]))
        x = logits_row(CFG, head(CFG, s.rec, s.att)).astype(np.float64)
        lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        top = np.argsort(-lp, kind="stable")[:n_top]
        ref.append((lp[t], [(int(j), lp[j]) for j in top]))
    return ref


@pytest.mark.parametrize("case", ["greedy", "greedy_mtp", "sampled_device", "sampled_host_penalties",
                                  "sampled_mtp"])
def test_logprobs_equal_the_models_log_softmax(case):
    """Every path that chooses a token (device argmax, device sample, host sampling with penalties, MTP
    verification) reports that token's log-softmax under the raw logits and the top-n of its position, batched
    with requests that ask for none; a request without logprobs gets None."""
    kw = dict(temperature=0.0) if case.startswith("greedy") else dict(temperature=0.9, seed=5)
    if case == "sampled_host_penalties":
        kw["presence_penalty"] = 0.5
    mtp = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}} if case.endswith("mtp") else {}
    llm = _llm(max_num_seqs=3, **mtp)
    params = [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3, **kw),
              SamplingParams(max_tokens=8, ignore_eos=True, **kw),
              SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0, **kw)]
    outs = llm.generate(PROMPTS, params)
    assert outs[1].logprobs is None
    for out, n_top in ((outs[0], 3), (outs[2], 0)):
        assert len(out.logprobs) == len(out.token_ids) == 8
        for got, t, (lp, top) in zip(out.logprobs, out.token_ids, _reference_logprobs(out.prompt_token_ids,
                                                                                      out.token_ids, n_top)):
            assert got.token_id == t and abs(got.logprob - lp) < 1e-5, (got, lp)
            assert [i for i, _ in got.top] == [i for i, _ in top]
            np.testing.assert_allclose([x for _, x in got.top], [x for _, x in top], atol=1e-5)
        if case.startswith("greedy"):
            assert all(got.top == () or got.top[0][0] == got.token_id for got in out.logprobs)


def test_logprobs_bad_values():
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)
