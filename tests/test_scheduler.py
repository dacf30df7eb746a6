"""Continuous batching policy, checked on plans alone (no model): budgets, FCFS, chunking, preemption, limits."""

import jax.numpy as jnp
import pytest

from flashnext_jax.sampling import SamplingParams
from flashnext_jax.scheduler import Request, Scheduler, SchedulerConfig, Status
from flashnext_jax.state_store import Leaf, StoreDims, StoreLedger, StoreSpec

SPEC = StoreSpec(slot={"s": Leaf((1,), jnp.int32)}, page={"kv": Leaf((), jnp.int32)})


def make(max_num_seqs=2, budget=8, max_len=32, k=0, prefix=False, block=4, page=4, pages=None, slots=None):
    pages = pages or 4 * -(-max_len // page)
    led = StoreLedger(SPEC, StoreDims(slots or max_num_seqs, pages, page, 4, k + 1))
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_len, k, prefix, block), led)


_N = [0]


def req(n, arrival=None):
    _N[0] += 1
    return Request(f"r{_N[0]}", list(range(1, n + 1)), SamplingParams(temperature=0.0), arrival or _N[0])


def commit(s, plans, sampled=7, accepted_drafts=0):
    """What the engine's commit does to scheduling state (tokens, num_computed, drafts)."""
    for p in plans:
        r = p.request
        if p.samples:
            m = min(accepted_drafts, p.num_drafts)
            r.output += list(p.tokens[1 + (len(p.tokens) - 1 - p.num_drafts):][:m]) + [sampled]
            r.num_computed = p.start + len(p.tokens) - p.num_drafts + m
        else:
            r.num_computed = p.start + len(p.tokens)


def test_budget_and_max_num_seqs_and_fcfs():
    s = make(max_num_seqs=2, budget=8)
    a, b, c = req(5), req(6), req(3)
    for r in (a, b, c):
        s.add(r)
    plans = s.schedule()
    assert [p.request for p in plans] == [a, b]  # FCFS; c waits for max_num_seqs
    assert sum(len(p.tokens) for p in plans) <= 8
    assert len(plans[1].tokens) == 3 and not plans[1].samples  # b's prefill is chunked by the budget


def test_chunked_prefill_shares_a_step_with_decodes():
    s = make(max_num_seqs=2, budget=6)
    a = req(3)
    s.add(a)
    commit(s, s.schedule())
    b = req(20)
    s.add(b)
    plans = s.schedule()
    kinds = {p.request.request_id: (len(p.tokens), p.samples) for p in plans}
    assert kinds[a.request_id] == (1, True) and kinds[b.request_id] == (5, False)


def test_in_flight_requests_are_not_rescheduled():
    s = make()
    a = req(3)
    s.add(a)
    s.schedule()
    a.inflight = True
    assert s.schedule() == []


def test_preemption_by_recompute_when_pages_run_out():
    s = make(max_num_seqs=2, budget=64, max_len=16, page=4, pages=5)
    a, b = req(8), req(7)
    s.add(a)
    s.add(b)
    commit(s, s.schedule())  # a: 2 pages, b: 2 pages (positions 0..7 / 0..6)
    commit(s, s.schedule())  # decode: a at 8 needs a 3rd page (the last free one); b still fits
    plans = s.schedule()  # b at position 8 needs another page: none left -> the latest arrival (b) is preempted
    assert b.status is Status.WAITING and b.metrics["num_preemptions"] == 1 and b.slot is None and not b.pages
    assert [p.request for p in plans] == [a]
    assert b.num_computed == 0 and s.waiting[0] is b  # recompute prompt + output later, first in line


def test_prefill_chunks_end_on_the_snapshot_grid():
    s = make(budget=16, prefix=True, block=4)
    a = req(11)
    s.add(a)
    (p,) = s.schedule()
    assert p.start + len(p.tokens) == 8 and p.capture is not None and p.capture.length == 8
    commit(s, [p])
    (p,) = s.schedule()
    assert (p.start, len(p.tokens), p.samples, p.capture) == (8, 3, True, None)


def test_decode_boundary_capture_with_drafts():
    s = make(budget=16, prefix=True, block=4, k=1)
    a = req(6)
    s.add(a)
    commit(s, s.schedule())  # prefill 0..3 (grid), then 4..5
    commit(s, s.schedule())
    a.drafts = [9]
    (p,) = s.schedule()
    assert p.tokens == (7, 9) and p.num_drafts == 1 and p.capture.offset == 1 and p.capture.length == 8


def test_max_model_len_and_empty_prompt_rejected():
    s = make(max_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add(req(8))
    with pytest.raises(ValueError, match="empty"):
        s.add(Request("e", [], SamplingParams(), 0))


def test_drafts_trimmed_at_max_model_len():
    s = make(max_len=8, k=1, budget=16)
    a = req(6)
    s.add(a)
    commit(s, s.schedule())
    a.drafts = [3]
    (p,) = s.schedule()  # last token at position 6; a draft at 7 could yield a 9th token
    assert p.num_drafts == 0 and p.tokens == (7,)


def test_abort_of_in_flight_request_keeps_resources_until_retired():
    s = make()
    a = req(3)
    s.add(a)
    s.schedule()
    a.inflight = True
    s.finish(a, "abort")
    assert a.slot is not None and a.finished
    a.inflight = False
    s.retire(a)
    assert a.slot is None and s.ledger.num_free_slots() == 2


def test_drafts_are_never_trimmed_to_fit_the_budget():
    """The number of drafts verified must not depend on other requests (sampled isolation)."""
    s = make(max_num_seqs=2, budget=3, k=1)
    a, b = req(1), req(1)
    s.add(a)
    s.add(b)
    commit(s, s.schedule())
    a.drafts, b.drafts = [5], [6]
    plans = s.schedule()
    assert [(p.request, p.num_drafts) for p in plans] == [(a, 1)]  # b waits rather than losing its draft


def test_drafts_survive_preemption_and_are_verified_after_recompute():
    s = make(max_num_seqs=1, budget=64, k=1)
    a = req(5)
    s.add(a)
    commit(s, s.schedule())
    a.drafts = [9]
    s.preempt(a)
    (p,) = s.schedule()  # recompute stops one short: the last token goes with its draft
    assert p.tokens == tuple(a.tokens[:-1]) and not p.samples
    commit(s, [p])
    (p,) = s.schedule()
    assert p.tokens == (a.tokens[-1], 9) and p.num_drafts == 1


def test_request_token_views_equal_slices_of_the_token_list():
    """num_tokens / last_token / token_slice (the per-step paths: no copy of the whole context) agree with the
    list `tokens` builds, across the prompt/output boundary."""
    r = Request("views", [5, 6, 7], SamplingParams(), 0)
    assert (r.num_tokens, r.last_token) == (3, 7)
    r.output.extend([8, 9])
    assert (r.num_tokens, r.last_token) == (5, 9)
    for start in range(6):
        for stop in range(start, 6):
            assert r.token_slice(start, stop) == r.tokens[start:stop], (start, stop)
