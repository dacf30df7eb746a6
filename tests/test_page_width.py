"""One padded page-table width (issue 14, item 4): with the paged QSA path the engine pads every step's page table
to max_model_len's pages, so after `precompile` (the decode step and the full-chunk prefill step) a long prompt
and a decode that grows through many pages compile nothing, and the tokens are still the model's own."""

import pytest

import flashnext_jax as fj
from flashnext_jax.engine import Engine, EngineConfig
from flashnext_jax.runner import RealRunner
from flashnext_jax.sampling import SamplingParams


@pytest.fixture(scope="module")
def model():
    return fj.load(dtype="float32")


def generate(eng, prompt, max_tokens):
    """One greedy request through the engine's own loop -> its tokens."""
    eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    out = None
    while eng.has_unfinished():
        for req in eng.step():
            if req.finished:
                out = list(req.output)
    return out


def test_one_width_precompiled_request_compiles_nothing(model):
    runner = RealRunner(model, 0, max_model_len=128)
    eng = Engine(runner, EngineConfig(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=128, page_size=4,
                                      compile_ahead=False))
    assert eng.one_width and eng.max_pages_per_row == 32
    shapes = eng.startup_shapes()
    assert {(s[1], s[2]) for s in shapes} == {(1, 32), (16, 32)}  # the decode step and a full 16-token chunk
    assert eng.precompile(progress=False) == 2
    compiled = eng._steps.counters["compiled"]
    prompt = [(5 * i + 3) % 200 + 1 for i in range(48)]  # three full chunks
    out = generate(eng, prompt, 30)
    assert eng._steps.counters["compiled"] == compiled  # 78 tokens: 20 pages, one width all along
    assert out == model.generate(prompt, 30)


def test_mtp_engine_precompiled_request_compiles_nothing(model):
    """The users' configuration (k = 2 MTP drafts): one width too, its prefill steps compiled at startup."""
    runner = RealRunner(model, 2, max_model_len=128)
    eng = Engine(runner, EngineConfig(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=128, page_size=4,
                                      num_speculative_tokens=2, compile_ahead=False))
    assert eng.one_width
    assert {(s[1], s[2]) for s in eng.startup_shapes()} == {(4, 32), (16, 32)}  # decode: k + 1 tokens, bucketed
    assert eng.precompile(progress=False) == 2
    compiled = eng._steps.counters["compiled"]
    prompt = [(7 * i + 2) % 200 + 1 for i in range(45)]  # three chunks, the last one short
    out = generate(eng, prompt, 40)
    assert eng._steps.counters["compiled"] == compiled  # 85 tokens: 22 pages, one width all along
    assert eng.counters["accepted"] > 0
    assert out == model.generate(prompt, 40)


def test_width_policy_follows_the_runner_and_the_config(model):
    mtp = EngineConfig(max_num_seqs=1, max_model_len=64, page_size=4, num_speculative_tokens=1)
    assert Engine(RealRunner(model, 1), mtp).one_width  # the MTP layer reads its pages too (mtp_paged.py)
    # its dense oracle copies a per-row view of the whole width
    assert not Engine(RealRunner(model, 1, paged_mtp=False), mtp).one_width
    dense = RealRunner(model, 0, paged_qsa=False)
    assert not Engine(dense, EngineConfig(max_num_seqs=1, max_model_len=64, page_size=4)).one_width
    assert Engine(dense, EngineConfig(max_num_seqs=1, max_model_len=64, page_size=4,
                                      page_table_width="max")).one_width
    paged = RealRunner(model, 0)
    assert not Engine(paged, EngineConfig(max_num_seqs=1, max_model_len=64, page_size=4,
                                          page_table_width="bucket")).one_width
    with pytest.raises(ValueError, match="page_table_width"):
        Engine(paged, EngineConfig(max_num_seqs=1, max_model_len=64, page_size=4, page_table_width="wide"))
