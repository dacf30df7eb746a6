"""Async scheduling (EngineConfig.async_scheduling): a decode row launched while its request's previous step is in
flight, its token and PLE n-gram rows made on the device (step_programs.chain_tokens). Oracles: the same engine without
it (every token and logprob), `Model.generate` run solo for greedy rows, and the host n-gram hasher for the
device one. The toy model's state machine and soak (tests/test_engine_toy.py) drive it through random arrivals,
aborts, preemption and prefix hits against the pure-Python fold."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashnext_jax as fj
from flashnext_jax.config import from_hf_config
from flashnext_jax.engine import Engine, EngineConfig
from flashnext_jax.ple import NgramHasher, device_ngram_ids
from flashnext_jax.runner import RealRunner

MAX_LEN = 64
SHAPES = dict(min_batch_bucket=4, min_token_bucket=8, min_pool_capacity=(4, 64, 64), page_size=8)
REAL_CONFIG = Path(__file__).resolve().parents[2] / "shared" / "reference" / "qwen38_text_config.json"


@pytest.fixture(scope="module")
def model():
    return fj.load(dtype="float32")


def _configs(model):
    yield "demo", model.cfg
    if REAL_CONFIG.is_file():
        yield "real", from_hf_config(json.loads(REAL_CONFIG.read_text()))


def test_device_ngram_ids_equal_the_host_hasher(model):
    for name, cfg in _configs(model):
        h = NgramHasher(cfg)
        rng = np.random.default_rng(0)
        B = 96
        ctx = rng.integers(0, cfg.vocab_size, (B, h.context_len))
        tok = rng.integers(0, cfg.vocab_size, B)
        ctx[::5, 0] = h.eos  # EOS in the context and as the token: the n-gram segment rule
        ctx[::7, -1] = h.eos
        tok[::3] = h.eos
        tok[1] = cfg.vocab_size - 1  # the largest products
        expected = np.stack([h.ids(ctx[b], tok[b: b + 1])[-1] for b in range(B)])
        with jax.enable_x64(True):
            got = jax.jit(lambda c, t: device_ngram_ids(h, c, t))(jnp.asarray(ctx, jnp.int32),
                                                                   jnp.asarray(tok, jnp.int32))
        np.testing.assert_array_equal(np.asarray(got), expected, err_msg=name)
    with pytest.raises(RuntimeError, match="enable_x64"):
        device_ngram_ids(h, jnp.zeros((1, h.context_len), jnp.int32), jnp.zeros((1,), jnp.int32))


def _run(runner, requests, **cfg):
    """requests: [(prompt, SamplingParams)] -> (outputs, logprobs, finish reasons, engine, times each request was
    reported finished)."""
    eng = Engine(runner, EngineConfig(max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=16,
                                      batch_invariant=False, **SHAPES, **cfg))
    for i, (prompt, params) in enumerate(requests):
        eng.add_request(str(i), prompt, params)
    reported = {str(i): 0 for i in range(len(requests))}
    while eng.has_unfinished():
        for req in eng.step():
            reported[req.request_id] += req.finished
    reqs = [eng.requests[str(i)] for i in range(len(requests))]
    return ([r.output for r in reqs], [r.logprobs for r in reqs], [r.finish_reason for r in reqs], eng,
            reported)


PROMPTS = [[11, 42, 7, 300, 5, 19, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [400, 401], [77] * 9]


def test_async_equals_sync_for_every_kind_of_row(model):
    """Greedy (with logprobs), device-sampled, host-sampled (a penalty) and logit-biased rows side by side. A step
    holding a row that needs the host before its next step (here the penalty's) commits at once, as without async
    scheduling; once that request is done, the others chain."""
    runner = RealRunner(model, 0)
    SP = fj.SamplingParams
    requests = [(PROMPTS[0], SP(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)),
                (PROMPTS[1], SP(temperature=0.9, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)),
                (PROMPTS[2], SP(temperature=0.0, repetition_penalty=1.3, max_tokens=4, ignore_eos=True)),
                (PROMPTS[3], SP(temperature=0.0, max_tokens=12, ignore_eos=True, logit_bias={5: 3.0}))]
    sync = _run(runner, requests)
    asyn = _run(runner, requests, async_scheduling=True)
    assert asyn[0] == sync[0]
    for a, b in zip(asyn[1], sync[1]):
        assert [(t.token_id, round(t.logprob, 5), t.top) for t in a] == \
            [(t.token_id, round(t.logprob, 5), t.top) for t in b]
    assert sync[0][0] == model.generate(PROMPTS[0], 12)  # and the engine equals the model run alone
    assert asyn[3].counters["chained_rows"] >= 3 * 6 and sync[3].counters["chained_rows"] == 0
    assert asyn[3].counters["steps"] == sync[3].counters["steps"]  # the host-sampled row did not slow down


def test_a_request_ending_before_its_chained_row_is_reported_once_and_freed(model):
    """The chained row launched after a request's last token (EOS / a stop id / a stop string) is dropped: the
    output ends where the sync engine's does, the request is reported finished once, its slot and pages return."""
    runner = RealRunner(model, 0)
    free = _run(runner, [(PROMPTS[0], fj.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))])[0][0]
    stop = free[4]  # a token it generates: the request ends there
    requests = [(PROMPTS[0], fj.SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop])),
                (PROMPTS[1], fj.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]
    sync = _run(runner, requests)
    asyn = _run(runner, requests, async_scheduling=True)
    assert asyn[0] == sync[0] and asyn[2] == sync[2] == ["stop", "length"]
    assert asyn[0][0] == free[: free.index(stop) + 1]
    assert asyn[4] == {"0": 1, "1": 1}
    assert asyn[3].usage()["slots_used"] == 0 and asyn[3].ledger.num_free_slots() == asyn[3].cfg.num_slots


def test_async_with_prefix_caching_equals_sync(model):
    """A row that publishes a prefix snapshot commits before its request's next row (the snapshot copies the
    slot's state); hits on those snapshots give the same tokens."""
    runner = RealRunner(model, 0)
    p = PROMPTS[1]
    params = fj.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    requests = [(p, params), (p + [5, 6], params), (p[:9], params)]
    kw = dict(enable_prefix_caching=True, block_size=4)
    sync = _run(runner, requests, **kw)
    asyn = _run(runner, requests, async_scheduling=True, **kw)
    assert asyn[0] == sync[0]
    assert asyn[3].ledger.stats["prefix_hits"] > 0 and asyn[3].counters["chained_rows"] > 0


def test_async_scheduling_refuses_what_it_cannot_chain(model):
    with pytest.raises(ValueError, match="MTP"):
        Engine(RealRunner(model, 1), EngineConfig(max_model_len=MAX_LEN, num_speculative_tokens=1,
                                                  async_scheduling=True, **SHAPES))
    with pytest.raises(ValueError, match="pipeline"):
        Engine(RealRunner(model, 0), EngineConfig(max_model_len=MAX_LEN, pipeline_delay=1, async_scheduling=True,
                                                  **SHAPES))


def test_server_with_async_scheduling_answers_as_without():
    """`flashnext serve --async-scheduling`'s engine behind the OpenAI API (the toy model, the openai client):
    streamed and whole answers, greedy and seeded sampled with stop strings, equal the server without it."""
    import openai

    from flashnext_jax.llm import LLM
    from serving.app import create_app
    from serving_harness import uvicorn_server

    def answers(async_scheduling):
        llm = LLM("toy", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512,
                  async_scheduling=async_scheduling)
        with uvicorn_server(create_app(llm, "toy")) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            kw = dict(model="toy", max_tokens=12, extra_body={"ignore_eos": True})
            greedy = client.completions.create(prompt=["w3 w4", "w9", "w5 w6 w7"], temperature=0, **kw)
            streamed = ["", "", ""]
            for chunk in client.completions.create(prompt=["w3 w4", "w9", "w5 w6 w7"], temperature=0, stream=True,
                                                   **kw):
                for c in chunk.choices:
                    streamed[c.index] += c.text
            sampled = client.completions.create(prompt="w3 w14", temperature=1.0, seed=3, stop=["w1"], **kw)
            counters = dict(llm.engine.counters)
        return ([c.text for c in greedy.choices], streamed, sampled.choices[0].text,
                sampled.choices[0].finish_reason), counters

    sync, _ = answers(False)
    asyn, counters = answers(True)
    assert asyn == sync and sync[0] == sync[1]
    assert counters["chained_rows"] > 0


def test_precompile_compiles_the_chain_programs_of_the_decode_steps():
    """With precompile, requests whose decode steps follow steps of as many rows compile no chain_tokens program
    (a compile in a request's path stalls every stream); the programs are bounded (a StepCache)."""
    from flashnext_jax.llm import LLM

    llm = LLM("toy", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, async_scheduling=True,
              precompile=True)
    eng = llm.engine
    assert len(eng._chains) > 0 and eng.counters["chain_compiles"] == 0  # all compiled by precompile
    SP = fj.SamplingParams
    outs = llm.generate([[3, 4, 5], [9, 8], [5, 6, 7, 1], [2]],
                        [SP(temperature=0.0, max_tokens=8, ignore_eos=True),
                         SP(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True),
                         SP(temperature=0.0, max_tokens=8, ignore_eos=True),
                         SP(temperature=0.8, seed=2, max_tokens=8, ignore_eos=True)])
    assert all(len(o.token_ids) == 8 for o in outs)
    assert eng.counters["chained_rows"] > 0
    assert eng.counters["chain_compiles"] == 0
    assert len(eng._chains) <= eng._chains.limit


def test_the_ngram_table_goes_to_the_device_in_slices_or_a_clear_error(monkeypatch):
    from flashnext_jax import page_pool
    from flashnext_jax.runner import table_to_device

    table = np.random.default_rng(0).integers(-100, 100, (1000, 24)).astype(np.int8)
    np.testing.assert_array_equal(np.asarray(table_to_device(table, slice_bytes=24 * 300)), table)  # 4 slices
    monkeypatch.setattr(page_pool, "device_memory", lambda device=None: (100_000, 80_000))
    with pytest.raises(ValueError, match="n-gram table on the device .* --async-scheduling"):
        table_to_device(table)
