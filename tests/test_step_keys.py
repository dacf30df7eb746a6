"""A small, fixed set of compiled model steps (issue 18 item 1): how rows choose their tokens (greedy, temperature,
top-k, top-p, logprobs, logit_bias, grammar masks) is the sampler's business (step_programs.choose_tokens, keyed by
SamplerKey), so the model step compiles once per (rows, tokens, page-table width) whatever the traffic samples
with, and each request's tokens are still those of its solo run."""

import numpy as np

import flashnext_jax as fj
from flashnext_jax import StructuredOutputsParams as SO
from flashnext_jax.llm import LLM
from flashnext_jax.sampling import SamplingParams
from flashnext_jax.toy_model import ToyConfig, solo_greedy

CFG = ToyConfig(vocab_size=64, max_model_len=64)
# one row bucket (4), one page-table width, token buckets 1 (decode: no MTP, so no draft column) and 8 (prefill)
SHAPES = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=8, prefill_buckets=(8,), min_batch_bucket=4,
              page_size=16, block_size=16, page_table_width="max", compile_ahead=False)
PROMPTS = [[5, 9, 3, 7, 11], [2, 7, 1, 8, 2, 8, 1], [3, 1, 4, 1, 5, 9], [1, 4, 1, 4, 2], [6, 2, 8, 3]]
VARIANTS = [
    SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=3, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=5, seed=4, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.6, seed=5, max_tokens=7, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logit_bias={7: 4.0, 21: -50.0}),
    SamplingParams(temperature=0.9, top_k=300, top_p=0.9, seed=6, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=7, max_tokens=7, ignore_eos=True, repetition_penalty=1.3),  # host
]


def _assert_same(batched, solo):
    assert batched.token_ids == solo.token_ids
    for a, b in zip(batched.logprobs or (), solo.logprobs or (), strict=True):
        assert a.token_id == b.token_id and np.isclose(a.logprob, b.logprob, rtol=1e-5, atol=1e-6)
        assert [i for i, _ in a.top] == [i for i, _ in b.top]


def test_sampling_variants_do_not_compile_the_model_step_again():
    llm = LLM(CFG, **SHAPES)  # a fresh runner: its own compiled programs
    eng = llm.engine
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(VARIANTS))]
    batched = llm.generate(prompts, VARIANTS)
    # every step was 4 rows x (1 or 8 tokens) at the one width: two model steps for all eight variants
    assert eng._steps.counters["compiled"] == 2, eng._steps.keys()
    assert {(k.rows, k.tokens, k.page_table_width) for k in eng._steps.keys()} == {(4, 1, 4), (4, 8, 4)}
    assert eng._samplers.counters["compiled"] >= 4  # the variants compiled samplers instead
    solo = [llm.generate([p], [v])[0] for p, v in zip(prompts, VARIANTS)]  # each alone (padding rows around it)
    for b, s in zip(batched, solo, strict=True):
        _assert_same(b, s)
    assert batched[0].token_ids == solo_greedy(CFG, prompts[0], 7, ignore_eos=True)
    assert batched[5].token_ids != solo_greedy(CFG, prompts[5], 7, ignore_eos=True)  # the bias mattered
    assert eng._steps.counters["compiled"] == 2
    assert eng.counters["compiles"] == 2 and eng.counters["sampler_compiles"] == eng._samplers.counters["compiled"]


def test_greedy_steps_run_no_sampler():
    llm = LLM(CFG, **SHAPES)
    llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert llm.engine._samplers.counters["compiled"] == 0


def test_precompiled_samplers_cover_their_variants():
    """precompile(sampling_params=...) compiles the model steps and, at every row bucket, the samplers of those
    parameters: requests of them compile nothing; another variant compiles a sampler only."""
    llm = LLM(CFG, **(SHAPES | {"min_batch_bucket": 1}))
    eng = llm.engine
    expected = [VARIANTS[2], VARIANTS[3], VARIANTS[4]]
    keys = eng.startup_samplers(expected)
    assert {k.rows for k in keys} == {1, 2, 4} and len(keys) == 3 * 3
    assert eng.startup_samplers([VARIANTS[0]]) == []  # greedy needs none
    eng.precompile(progress=False, sampling_params=expected)
    steps, samplers = eng._steps.counters["compiled"], eng._samplers.counters["compiled"]
    assert samplers == len(keys)
    for v in expected:
        for n in (1, 3):
            llm.generate(PROMPTS[:n], v)
    assert (eng._steps.counters["compiled"], eng._samplers.counters["compiled"]) == (steps, samplers)
    llm.generate(PROMPTS[:1], VARIANTS[1])  # temperature alone: a sampler of its own (device_sampling.mask_modes)
    assert (eng._steps.counters["compiled"], eng._samplers.counters["compiled"]) == (steps, samplers + 1)


def test_a_grammar_constrained_request_shares_the_model_step():
    """The demo model (llguidance needs a real tokenizer): a JSON-schema request batched with a greedy and a
    sampled one runs on the one model step their shapes have, and each equals its solo run."""
    from flashnext_jax.tokenizer import Tokenizer

    llm = LLM(fj.load(dtype="float32"), tokenizer=Tokenizer.from_dir(fj.DEMO_MODEL), max_model_len=96,
              page_size=96, block_size=96, min_batch_bucket=4, min_token_bucket=8, compile_ahead=False,
              max_num_seqs=4)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    params = [SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=SO(json=schema)),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True, logprobs=1)]
    prompts = [[11, 12, 13, 14, 15], [5, 6, 7], [20, 21, 22, 23]]
    batched = llm.generate(prompts, params)
    solo = [llm.generate([p], [v])[0] for p, v in zip(prompts, params)]
    for b, s in zip(batched, solo, strict=True):
        _assert_same(b, s)
    assert llm.engine._steps.counters["compiled"] == 1  # 4 rows x 8 tokens x 1 page: prefill and decode alike
    assert any(key.grammar for key in llm.engine._samplers.keys())
