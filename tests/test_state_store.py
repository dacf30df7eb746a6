"""The slot-indexed store and its ledger: generations, poisoning, ownership, snapshots (refcount, LRU, COW)."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashnext_jax.state_store import (INT_POISON, Leaf, SlotRef, StaleWrite, StoreDims, StoreLedger, StoreSpec,
                                       live_rows, read_slots, write_pages, write_slots)

SPEC = StoreSpec(slot={"rec": Leaf((2,), jnp.int32, 0), "f": Leaf((3,), jnp.float32, 1.0)},
                 page={"kv": Leaf((), jnp.int32)})


def ledger(slots=2, pages=8, page_size=2, snaps=2, cols=2, debug=True):
    return StoreLedger(SPEC, StoreDims(slots, pages, page_size, snaps, cols), debug=debug)


def slot_np(led, name, s):
    led.flush()
    return np.asarray(led.store.slot[name][s])


def test_everything_starts_poisoned():
    led = ledger()
    assert np.all(np.asarray(led.store.slot["rec"]) == INT_POISON)
    assert np.all(np.isnan(np.asarray(led.store.slot["f"])))
    assert np.all(np.asarray(led.store.page["kv"]) == INT_POISON)


def test_allocate_resets_and_release_poisons_and_bumps_generation():
    led = ledger()
    ref = led.allocate_slot("A")
    assert np.all(slot_np(led, "rec", ref.slot) == 0) and np.all(slot_np(led, "f", ref.slot) == 1.0)
    led.release_slot(ref)
    assert np.all(slot_np(led, "rec", ref.slot) == INT_POISON)
    assert int(led.store.gen[ref.slot]) == ref.gen + 1
    with pytest.raises(StaleWrite):
        led.set_cursor(ref, 1)


def test_release_refused_while_a_ticket_is_in_flight():
    led = ledger()
    ref = led.allocate_slot("A")
    led.begin_inflight(ref)
    with pytest.raises(RuntimeError, match="uncommitted"):
        led.release_slot(ref)
    led.end_inflight(ref)
    led.release_slot(ref)


def test_stale_generation_write_is_a_device_noop():
    led = ledger(slots=1, debug=False)
    old = led.allocate_slot("A")
    led.release_slot(old)
    new = led.allocate_slot("C")
    assert new.slot == old.slot and new.gen == old.gen + 2
    led.set_cursor(old, 1)  # ledger (non-debug) lets it through; the device must drop it
    led._ops.append(("poison_slot", (old.slot, old.gen)))
    led.flush()
    assert int(led.store.cursor[new.slot]) == 0 and np.all(slot_np(led, "rec", new.slot) == 0)


def test_in_step_helpers_only_touch_live_slots():
    led = ledger(slots=2)
    a = led.allocate_slot("A")
    led.flush()
    st = led.store
    slot = jnp.array([a.slot, -1, 1, a.slot])
    gen = jnp.array([a.gen, 1, 1, a.gen + 2])  # row 2: unallocated slot 1; row 3: stale generation
    live = live_rows(st, slot, gen)
    assert list(np.asarray(live)) == [True, False, False, False]
    vals = read_slots(st, slot, live)
    assert np.all(np.asarray(vals["rec"][1:]) == INT_POISON)  # non-live rows read the poisoned null slot
    cols = {"rec": jnp.full((4, 2, 2), 7, jnp.int32), "f": jnp.full((4, 2, 3), 2.0)}
    st = write_slots(st, slot, live, cols)
    assert np.all(np.asarray(st.slot["rec"][a.slot]) == 7)
    assert np.all(np.asarray(st.slot["rec"][1]) == INT_POISON) and np.all(np.asarray(st.slot["rec"][-1]) == INT_POISON)
    pt = jnp.array([[0, 1], [2, 3]])
    st = write_pages(st, "kv", pt, jnp.array([[0, 3], [0, 1]]), jnp.array([[True, True], [False, False]]),
                     jnp.array([[5, 6], [8, 8]]))
    kv = np.asarray(st.page["kv"])
    assert kv[0, 0] == 5 and kv[1, 1] == 6 and np.all(kv[2:] == INT_POISON)


def test_pages_refcount_share_and_exclusive_writes():
    led = ledger()
    p = led.allocate_pages(2, "A")
    led.check_page_writable(p[0], "A")
    with pytest.raises(StaleWrite):
        led.check_page_writable(p[0], "B")
    led.share_page(p[0])
    with pytest.raises(StaleWrite):
        led.check_page_writable(p[0], "A")  # shared pages are read-only
    led.release_pages(p)
    assert led.page_refs[p[0]] == 1 and led.page_refs[p[1]] == 0
    led.release_pages([p[0]])
    assert led.num_free_pages() == 8


def test_snapshot_publish_lookup_cow_and_lru():
    led = ledger(slots=2, pages=8, page_size=2, snaps=2)
    a = led.allocate_slot("A")
    pages = led.allocate_pages(3, "A")
    assert led.lookup([1, 2, 3, 4, 5, 6], 3) is None
    e = led.publish(a, 0, [1, 2, 3], pages, "A")  # 3 tokens: one full page shared, the partial one copied
    assert e is not None and e.pages[0] == pages[0] and e.pages[1] not in pages
    assert led.lookup([1, 2, 3, 4], 3) is e
    assert led.lookup([1, 2, 3], 3) is None  # must leave at least one token to compute
    assert led.lookup([1, 2, 9, 4], 3) is None
    assert led.publish(a, 0, [1, 2, 3], pages, "A") is None  # already published
    led.publish(a, 0, [7, 7, 7], pages, "A")
    led.acquire(e)
    led.publish(a, 0, [8, 8, 8], pages, "A")  # pool of 2: evicts the LRU unreferenced entry ([7,7,7])
    assert led.lookup([1, 2, 3, 0], 3) is e and led.lookup([7, 7, 7, 0], 3) is None
    led.release(e)


def test_snapshot_is_immutable_after_owner_writes():
    led = ledger(slots=1, pages=8, page_size=2, snaps=2, cols=1)
    a = led.allocate_slot("A")
    pages = led.allocate_pages(2, "A")
    led.flush()
    st = led.store
    st = write_slots(st, jnp.array([a.slot]), jnp.array([True]), {"rec": jnp.full((1, 1, 2), 3, jnp.int32),
                                                                   "f": jnp.zeros((1, 1, 3))})
    st = write_pages(st, "kv", jnp.array(pages)[None], jnp.arange(3)[None], jnp.ones((1, 3), bool),
                     jnp.array([[1, 2, 3]]))
    led.store = st
    e = led.publish(a, 0, [5, 6, 7], pages, "A")
    led.flush()
    st = write_slots(led.store, jnp.array([a.slot]), jnp.array([True]),
                     {"rec": jnp.full((1, 1, 2), 9, jnp.int32), "f": jnp.zeros((1, 1, 3))})
    st = write_pages(st, "kv", jnp.array(pages)[None], jnp.array([[3]]), jnp.ones((1, 1), bool), jnp.array([[42]]))
    kv = np.asarray(st.page["kv"])
    assert list(np.asarray(st.snap["rec"][e.snap_id])) == [3, 3]
    assert kv[e.pages[1], 0] == 3 and kv[pages[1], 1] == 42  # the partial page was copied, not shared


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "pages", "freepages", "share"]), st.integers(0, 7)),
                max_size=40))
def test_ledger_ownership_is_disjoint(ops):
    led = ledger(slots=3, pages=6)
    live: dict[str, SlotRef] = {}
    owned: dict[str, list[int]] = {}
    n = 0
    for op, i in ops:
        if op == "alloc" and led.num_free_slots():
            live[f"r{n}"] = led.allocate_slot(f"r{n}")
            owned[f"r{n}"] = []
            n += 1
        elif op == "free" and live:
            rid = sorted(live)[i % len(live)]
            led.release_slot(live.pop(rid))
            led.release_pages(owned.pop(rid))
        elif op == "pages" and live and led.can_allocate_pages(1):
            rid = sorted(live)[i % len(live)]
            owned[rid] += led.allocate_pages(1, rid)
        elif op == "share" and live:
            rid = sorted(live)[i % len(live)]
            if owned[rid]:
                other = [r for r in live if r != rid]
                if other:
                    led.share_page(owned[rid][0])
                    owned[other[0]].append(owned[rid][0])
    slots = [r.slot for r in live.values()]
    assert len(set(slots)) == len(slots)
    for rid, ps in owned.items():
        for p in ps:
            if led.page_owner[p] is not None:  # a writable page has exactly one holder: its writer
                assert led.page_owner[p] == rid and led.page_refs[p] == 1
                assert sum(p in q for q in owned.values()) == 1
    assert led.num_free_pages() + len({p for ps in owned.values() for p in ps}) == 6


def test_cursor_moves_only_when_the_column_changes():
    """set_cursor queues a device op only when the column differs from the cursor's (a plain decode step commits
    the column its slot already has): the device cursor still follows every move, a reset puts it back at 0."""
    led = ledger(slots=1)
    a = led.allocate_slot("A")
    led.flush()
    led.set_cursor(a, 0)
    assert led._ops == []
    led.set_cursor(a, 1)
    led.set_cursor(a, 1)
    assert [op[0] for op in led._ops] == ["cursor"]
    led.flush()
    assert int(led.store.cursor[a.slot]) == 1
    led.set_cursor(a, 0)
    led.flush()
    assert int(led.store.cursor[a.slot]) == 0
    led.set_cursor(a, 1)
    led.release_slot(a)
    b = led.allocate_slot("B")  # the same slot again: reset to column 0, host and device
    assert b.slot == a.slot
    led.flush()
    assert int(led.store.cursor[b.slot]) == 0
    led.set_cursor(b, 1)
    led.flush()
    assert int(led.store.cursor[b.slot]) == 1
