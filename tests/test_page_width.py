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
    eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    out = None
    while eng.has_unfinished():
        for req in eng.step():
            if req.finished:
                out = list(req.output)
    assert eng._steps.counters["compiled"] == compiled  # 78 tokens: 20 pages, one width all along
    assert out == model.generate(prompt, 30)


def test_width_policy_follows_the_runner_and_the_config(model):
    mtp = RealRunner(model, 1) if model.has_mtp else None
    if mtp is not None:  # the MTP layer still reads a dense per-row view: a padded width would copy all of it
        assert not Engine(mtp, EngineConfig(max_num_seqs=1, max_model_len=64, page_size=4)).one_width
    dense = RealRunner(model, 0, paged_qsa=False)
    assert not Engine(dense, EngineConfig(max_num_seqs=1, max_model_len=64, page_size=4)).one_width
    assert Engine(dense, EngineConfig(max_num_seqs=1, max_model_len=64, page_size=4,
                                      page_table_width="max")).one_width
    paged = RealRunner(model, 0)
    assert not Engine(paged, EngineConfig(max_num_seqs=1, max_model_len=64, page_size=4,
                                          page_table_width="bucket")).one_width
    with pytest.raises(ValueError, match="page_table_width"):
        Engine(paged, EngineConfig(max_num_seqs=1, max_model_len=64, page_size=4, page_table_width="wide"))
