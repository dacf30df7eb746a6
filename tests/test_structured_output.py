"""Structured outputs: grammar masks (llguidance) on the device and the host, exact under MTP and batching, on the
embedded demo model and on tests/fixtures/tiny_causal (transformers' own save in the CausalLM layout, with its own
tokenizer: another loading path).

Oracles: `jsonschema` for every JSON output; llguidance's own `validate_tokens` for masks and for truncated
outputs (a length-finished output must be a valid prefix); llguidance.numpy's bitmask application for the device
unpacking; the greedy non-MTP run for the greedy MTP run; each request's solo run for a batched pair.
"""

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import jsonschema
import llguidance
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llguidance.numpy import apply_token_bitmask_inplace

import flashnext_jax as fj
from flashnext_jax import SamplingParams
from flashnext_jax import StructuredOutputsParams as SO
from flashnext_jax import sampling
from flashnext_jax.device_sampling import SamplingInputs
from flashnext_jax.step_programs import with_device_sampling
from flashnext_jax.structured_output import GrammarCompiler, allowed_tokens, apply_token_bitmask
from flashnext_jax.tokenizer import Tokenizer

TOK = Tokenizer.from_dir(fj.DEMO_MODEL)
V = 512  # the demo model's logits (tiny_causal's too)
CHECKPOINTS = {"demo": fj.DEMO_MODEL, "tiny_causal": Path(__file__).parent / "fixtures" / "tiny_causal"}
PROMPT = [11, 12, 13, 14, 15]
SHAPES = dict(max_model_len=96, page_size=96, block_size=96, min_batch_bucket=2, min_token_bucket=8,
              min_pool_capacity=(2, 4, 4), compile_ahead=False, max_num_seqs=2)
_LLM: dict = {}


def llm(k: int, checkpoint: str = "demo") -> fj.LLM:
    """One LLM per checkpoint and MTP setting, fixed shapes: a handful of compiles for the whole file."""
    if (checkpoint, k) not in _LLM:
        if checkpoint not in _LLM:
            path = CHECKPOINTS[checkpoint]
            _LLM[checkpoint] = fj.load(path, dtype="float32"), TOK if checkpoint == "demo" else Tokenizer.from_dir(path)
        model, tokenizer = _LLM[checkpoint]
        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        _LLM[checkpoint, k] = fj.LLM(model, speculative_config=spec, tokenizer=tokenizer, **SHAPES)
    return _LLM[checkpoint, k]


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(TOK, V)


# --------------------------------------------------------------------------------------- requests and grammars

@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"), ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1]"}, "must be an object"), ({"choice": []}, "choice"), ({"choice": "ab"}, "choice"),
    ({"regex": ""}, "regex")])
def test_params_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SO(**kwargs)


@pytest.mark.parametrize("params, message", [
    (SO(regex="("), "structured_outputs.regex: unsupported or invalid: .*unclosed group"),
    (SO(json={"type": "foo"}), "structured_outputs.json: unsupported or invalid: .*foo"),
    (SO(grammar="start: undefined_rule"), "structured_outputs.grammar: unsupported or invalid")])
def test_invalid_grammars_are_value_errors_naming_the_problem(compiler, params, message):
    with pytest.raises(ValueError, match=message):
        compiler.new_state(params)


def test_compiled_grammars_are_cached_by_spec(compiler):
    before = compiler._compiled.cache_info().hits
    a, b = compiler.new_state(SO(choice=["x", "y"])), compiler.new_state(SO(choice=["x", "y"]))
    assert compiler._compiled.cache_info().hits == before + 1
    assert a.matcher is not b.matcher  # each request its own state
    a.commit(TOK.encode("x"), "a")
    assert a.done and not b.done


def test_engine_refuses_a_grammar_without_a_tokenizer():
    toy = fj.LLM("toy", tokenizer=None)
    toy.engine.grammar_compiler = None
    with pytest.raises(ValueError, match="need a tokenizer"):
        toy.engine.add_request("r", [1, 2], SamplingParams(structured_outputs=SO(regex="a")))


# ----------------------------------------------------------------------------------------------------- masks

def _allowed_by_validation(matcher) -> np.ndarray:
    return np.array([matcher.validate_tokens([t]) == 1 for t in range(V)])


def test_masks_at_draft_positions_match_validation_and_leave_the_state_committed(compiler):
    state = compiler.new_state(SO(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                        "required": ["a"], "additionalProperties": False}))
    drafts = TOK.encode('{"a":1')
    mask = compiler.fill_masks([(state, 1, drafts)], 1 + len(drafts) + 2)
    allowed = allowed_tokens(mask, V)
    assert allowed[0].all() and allowed[-1].all()  # unlisted positions allow everything
    probe = compiler.new_state(SO(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                        "required": ["a"], "additionalProperties": False})).matcher
    for i in range(len(drafts) + 1):
        assert np.array_equal(allowed[1 + i], _allowed_by_validation(probe)), i
        if i < len(drafts):
            probe.consume_token(drafts[i])
    assert state.matcher.validate_tokens(drafts) == len(drafts)  # drafts rolled back: still at the start
    assert np.array_equal(allowed_tokens(state.step_mask, V), allowed[1: 2 + len(drafts)])


def test_a_forbidden_draft_ends_the_masked_positions(compiler):
    state = compiler.new_state(SO(regex="[0-9]+"))
    letter, digit = TOK.encode("x")[0], TOK.encode("7")[0]
    mask = compiler.fill_masks([(state, 0, [digit, letter, digit])], 4)
    allowed = allowed_tokens(mask, V)
    assert allowed[0][digit] and not allowed[0][letter] and not allowed[1][letter]
    assert allowed[2].all() and allowed[3].all()  # after the forbidden draft: never used to choose a token


@pytest.mark.parametrize("v", [V, V - 5])  # a whole number of mask words, and a last word partly used
def test_device_unpacking_matches_llguidance_numpy(v):
    rng = np.random.default_rng(0)
    mask = rng.integers(-2**31, 2**31, size=(3, 2, (v + 31) // 32), dtype=np.int64).astype(np.int32)
    logits = rng.standard_normal((3, 2, v)).astype(np.float32)
    ref = logits.reshape(6, v).copy()
    apply_token_bitmask_inplace(ref, mask.reshape(6, -1))
    got = np.asarray(jax.jit(apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(mask))).reshape(6, v)
    assert np.array_equal(got, ref)
    assert np.array_equal(np.isfinite(ref), allowed_tokens(mask, v).reshape(6, v))


def _fake_step(params, store, batch):
    return store, {"logits": batch, "draft_logits": jnp.zeros(batch.shape[:2] + (0, batch.shape[-1]))}


def test_steps_without_a_constrained_row_trace_no_mask_code():
    run = with_device_sampling(_fake_step)
    logits = jnp.zeros((2, 1, V))
    plain = str(jax.make_jaxpr(lambda x: run(None, None, x))(logits))
    masked = str(jax.make_jaxpr(lambda x, m: run(None, None, x, None, False, token_mask=m))(
        logits, jnp.full((2, 1, V // 32), -1, jnp.int32)))
    assert "shift_right" not in plain and "shift_right" in masked


def test_device_argmax_and_samples_stay_inside_the_mask():
    run = jax.jit(with_device_sampling(_fake_step), static_argnums=(4,))
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((1, 1, V)).astype(np.float32))
    mask = np.zeros((1, 1, V // 32), np.int32)
    mask[0, 0, 3] = 0b1010  # tokens 97 and 99 only
    seen = set()
    for i in range(12):
        inputs = SamplingInputs.for_rows([(SamplingParams(temperature=2.0, seed=5), i)], 1)
        _, out = run(None, None, logits, inputs, True, token_mask=jnp.asarray(mask))
        seen.add(int(out["logits_sample"][0, 0]))
        assert int(out["logits_argmax"][0, 0]) == (97 if logits[0, 0, 97] >= logits[0, 0, 99] else 99)
        assert bool(out["logits_finite"][0, 0])  # flags and logprobs are those of the raw logits
    assert seen == {97, 99}


def test_host_verification_rejects_a_draft_the_grammar_forbids():
    target = np.zeros((2, 8))
    target[0, 5] = 9.0  # the target loves token 5, which the grammar forbids
    allowed = np.ones((2, 8), bool)
    allowed[0, 5] = False
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1)):
        m, toks = sampling.verify(target, [5], [None], params, [1, 2], 0, "r", allowed)
        assert m == 0 and toks[0] != 5
        m, toks = sampling.verify(target, [5], [None], params, [1, 2], 0, "r")
        assert m == 1 and toks[0] == 5  # unconstrained: accepted


# --------------------------------------------------------------------------------------- the engine, end to end

_NAMES = st.sampled_from(["id", "name", "ok", "tags", "sub", "kind"])
_LEAF = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda n: {"type": "string", "pattern": f"^[a-z]{{1,{n}}}$"}, st.integers(1, 4)),
    st.lists(st.sampled_from(["red", "green", "blue", 1, True, None]), min_size=1, max_size=3, unique=True)
    .map(lambda v: {"enum": v}),
    st.just({"type": "boolean"}))


def _object(children):
    return st.dictionaries(_NAMES, children, min_size=1, max_size=3).flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props))).map(
            lambda req: {"type": "object", "properties": props, "required": sorted(req),
                         "additionalProperties": False}))


SCHEMAS = st.recursive(_LEAF, lambda children: st.one_of(
    _object(children), st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children,
                                 st.integers(0, 2))), max_leaves=4).filter(lambda s: len(json.dumps(s)) < 400)
OBJECT_SCHEMAS = _object(SCHEMAS)
MAX_TOKENS = 64


def _check(out, schema, compiler):
    """A stopped output parses and validates; a length-truncated one is a valid prefix of the grammar."""
    if out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text), schema)
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS
        probe = compiler.new_state(SO(json=schema)).matcher
        assert probe.validate_tokens(out.token_ids) == len(out.token_ids)


def _random_schema_runs(schema, seed, checkpoint, mtp=(0, 1)):
    """Greedy and sampled, with each MTP setting of `mtp`: every output validates (or is a valid prefix when cut by
    max_tokens), greedy MTP == greedy without MTP, and the sampled constrained request batched with a sampled
    unconstrained one == its solo run (and the other's)."""
    compiler = llm(0, checkpoint).engine.grammar_compiler
    outs = {}
    for k in mtp:
        for temperature in (0.0, 0.9):
            params = SamplingParams(temperature=temperature, seed=seed, max_tokens=MAX_TOKENS,
                                    structured_outputs=SO(json=schema))
            outs[k, temperature] = out = llm(k, checkpoint).generate(PROMPT, params)[0]
            _check(out, schema, compiler)
    if 1 in mtp:
        assert outs[1, 0.0].token_ids == outs[0, 0.0].token_ids  # greedy MTP == greedy without MTP
    free = SamplingParams(temperature=0.9, top_p=0.9, seed=seed + 1, max_tokens=12, ignore_eos=True)
    constrained = SamplingParams(temperature=0.9, seed=seed, max_tokens=MAX_TOKENS, structured_outputs=SO(json=schema))
    both = llm(0, checkpoint).generate([PROMPT, PROMPT[::-1]], [constrained, free])
    assert both[0].token_ids == outs[0, 0.9].token_ids
    assert both[1].token_ids == llm(0, checkpoint).generate(PROMPT[::-1], free)[0].token_ids


_HYPOTHESIS = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@settings(max_examples=4, **_HYPOTHESIS)
@given(schema=OBJECT_SCHEMAS, seed=st.integers(0, 2**16))
def test_random_schemas_greedy_and_sampled_with_and_without_mtp(schema, seed):
    _random_schema_runs(schema, seed, "demo")


@settings(max_examples=3, **_HYPOTHESIS)
@given(schema=OBJECT_SCHEMAS, seed=st.integers(0, 2**16))
def test_random_schemas_on_the_tiny_causal_fixture(schema, seed):
    """The same properties on the CausalLM-layout checkpoint, without MTP (transformers' save drops the MTP tensors):
    three examples by default (~35 s on 2 cores), twelve in the slow variant below."""
    _random_schema_runs(schema, seed, "tiny_causal", mtp=(0,))


@pytest.mark.slow
@settings(max_examples=12, **_HYPOTHESIS)
@given(schema=OBJECT_SCHEMAS, seed=st.integers(0, 2**16))
def test_random_schemas_on_the_tiny_causal_fixture_many(schema, seed):
    _random_schema_runs(schema, seed, "tiny_causal", mtp=(0,))


@pytest.mark.parametrize("k", [0, 1])
def test_a_constrained_request_batched_with_an_unconstrained_one_equals_their_solo_runs(k):
    lm = llm(k)
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=SO(regex="[a-z]{3}-[0-9]{2,4}"))
    both = lm.generate([PROMPT, PROMPT[::-1]], [constrained, free])
    solo = [lm.generate(PROMPT, constrained)[0], lm.generate(PROMPT[::-1], free)[0]]
    assert [o.token_ids for o in both] == [o.token_ids for o in solo]
    assert both[0].finish_reason == "stop" and re.fullmatch("[a-z]{3}-[0-9]{2,4}", both[0].text)


@pytest.mark.parametrize("params", [SO(choice=["alpha", "beta", "gamma"]), SO(json_object=True),
                                    SO(grammar='start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/')])
def test_choice_json_object_and_lark(params):
    out = llm(1).generate(PROMPT, SamplingParams(temperature=0.7, seed=2, max_tokens=24,
                                                 repetition_penalty=1.2, structured_outputs=params))[0]
    if params.choice:
        assert out.text in params.choice and out.finish_reason == "stop"
    elif params.json_object:
        assert out.finish_reason == "length" or isinstance(json.loads(out.text), dict)
    else:
        assert out.finish_reason == "length" or re.fullmatch(r"\(\d{1,2}(,\d{1,2})*\)", out.text)


def test_a_grammar_waiting_for_the_end_of_thinking_masks_nothing_until_then(compiler):
    state = compiler.new_state(SO(regex="[0-9]+", after="</think>"))
    assert not state.active and not state.done
    assert compiler.fill_masks([], 1).tolist() == [[-1] * (V // 32)]
    for piece in ("hmm, letters", " </th", "ink>"):
        assert not state.active
        state.commit(TOK.encode(piece), "r")  # letters are fine while dormant
    assert state.active
    state.commit(TOK.encode("42"), "r")
    with pytest.raises(RuntimeError, match="refused"):
        state.commit(TOK.encode("x"), "r")


def test_serial_mask_fill_equals_llguidance_executor(compiler):
    schema = SO(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    states = [compiler.new_state(schema), compiler.new_state(SO(regex="[0-9]+x"))]
    rows = [(states[0], 0, TOK.encode('{"a":1')), (states[1], 8, TOK.encode("12x7"))]  # "7": forbidden after x
    serial = compiler.fill_masks(rows, 14)
    parallel = np.full_like(serial, -1)
    compiler._fill_parallel(rows, parallel)
    assert np.array_equal(serial, parallel)
