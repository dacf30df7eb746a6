"""Token kinds (flashnext_jax/token_kinds.py, issue 19's cost): in a batch-invariant step on the kernels, generated
tokens take the fixed GEMVs and prompt tokens the tensor-core kernels. What must hold:
* `by_kind` gives each row its kind's result (in a prefill-shaped step both paths run; a decode-shaped step runs the
  GEMV path only);
* the scheduler keeps the kinds apart, so a token is computed as its kind in any batch: a row is all prompt tokens
  or all generated ones (a recompute after a preemption too), a generated row holds at most the decode width, a
  decode-shaped step holds no prompt row, and no prefix snapshot ends past a prompt (checked on every step of a run
  with preemptions, prefix hits and MTP, with a control run without kinds that breaks the rules);
* on the kernels (interpret mode), a request's tokens and logprobs equal its solo run bitwise, and routing by the
  step's shape instead of the row's kind (the naive rule) breaks that.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashnext_jax as fj
from flashnext_jax import token_kinds
from flashnext_jax.engine import Engine, EngineConfig
from flashnext_jax.runner import RealRunner
from flashnext_jax.token_kinds import TokenKinds


def _gen(v):
    return v + 1000.0


def _prompt(v):
    return v - 1000.0


def test_by_kind_gives_each_row_its_kinds_result():
    x = jnp.arange(3 * 5 * 2, dtype=jnp.float32).reshape(3, 5, 2)
    kinds = TokenKinds(generated=jnp.array([True, False, True]), tokens=2, all_generated=False)
    with token_kinds.token_kinds(kinds):
        y = token_kinds.by_kind(x, _gen, _prompt)
        pair = token_kinds.by_kind((x, x * 2), lambda a: _gen(a[0] + a[1]), lambda a: _prompt(a[0] + a[1]))
    want = np.array(_prompt(x))
    want[[0, 2], :2] = np.asarray(_gen(x))[[0, 2], :2]  # generated rows: their first 2 columns
    np.testing.assert_array_equal(np.asarray(y), want)
    np.testing.assert_array_equal(np.asarray(pair), want + 2 * np.asarray(x))  # a tuple is sliced alike
    last = x[:, :1]  # a call on one position per row (the last token's logits)
    with token_kinds.token_kinds(kinds):
        y1 = token_kinds.by_kind(last, _gen, _prompt)
    np.testing.assert_array_equal(np.asarray(y1)[:, 0, 0], [1000.0, -990.0, 1020.0])


def test_by_kind_outside_a_context_and_in_a_decode_step():
    x = jnp.ones((2, 1, 4))
    np.testing.assert_array_equal(np.asarray(token_kinds.by_kind(x, _gen, _prompt)), -999.0)
    decode = TokenKinds(generated=jnp.array([True, False]), tokens=1, all_generated=True)
    with token_kinds.token_kinds(decode):
        np.testing.assert_array_equal(np.asarray(token_kinds.by_kind(x, _gen, _prompt)), 1001.0)
    with token_kinds.token_kinds(TokenKinds(jnp.array([True, False, True]), 1, False)):
        with pytest.raises(ValueError, match="rows=3"):
            token_kinds.by_kind(x, _gen, _prompt)
    with token_kinds.token_kinds(TokenKinds(jnp.array([True, False]), 1, False)):  # rows repeated (MTP drafts)
        y = token_kinds.by_kind(jnp.ones((4, 1, 3)), _gen, _prompt)
    np.testing.assert_array_equal(np.asarray(y)[:, 0, 0], [1001.0, 1001.0, -999.0, -999.0])


# ------------------------------------------------------------------------------ the scheduler keeps kinds apart

def kind_violations(tickets: list, prompts: dict, decode_tokens: int) -> list[str]:
    """Every broken rule in the recorded steps: (ticket, {request id: prompt length})."""
    bad = []
    for t in tickets:
        for r in t.rows:
            p = prompts[r.request_id]
            if r.start < p < r.start + r.n:
                bad.append(f"step {t.step_id}: a row mixes prompt and generated tokens ({r.start}+{r.n}, prompt {p})")
            if r.start >= p and r.n > decode_tokens:
                bad.append(f"step {t.step_id}: a generated row of {r.n} tokens")
            if r.start < p and t.num_tokens <= decode_tokens:
                bad.append(f"step {t.step_id}: a prompt row in a decode-shaped step")
            if r.capture is not None and r.capture.length > p:
                bad.append(f"step {t.step_id}: a prefix snapshot after {r.capture.length} tokens, prompt {p}")
    return bad


def run_recorded(lm, prompts, sp, until=None):
    """(outputs, every step's ticket, {request id: prompt length}); until(tickets, lens): step only until it holds
    (the outputs then None)."""
    eng = lm.engine
    tickets, lens = [], {}
    make = eng._make_ticket

    def record(plans):
        t = make(plans)
        tickets.append(t)
        lens.update({p.request.request_id: len(p.request.prompt) for p in plans})
        return t

    eng._make_ticket = record
    if until is None:
        return lm.generate(prompts, sp), tickets, lens
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, sp)
    while eng.has_unfinished() and not until(tickets, lens):
        eng.step()
    return None, tickets, lens


@pytest.fixture(scope="module")
def demo_runner():
    return RealRunner(fj.load(dtype="bfloat16"), 1)


PAGE = 8
SHARED = [7, 300, 41, 9, 250, 3, 77, 18, 5, 90, 61, 12, 400, 33, 21, 8]
PROMPTS = [SHARED + [11, 12, 13], SHARED + [5], [17] * 9, SHARED[:10], SHARED + [2, 3, 4, 5, 6, 7, 8]]


def _lm(runner, kinds: bool):
    # a pool of 10 pages of 8 tokens for 3 requests of up to 5 pages: preemptions; prefix caching on 8-token blocks
    return fj.LLM(runner, speculative_config={"method": "mtp", "num_speculative_tokens": 1}, max_num_seqs=3,
                  max_num_batched_tokens=12, max_model_len=48, page_size=PAGE, num_pages=10, block_size=8,
                  num_snapshots=8, enable_prefix_caching=True, batch_invariant=True, token_kinds=kinds,
                  min_batch_bucket=2, min_token_bucket=2, min_pool_capacity=(4, 16, 8))


# Slow (~135 s of the suite's compiles, stop 48): the default suite checks these rules on every step of runs with
# token kinds, MTP k = 1 and preemptions, each request's tokens and logprobs bitwise its solo run without kinds
# (test_batch_invariance_engine.py::test_bf16_engine_machine_equals_solo_bitwise: kind_violations after each
# step on odd seeds, a preemption met with kinds asserted), kinds with prefix hits giving the tokens of the run
# without them (test_pipeline.py::test_pipeline_with_token_kinds_equals_one_stage), and the rule check's control
# below (test_the_rule_check_fails_without_kinds).
@pytest.mark.slow
def test_scheduler_keeps_prompt_and_generated_tokens_apart(demo_runner):
    sp = fj.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    lm = _lm(demo_runner, True)
    outs, tickets, lens = run_recorded(lm, PROMPTS, sp)
    assert kind_violations(tickets, lens, lm.engine._decode_tokens) == []
    # the rules were exercised: preemptions (recomputes of generated tokens), prefix hits, mixed steps
    assert any(o.metrics["num_preemptions"] for o in outs), [o.metrics for o in outs]
    assert any(o.metrics["num_cached_tokens"] for o in outs)
    assert any(len({r.start >= lens[r.request_id] for r in t.rows}) == 2 for t in tickets)
    # outputs: each request alone on an engine without kinds (the CPU's reference kernels: kinds change no number)
    solo = fj.LLM(demo_runner, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=48, page_size=PAGE,
                  batch_invariant=True, token_kinds=False, min_batch_bucket=2, min_token_bucket=2,
                  min_pool_capacity=(4, 16, 8))
    for p, o in zip(PROMPTS, outs):
        alone = solo.generate([p], sp)[0]
        assert o.token_ids == alone.token_ids
        assert [(lp.token_id, lp.logprob) for lp in o.logprobs] == [(lp.token_id, lp.logprob) for lp in alone.logprobs]


def test_the_rule_check_fails_without_kinds(demo_runner):
    """Control: the same run scheduled without kinds breaks the rules the test above checks (stepped until the
    first broken rule: the steps after it would only compile more step shapes)."""
    sp = fj.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    lm = _lm(demo_runner, False)
    _, tickets, lens = run_recorded(lm, PROMPTS, sp, until=lambda t, n: kind_violations(t, n, lm.engine._decode_tokens))
    assert kind_violations(tickets, lens, lm.engine._decode_tokens)


def test_token_kinds_need_batch_invariance(demo_runner):
    with pytest.raises(ValueError, match="batch_invariant"):
        Engine(demo_runner, EngineConfig(batch_invariant=False, token_kinds=True))


# ------------------------------------------------------------------------------ on the kernels (interpret mode)

@pytest.fixture
def interpret_kernels(monkeypatch):
    """FLASHNEXT_KERNELS=interpret for this test (jit caches cleared: the switch is read at trace time)."""
    monkeypatch.setenv("FLASHNEXT_KERNELS", "interpret")
    jax.clear_caches()
    yield
    monkeypatch.delenv("FLASHNEXT_KERNELS")
    jax.clear_caches()


def _quantized_demo_llm(max_num_seqs: int, budget: int) -> fj.LLM:
    """The demo config cut to a GDN layer (with the PLE) and a QSA layer, random INT4-Mixed weights (bench's
    real_size --tiny model), batch invariant on the interpret-mode kernels: token kinds on by default."""
    from bench import decode_step
    from bench.engine_step import RandomPleRunner
    from bench.real_size import tiny_config
    from flashnext_jax import api

    if "model" not in _QUANTIZED:
        cfg = tiny_config()
        params, _, _ = decode_step.build(cfg, jax.random.key(0))
        _QUANTIZED["model"] = api.Model(cfg, params, table=None, dtype=jnp.bfloat16)
    return fj.LLM(RandomPleRunner(_QUANTIZED["model"], 0), max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                  max_model_len=96, page_size=16, num_pages=24, batch_invariant=True, min_batch_bucket=2,
                  prefill_buckets=(budget,), page_table_width="max", compile_ahead=False)


_QUANTIZED: dict = {}
KERNEL_PROMPTS = [[3 + i * 7 % 500 for i in range(n)] for n in (21, 6, 13)]
KERNEL_PARAMS = fj.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
_SOLO: list = []


def _solo_runs() -> list:
    """Each of KERNEL_PROMPTS alone, made once for both tests below, on the engine the batched run then uses (its
    programs compiled once: the solo runs' 2-row steps, then the batched run's 4-row ones and its 2-row decode
    step). (A solo run's steps hold prompt tokens only or one generated token, so the control's naive rule would
    route them as the real one does.)"""
    if not _SOLO:
        _QUANTIZED["llm"] = solo = _quantized_demo_llm(3, 32)
        _SOLO.extend(solo.generate([p], KERNEL_PARAMS)[0] for p in KERNEL_PROMPTS)
    return _SOLO


def _kernel_run(monkeypatch, route_by_shape: bool) -> tuple[list, list]:
    """(batched outputs, solo outputs) of KERNEL_PROMPTS; route_by_shape: the naive rule (a prefill-shaped step
    sends every token to the tensor-core kernel), the control."""
    alone = _solo_runs()  # before the control's rule: the reference stays the real one
    batched = _QUANTIZED["llm"]  # the solo runs' engine, idle again: programs traced with the real rule
    if route_by_shape:
        real = token_kinds.by_kind
        monkeypatch.setattr(token_kinds, "by_kind", lambda x, gen, prompt: (
            gen(x) if token_kinds.current() is not None and token_kinds.current().all_generated else prompt(x))
            if token_kinds.current() is not None else real(x, gen, prompt))
        batched = _quantized_demo_llm(3, 32)  # a new runner: its programs traced with the naive rule
    assert batched.engine.cfg.token_kinds
    outs = batched.generate(KERNEL_PROMPTS, KERNEL_PARAMS)
    return outs, alone


def _bits(o):
    return o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]


def test_on_the_kernels_each_request_equals_its_solo_run(interpret_kernels, monkeypatch):
    """Three requests together (a prompt's chunks share steps with the others' decode rows, B = 2 and 4 decode
    steps) give each the tokens and logprobs of its solo run, bitwise, with the GEMVs for generated tokens."""
    from pallas_kernels import moe_matmul, quant_matmul

    traced = []
    for module, name in ((quant_matmul, "quant_matmul_gemv_fixed"), (moe_matmul, "routed_experts_gemv_fixed")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _real=real, _name=name, **kw: traced.append(_name) or _real(*a, **kw))
    splits = []  # the tensor-core kernel's split-K: prompt tokens take the prompt-token configuration (none)
    real_tc = quant_matmul.quant_matmul_pallas
    monkeypatch.setattr(quant_matmul, "quant_matmul_pallas",
                        lambda *a, **kw: splits.append(kw["config"].splits) or real_tc(*a, **kw))
    outs, alone = _kernel_run(monkeypatch, route_by_shape=False)
    for o, a in zip(outs, alone):
        assert _bits(o) == _bits(a)
    assert {"quant_matmul_gemv_fixed", "routed_experts_gemv_fixed"} <= set(traced)  # the GEMVs did run
    assert splits and set(splits) == {1}


def test_routing_by_step_shape_breaks_it(interpret_kernels, monkeypatch):
    """Control: the same run with decode rows in prefill-shaped steps sent to the tensor-core kernel (routing by the
    step's shape, not the row's kind): some request's logprobs then differ from its solo run."""
    outs, alone = _kernel_run(monkeypatch, route_by_shape=True)
    assert any(_bits(o) != _bits(a) for o, a in zip(outs, alone))
