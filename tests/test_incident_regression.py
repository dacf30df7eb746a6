"""The vLLM #55951 incident as a deterministic regression (../shared/docs/state-store.md, "Minimal deterministic
regression"): pp delay 3, k = 1, block 4. Step t: batch [A, B], A crosses a snapshot boundary with 2 tokens
accepted, so a boundary snapshot is due. A then finishes; C arrives and reuses A's slot; step t's deferred work
executes. Expected: B's and C's states still equal their folds and nothing is written to C.

In this engine the deferred work is a commit consuming step t's ticket; A's slot cannot return to the pool before
that ticket retires (invariant 4), so C takes A's slot only after the deferred work ran, with a new generation,
and its prefix hits the snapshot A's deferred work just published.
"""

import jax
import pytest

from flashnext_jax.engine import Engine, EngineConfig
from flashnext_jax.pipeline import PipelineRunner
from flashnext_jax.stages import StagePlan
from flashnext_jax.sampling import SamplingParams
from flashnext_jax.state_store import SlotRef, StaleWrite
from flashnext_jax.toy_model import ToyConfig, ToyRunner, check_engine_against_fold, solo_greedy

CFG = ToyConfig(max_model_len=64)
RUNNER = ToyRunner(CFG, num_speculative_tokens=1)
# the same scenario with real stages: three stores, three jitted steps, hidden states passed between them (the
# stages share this process's device; test_pipeline.py places them on three)
STAGED = PipelineRunner(RUNNER, StagePlan.build(CFG.num_layers, 3, devices=[jax.devices()[0]] * 3))
RUNNERS = pytest.mark.parametrize("runner", [RUNNER, STAGED], ids=["delay3", "stages3"])
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PROMPT_A = [5, 9, 2, 7, 1, 3]  # 6 tokens: first decode row [o1, d1] covers positions 6, 7 -> boundary at 8
PROMPT_B = [4, 4, 8, 1, 6, 2, 9, 11, 3]


def _solo(prompt, n=40):
    return solo_greedy(CFG, prompt, n, max_len=CFG.max_model_len, ignore_eos=True)


def _oracle_drafts(prompts):
    """MTP drafts that are always right, so every verify step accepts draft + bonus (2 tokens)."""
    solos = {rid: _solo(p) for rid, p in prompts.items()}

    def hook(req, proposed):
        j = len(req.output)
        return [solos[req.request_id][j]] if j < len(solos[req.request_id]) else proposed

    return hook, solos


def _engine(hook, num_slots=2, row_order=None, runner=RUNNER):
    cfg = EngineConfig(max_num_seqs=num_slots, num_slots=num_slots, max_num_batched_tokens=16,
                       num_speculative_tokens=1, enable_prefix_caching=True, block_size=4, page_size=4,
                       pipeline_delay=3, debug=True)
    return Engine(runner, cfg, draft_hook=hook, row_order=row_order)


def _run_incident(finish_a_by: str, row_order=None, num_slots=2, bug=False, runner=RUNNER):
    prompt_c = PROMPT_A + _solo(PROMPT_A)[:2] + [13]  # shares the 8-token prefix A's boundary snapshot covers
    hook, solos = _oracle_drafts({"A": PROMPT_A, "B": PROMPT_B, "C": prompt_c})
    eng = _engine(hook, num_slots, row_order, runner)
    eng._bug_row_addressed_commit = bug
    a = eng.add_request("A", PROMPT_A, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
                        if finish_a_by == "max_tokens" else GREEDY)
    b = eng.add_request("B", PROMPT_B, GREEDY)
    t = a_slot = None
    c = None
    c_slots = set()
    for _ in range(400):
        eng.step()
        check_engine_against_fold(eng, CFG)
        last = eng.pending[-1][0] if eng.pending and eng.pending[-1] is not None else None
        if t is None and last is not None:
            rows = {r.request_id: r for r in last.rows}
            ra = rows.get("A")
            if ra is not None and ra.capture is not None and ra.num_drafts == 1 and "B" in rows:
                assert ra.capture.length == 8 and ra.capture.offset == 1
                t, a_slot = eng.step_id - 1, ra.slot
                continue
        if t is not None and c is None:
            # step t+1: A finishes (abort variant) and C arrives while step t's work is still deferred
            if finish_a_by == "abort":
                eng.abort("A")
            c = eng.add_request("C", prompt_c, GREEDY)
        if c is not None and eng.step_id <= t + 3:
            assert c.slot is None or c.slot.slot != a_slot.slot, "C got A's slot before step t's ticket retired"
        if c is not None and c.slot is not None:
            c_slots.add(c.slot)
        if not eng.has_unfinished():
            break
    assert t is not None, "scenario did not occur"
    eng.c_slots = c_slots
    return eng, a, b, c, a_slot, solos


@RUNNERS
@pytest.mark.parametrize("finish_a_by", ["max_tokens", "abort"])
def test_incident_pp3_mtp1_block4_slot_reuse(finish_a_by, runner):
    eng, a, b, c, a_slot, solos = _run_incident(finish_a_by, runner=runner)
    assert b.output == solos["B"][: len(b.output)] and b.finish_reason == "length"
    assert c.output == solos["C"] and c.finish_reason == "length"
    assert eng.requests["C"].metrics["num_steps"] > 0
    if finish_a_by == "max_tokens":
        assert a.output == solos["A"][:3] and a.finish_reason == "length"
        assert c.metrics["num_cached_tokens"] == 8, "C must hit the snapshot A's deferred work published"
    else:
        assert a.finish_reason == "abort"
    (c_slot,) = eng.c_slots
    assert c_slot.slot == a_slot.slot and c_slot.gen > a_slot.gen, "C reuses A's slot, with a new generation"
    assert eng.counters["accepted"] > 0


@RUNNERS
def test_incident_row_swap_variant(runner):
    swap = lambda step, ids: list(range(len(ids)))[::-1]  # noqa: E731  rows [A, B] -> [B, A] every step
    eng, a, b, c, a_slot, solos = _run_incident("max_tokens", row_order=swap, runner=runner)
    assert b.output == solos["B"] and c.output == solos["C"]
    assert c.metrics["num_cached_tokens"] == 8


@RUNNERS
def test_row_addressed_commit_is_caught(runner):
    """Mutation check: commit through the row of the latest batch (the incident's bug) -> the oracles fire."""
    swap = lambda step, ids: list(range(len(ids)))[::-1]  # noqa: E731
    with pytest.raises((AssertionError, FloatingPointError, StaleWrite, RuntimeError)):
        _run_incident("max_tokens", row_order=swap, num_slots=3, bug=True, runner=runner)


def test_stale_ticket_write_is_refused_after_slot_reuse():
    """The forced interleaving: A's (slot, gen) ticket applied after the slot went to C is a no-op / error."""
    hook, solos = _oracle_drafts({"A": PROMPT_A, "C": PROMPT_B})
    eng = _engine(hook, num_slots=1)
    eng.add_request("A", PROMPT_A, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    stale = SlotRef(0, 1)
    c = eng.add_request("C", PROMPT_B, GREEDY)
    for _ in range(8):
        eng.step()
    assert c.slot.slot == 0 and c.slot.gen == 3
    with pytest.raises(StaleWrite):
        eng.ledger.set_cursor(stale, 0)
    eng.ledger.debug = False  # production mode: the device drops the write on the generation mismatch
    eng.ledger.set_cursor(stale, 1)
    eng.ledger._ops.append(("capture", (0, 1, 1, 0)))
    eng.ledger._ops.append(("poison_slot", (0, 1)))
    eng.ledger.flush()
    check_engine_against_fold(eng, CFG)
    while eng.has_unfinished():
        eng.step()
    assert c.output == solos["C"]
