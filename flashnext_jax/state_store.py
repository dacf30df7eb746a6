"""Slot-indexed per-request state: an immutable device pytree plus the host ledger that owns its indices.

Why (docs/engine-design.md, ../shared/docs/state-store.md): the incident happened because persistent state was
addressed by the *batch row* of a stale batch. Here the only index into persistent state is a slot id (or a page
id / snapshot id), every slot carries a generation, and every write names the (slot, generation) it was scheduled
with; a mismatch is a no-op on device and an error in the host ledger.

Layout (`StateStore`, a registered dataclass pytree; leading axis = slot/page/snapshot; the last index of each
pool is the poisoned null entry that padding rows read):
  slot[name]  [num_slots + 1, K1, *shape]   per-slot state with K1 = k + 1 checkpoint columns (MTP rollback)
  cursor      [num_slots + 1] int32          which column holds the committed state
  gen         [num_slots + 1] int32          generation; bumped when a slot is released (and poisoned)
  page[name]  [num_pages + 1, page_size, *shape]   per-token entries (KV, index keys, MTP KV) in pages
                                             (page_size / tokens_per_row rows: one per indexer block)
  snap[name]  [num_snaps + 1, *shape]        immutable prefix snapshots of every slot leaf (one column)

All device ops are pure functions `store -> store`, jitted with the store donated, with indices padded to a
power-of-two bucket using an out-of-range index that `mode="drop"` discards.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

INT_POISON = -(2**31) + 7  # sentinel for integer leaves: every legitimate value is >= 0


# --------------------------------------------------------------------------------------------------- spec + store


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One state tensor: per-slot (or per-token for pages) shape, dtype, initial value and poison value. A page leaf
    may hold one entry per `tokens_per_row` tokens (the QSA indexer's block keys: one per block of 4 tokens), so
    its pages have page_size / tokens_per_row rows, and may live in pinned host memory (`memory_kind`; the
    offloaded QSA K/V, qsa_offload.py: steps read it through a gather computed on the host and write single pages
    back; store ops move single pages)."""

    shape: tuple[int, ...]
    dtype: Any
    init: float | int = 0
    tokens_per_row: int = 1
    memory_kind: str = "device"

    @property
    def poison(self):
        return float("nan") if jnp.issubdtype(self.dtype, jnp.floating) else INT_POISON


@dataclasses.dataclass(frozen=True)
class StoreSpec:
    """What a model needs per request: slot leaves (with checkpoint columns) and per-token page leaves."""

    slot: dict[str, Leaf]
    page: dict[str, Leaf]


@dataclasses.dataclass(frozen=True)
class StoreDims:
    num_slots: int
    num_pages: int
    page_size: int
    num_snaps: int
    num_columns: int  # K1 = num_speculative_tokens + 1

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"StoreDims.{f.name} must be >= 1, got {getattr(self, f.name)}")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["slot", "cursor", "gen", "page", "snap"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class StateStore:
    slot: dict[str, jax.Array]
    cursor: jax.Array
    gen: jax.Array
    page: dict[str, jax.Array]
    snap: dict[str, jax.Array]

    @property
    def num_slots(self) -> int:
        return self.cursor.shape[0] - 1

    @property
    def num_pages(self) -> int:
        return next(iter(self.page.values())).shape[0] - 1 if self.page else 0

    @property
    def num_snaps(self) -> int:
        return next(iter(self.snap.values())).shape[0] - 1 if self.snap else 0


def init_store(spec: StoreSpec, dims: StoreDims) -> StateStore:
    """Every slot, page and snapshot starts poisoned: nothing is readable before it was written for its owner."""
    slot = {n: jnp.full((dims.num_slots + 1, dims.num_columns, *l.shape), l.poison, l.dtype)
            for n, l in spec.slot.items()}
    for n, l in spec.page.items():
        if dims.page_size % l.tokens_per_row:
            raise ValueError(f"page leaf {n!r} holds one entry per {l.tokens_per_row} tokens: the page size must be "
                             f"a multiple of {l.tokens_per_row}, got {dims.page_size}")
    page = {n: jnp.full((dims.num_pages + 1, dims.page_size // l.tokens_per_row, *l.shape), l.poison, l.dtype)
            for n, l in spec.page.items()}
    page = {n: jax.device_put(a, jax.memory.Space.Host) if spec.page[n].memory_kind != "device" else a
            for n, a in page.items()}
    snap = {n: jnp.full((dims.num_snaps + 1, *l.shape), l.poison, l.dtype) for n, l in spec.slot.items()}
    return StateStore(slot=slot, cursor=jnp.zeros((dims.num_slots + 1,), jnp.int32),
                      gen=jnp.zeros((dims.num_slots + 1,), jnp.int32), page=page, snap=snap)


def store_shardings(spec: StoreSpec, sharding: jax.sharding.Sharding) -> StateStore:
    """Where each leaf of a store of `spec` lives: `sharding`, in its memory kind for the page leaves that name
    one other than the device's."""
    page = {n: sharding if l.memory_kind == "device" else sharding.with_memory_kind(l.memory_kind)
            for n, l in spec.page.items()}
    return StateStore(slot={n: sharding for n in spec.slot}, cursor=sharding, gen=sharding, page=page,
                      snap={n: sharding for n in spec.slot})


def store_types(spec: StoreSpec, dims: StoreDims, sharding: jax.sharding.Sharding) -> StateStore:
    """The types of init_store(spec, dims) placed as `store_shardings` places it, and no buffers: a pipeline stage
    on another process's devices (multihost.py), whose store that process holds."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        jax.eval_shape(functools.partial(init_store, spec, dims)), store_shardings(spec, sharding))


# ------------------------------------------------------------------------- in-step helpers (used by model steps)


def live_rows(store: StateStore, slot: jax.Array, gen: jax.Array) -> jax.Array:
    """[B] bool: the row names a real slot whose generation matches the one it was scheduled with."""
    s = store.num_slots
    safe = jnp.clip(slot, 0, s)
    return (slot >= 0) & (slot < s) & (store.gen[safe] == gen) & (gen % 2 == 1)  # odd generation = allocated


def read_slots(store: StateStore, slot: jax.Array, live: jax.Array, skip: tuple[str, ...] = ()) -> dict[str, jax.Array]:
    """Committed state of each row's slot ([B, *shape] per leaf, except the names in `skip`, which a kernel reads
    from the store itself); non-live rows read the poisoned null slot."""
    idx = jnp.where(live, slot, store.num_slots)
    col = store.cursor[idx]
    return {n: a[idx, col] for n, a in store.slot.items() if n not in skip}


def write_slots(store: StateStore, slot: jax.Array, live: jax.Array, columns: dict[str, jax.Array],
                written_in_place: tuple[str, ...] = ()) -> StateStore:
    """Scatter [B, K1, *shape] checkpoint columns back to the rows' slots; non-live rows are dropped.

    Every slot leaf is written each step: either from `columns` or, for the names in `written_in_place`, by a
    kernel that already updated the leaf by slot id under the same liveness rule (gdn.StoreRecState), or not by
    steps at all: a request's fixed values that the ledger wrote at allocation (StoreLedger.set_slot_values)."""
    missing = set(store.slot) - set(columns) - set(written_in_place)
    if missing:
        raise ValueError(f"a step must write every slot leaf; missing {sorted(missing)}")
    idx = jnp.where(live, slot, store.num_slots + 1)  # out of range -> dropped
    new = {n: (store.slot[n].at[idx].set(columns[n].astype(store.slot[n].dtype), mode="drop") if n in columns
               else store.slot[n]) for n in store.slot}
    return dataclasses.replace(store, slot=new)


def token_page_index(page_table: jax.Array, positions: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """(page id, offset) of absolute positions [B, T] through per-row page tables [B, MP]; -1 where unmapped."""
    mp = page_table.shape[1]
    blk = positions // page_size
    pid = jnp.take_along_axis(page_table, jnp.clip(blk, 0, mp - 1), axis=1)
    pid = jnp.where((blk >= 0) & (blk < mp), pid, -1)
    return pid, positions % page_size


def read_pages(store: StateStore, name: str, page_table: jax.Array) -> jax.Array:
    """[B, MP * page_size, *shape] entries of each row's pages (unmapped pages read the poisoned null page)."""
    pt = jnp.where(page_table >= 0, page_table, store.num_pages)
    a = store.page[name][pt]  # [B, MP, page, ...]
    return a.reshape(a.shape[0], -1, *a.shape[3:])


def write_pages(store: StateStore, name: str, page_table: jax.Array, positions: jax.Array, valid: jax.Array,
                values: jax.Array) -> StateStore:
    """Write per-token entries [B, T, *shape] at absolute positions [B, T] where `valid` (live rows, real tokens)."""
    pid, off = token_page_index(page_table, positions, store.page[name].shape[1])
    pid = jnp.where(valid & (pid >= 0), pid, store.num_pages + 1)
    new = dict(store.page)
    new[name] = store.page[name].at[pid, off].set(values.astype(new[name].dtype), mode="drop")
    return dataclasses.replace(store, page=new)


# ------------------------------------------------------------------------------ store ops (jitted, store donated)


POOL_SIGNIFICANT_BITS = 6  # page pools are rounded to counts of at most this many significant bits


def round_pages_down(n: int) -> int:
    """The largest count <= n with at most POOL_SIGNIFICANT_BITS significant bits."""
    drop = max(0, n.bit_length() - POOL_SIGNIFICANT_BITS)
    return (n >> drop) << drop


def round_pages_up(n: int) -> int:
    """The smallest count >= n with at most POOL_SIGNIFICANT_BITS significant bits (powers of two stay): the
    page pool's capacity. Not the next power of two, so a pool sized from device memory (page_pool.py, rounded
    down the same way) is allocated as sized, while pools of nearby sizes still share compiled steps."""
    n = max(n, 1)
    drop = max(0, n.bit_length() - POOL_SIGNIFICANT_BITS)
    return -(-n >> drop) << drop


MIN_OP_ROWS = 8  # a store-op call's rows are padded to a power of two from this
MAX_OP_ROWS = 64  # rows per jitted store-op call: a flush of more (a long request's pages released) loops
OP_WIDTHS = {"reset": 3, "poison_slot": 2, "cursor": 3, "capture": 4, "copy_page": 2, "poison_page": 1,
             "poison_snap": 1}  # the integers of one queued op of each kind (StoreLedger's _ops rows)


def _bucket(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def _pad(rows: Sequence[Sequence[int]], width: int, fill: int = -1) -> np.ndarray:
    out = np.full((max(MIN_OP_ROWS, _bucket(len(rows))), width), fill, np.int32)
    for i, r in enumerate(rows):
        out[i] = r
    return out


def _oob(idx, cond, bound):
    return jnp.where(cond & (idx >= 0), idx, bound)


def _gen_ok(store, slot, gen):
    return live_rows(store, slot, gen)


@functools.partial(jax.jit, donate_argnums=(0,))
def _op_capture(store: StateStore, a):  # a: [N, 4] (slot, gen, col, snap)
    slot, gen, col, dst = a[:, 0], a[:, 1], a[:, 2], a[:, 3]
    ok = _gen_ok(store, slot, gen) & (dst >= 0) & (dst < store.num_snaps)
    src = jnp.clip(slot, 0, store.num_slots)
    d = _oob(dst, ok, store.num_snaps + 1)
    c = jnp.clip(col, 0, next(iter(store.slot.values())).shape[1] - 1)
    snap = {n: store.snap[n].at[d].set(store.slot[n][src, c], mode="drop") for n in store.snap}
    return dataclasses.replace(store, snap=snap)


@functools.partial(jax.jit, donate_argnums=(0,))
def _op_cursor(store: StateStore, a):  # (slot, gen, col)
    slot, gen, col = a[:, 0], a[:, 1], a[:, 2]
    ok = _gen_ok(store, slot, gen)
    return dataclasses.replace(store, cursor=store.cursor.at[_oob(slot, ok, store.num_slots + 1)].set(col, mode="drop"))


@functools.partial(jax.jit, donate_argnums=(0,), static_argnums=(2,))
def _op_reset(store: StateStore, a, inits):  # (slot, new odd gen, snap or -1): allocation (host-authoritative)
    slot, gen, src = a[:, 0], a[:, 1], a[:, 2]
    ok = (slot >= 0) & (slot < store.num_slots)
    d = _oob(slot, ok, store.num_slots + 1)
    from_snap = src >= 0
    s = jnp.clip(src, 0, store.num_snaps)
    new = {}
    for n, arr in store.slot.items():
        init = jnp.full(arr.shape[2:], dict(inits)[n], arr.dtype)
        val = jnp.where(from_snap.reshape((-1,) + (1,) * (arr.ndim - 2)), store.snap[n][s], init[None])
        val = jnp.broadcast_to(val[:, None], (val.shape[0], arr.shape[1], *arr.shape[2:]))
        new[n] = arr.at[d].set(val, mode="drop")
    return dataclasses.replace(store, slot=new, cursor=store.cursor.at[d].set(0, mode="drop"),
                               gen=store.gen.at[d].set(gen, mode="drop"))


@functools.partial(jax.jit, donate_argnums=(0,), static_argnums=(2,))
def _op_set_slot(store: StateStore, a, name: str):  # (slot, gen, *values): every column of one integer leaf
    slot, gen = a[:, 0], a[:, 1]
    if name not in store.slot:  # a pipeline stage without that leaf
        return store
    arr = store.slot[name]
    d = _oob(slot, _gen_ok(store, slot, gen), store.num_slots + 1)
    val = a[:, 2:].reshape(a.shape[0], 1, *arr.shape[2:]).astype(arr.dtype)
    new = arr.at[d].set(jnp.broadcast_to(val, (a.shape[0], *arr.shape[1:])), mode="drop")
    return dataclasses.replace(store, slot={**store.slot, name: new})


@functools.partial(jax.jit, donate_argnums=(0,))
def _op_poison_slots(store: StateStore, a):  # (slot, gen): poison and bump the generation
    slot, gen = a[:, 0], a[:, 1]
    ok = _gen_ok(store, slot, gen)
    d = _oob(slot, ok, store.num_slots + 1)
    new = {n: arr.at[d].set(jnp.full(arr.shape[1:], _poison_of(arr.dtype), arr.dtype), mode="drop")
           for n, arr in store.slot.items()}
    return dataclasses.replace(store, slot=new, gen=store.gen.at[d].add(1, mode="drop"))


def _in_host_memory(arr) -> bool:
    return jax.typeof(arr).memory_space == jax.memory.Space.Host


def _set_host_pages(arr, dst, value):
    """Page dst[i] of a host-memory pool := value(i, pool so far) (a page, in host memory), in order, one
    dynamic_update_slice per page: XLA moves single slices between the memories, not gathers or scatters
    (qsa_offload.py), and reading the pool being written keeps it in place. Rows to skip name the null page
    (the pool's last) and must give it its own value."""
    at = lambda i: (dst[i],) + (0,) * (arr.ndim - 1)  # noqa: E731
    return jax.lax.fori_loop(0, dst.shape[0], lambda i, a: jax.lax.dynamic_update_slice(a, value(i, a), at(i)), arr)


@functools.partial(jax.jit, donate_argnums=(0,))
def _op_copy_pages(store: StateStore, a):  # (src page, dst page)
    src, dst = a[:, 0], a[:, 1]
    ok = (src >= 0) & (dst >= 0)
    d = _oob(dst, ok, store.num_pages + 1)
    s = jnp.clip(src, 0, store.num_pages)

    def copy(arr):
        if not _in_host_memory(arr):
            return arr.at[d].set(arr[s], mode="drop")
        null = store.num_pages  # skipped rows copy the null page onto itself
        hd, hs = jnp.where(ok, dst, null), jnp.where(ok, src, null)
        return _set_host_pages(arr, hd, lambda i, pool: jax.lax.dynamic_slice_in_dim(pool, hs[i], 1))
    return dataclasses.replace(store, page={n: copy(arr) for n, arr in store.page.items()})


@functools.partial(jax.jit, donate_argnums=(0,))
def _op_poison_pages(store: StateStore, a):  # (page,)
    d = _oob(a[:, 0], a[:, 0] >= 0, store.num_pages + 1)

    def poison(arr):
        page = jnp.full(arr.shape[1:], _poison_of(arr.dtype), arr.dtype)
        if not _in_host_memory(arr):
            return arr.at[d].set(page, mode="drop")
        host_page = jax.device_put(page[None], jax.memory.Space.Host)  # skipped rows poison the null page again
        return _set_host_pages(arr, jnp.minimum(d, store.num_pages), lambda i, pool: host_page)
    return dataclasses.replace(store, page={n: poison(arr) for n, arr in store.page.items()})


@functools.partial(jax.jit, donate_argnums=(0,))
def _op_poison_snaps(store: StateStore, a):  # (snap,)
    d = _oob(a[:, 0], a[:, 0] >= 0, store.num_snaps + 1)
    return dataclasses.replace(store, snap={
        n: arr.at[d].set(jnp.full(arr.shape[1:], _poison_of(arr.dtype), arr.dtype), mode="drop")
        for n, arr in store.snap.items()})


_OPS = {"capture": _op_capture, "cursor": _op_cursor, "poison_slot": _op_poison_slots, "copy_page": _op_copy_pages,
        "poison_page": _op_poison_pages, "poison_snap": _op_poison_snaps}  # the ops of one array argument


def _poison_of(dtype):
    return float("nan") if jnp.issubdtype(dtype, jnp.floating) else INT_POISON


# ------------------------------------------------------------------------------------------------ host ledger


class StaleWrite(RuntimeError):
    """A write named a (slot, generation) that no longer owns the slot: in the incident this corrupted state."""


class OutOfPages(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class SlotRef:
    """The only handle to a request's persistent state."""

    slot: int
    gen: int


@dataclasses.dataclass
class _SlotInfo:
    owner: Any = None
    gen: int = 0
    inflight: int = 0
    cursor: int = 0  # the column the device's cursor holds once the queued ops are applied (0 after a reset)


@dataclasses.dataclass
class SnapEntry:
    snap_id: int
    tokens: tuple[int, ...]  # the exact prefix (collision check)
    pages: tuple[int, ...]  # pages covering [0, len(tokens)), each holding one ref
    refs: int = 0  # readers restoring from it right now
    salt: bytes = b""  # content hashes of the images whose pads the prefix holds (request_images.py)


def prefix_key(tokens: Sequence[int], salt: bytes = b"") -> bytes:
    """The prefix cache's key: the token ids and, for a prefix holding image pads, the images' content hashes
    (`salt`; empty for text, so a text prefix's key is its tokens' alone)."""
    return hashlib.blake2b(np.asarray(tokens, np.int64).tobytes() + salt, digest_size=16).digest()


Salt = Callable[[int], bytes]  # prefix length -> its salt (Request.prefix_salt)


def _no_salt(length: int) -> bytes:
    return b""


class StoreLedger:
    """Host-side owner of every index into a `StateStore`; the only code that mutates it is here.

    Device ops are queued in order (`_ops`) and flushed, grouped by kind, before each step and after each commit,
    so within-commit ordering (capture before release, release before re-allocation) is program order.
    """

    def __init__(self, spec: StoreSpec | tuple[StoreSpec, ...], dims: StoreDims, debug: bool = True,
                 min_capacity: tuple = (1, 1, 1), shardings: tuple | None = None):
        """spec: one StoreSpec, or one per pipeline stage (with `shardings`, where each stage's store lives). With
        stages, `store` is the tuple of the stages' stores: one set of indices (this ledger's) addresses all of
        them, and every queued device op is applied to every stage's store in the same order (invariant 10)."""
        self.spec, self.dims, self.debug = spec, dims, debug
        self.staged = isinstance(spec, tuple)
        specs = spec if self.staged else (spec,)
        # device pools are rounded up to power-of-two capacities so that configurations differing only in pool
        # sizes share compiled steps; the ledger hands out only the first `dims` entries (the rest stay poisoned)
        pool = dataclasses.replace(
            dims, num_slots=_bucket(max(dims.num_slots, min_capacity[0])),
            num_pages=round_pages_up(max(dims.num_pages, min_capacity[1])),
            num_snaps=_bucket(max(dims.num_snaps, min_capacity[2])))
        if shardings is None:  # one store on the default device (this process's first)
            shardings = (jax.sharding.SingleDeviceSharding(jax.local_devices()[0]),)
        # built on its devices (a stage's own: never the whole model's state on one device first) and committed
        # there, as every store a step returns: a store op first run on an uncommitted store would compile again
        # for the step's output (tests/test_prefill_buckets.py, the warm-up)
        # a stage on another process's devices (multihost.py): only its store's types here, that process holds it
        self.held = tuple(sh.is_fully_addressable for sh in shardings)
        stores = tuple(jax.jit(functools.partial(init_store, sp, pool), out_shardings=store_shardings(sp, sh))()
                       if held else store_types(sp, pool, sh)
                       for sp, sh, held in zip(specs, shardings, self.held, strict=True))
        self.store = stores if self.staged else stores[0]
        self._inits = tuple(tuple((n, l.init) for n, l in sp.slot.items()) for sp in specs)
        self.slots = [_SlotInfo() for _ in range(dims.num_slots)]
        self.free_slots: collections.deque[int] = collections.deque(range(dims.num_slots))
        self.page_refs = [0] * dims.num_pages
        self.page_owner: list[Any] = [None] * dims.num_pages  # exclusive writer (a request) or None (read-only)
        self.free_pages: collections.deque[int] = collections.deque(range(dims.num_pages))
        self.snaps: collections.OrderedDict[bytes, SnapEntry] = collections.OrderedDict()  # LRU order
        self.free_snaps: collections.deque[int] = collections.deque(range(dims.num_snaps))
        self._ops: list[tuple[str, tuple]] = []
        self.stats = collections.Counter()
        self._applied = None  # digest of every op applied, once `track_ops` (processes compare it each step)

    def track_ops(self):
        """Keep a digest of every device op applied from now on (`op_digest`): with stages in several processes,
        each process's ledger must apply the same ops in the same order, and they compare this each step."""
        self._applied = hashlib.blake2b(digest_size=16)

    def op_digest(self) -> bytes:
        return b"" if self._applied is None else self._applied.digest()

    # ---- slots
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def allocate_slot(self, owner, snapshot: SnapEntry | None = None) -> SlotRef:
        """Take a free slot for `owner`, reset to the initial state or restored (copy) from a snapshot."""
        if not self.free_slots:
            raise RuntimeError("no free slot")
        s = self.free_slots.popleft()
        info = self.slots[s]
        assert info.owner is None and info.inflight == 0
        info.owner, info.gen, info.cursor = owner, info.gen + 1, 0  # gen odd while allocated, even while free
        ref = SlotRef(s, info.gen)
        self._ops.append(("reset", (s, info.gen, snapshot.snap_id if snapshot else -1)))
        return ref

    def check(self, ref: SlotRef, owner=None) -> bool:
        info = self.slots[ref.slot]
        ok = info.gen == ref.gen and info.owner is not None and (owner is None or info.owner == owner)
        if not ok and self.debug:
            raise StaleWrite(f"slot {ref.slot} gen {ref.gen} (owner {owner!r}) is now gen {info.gen} "
                             f"owned by {info.owner!r}")
        return ok

    def begin_inflight(self, ref: SlotRef):
        self.check(ref)
        self.slots[ref.slot].inflight += 1

    def end_inflight(self, ref: SlotRef):
        info = self.slots[ref.slot]
        assert info.gen == ref.gen and info.inflight > 0, (ref, info)
        info.inflight -= 1

    def release_slot(self, ref: SlotRef):
        """Poison the slot and bump its generation; refused while an uncommitted ticket references it."""
        self.check(ref)
        info = self.slots[ref.slot]
        if info.inflight:
            raise RuntimeError(f"slot {ref.slot} released with {info.inflight} uncommitted ticket(s)")
        self._ops.append(("poison_slot", (ref.slot, ref.gen)))
        info.owner, info.gen = None, info.gen + 1
        self.free_slots.append(ref.slot)

    def set_slot_values(self, ref: SlotRef, values: dict[str, np.ndarray]):
        """Write integer slot leaves of a freshly allocated slot (every checkpoint column) after its reset or
        restore: a request's fixed per-slot data that no step writes (the image spans, request_images.py)."""
        self.check(ref)
        for name, v in values.items():
            self._ops.append((f"set_slot:{name}", (ref.slot, ref.gen, *np.asarray(v, np.int64).ravel().tolist())))

    def set_cursor(self, ref: SlotRef, col: int):
        """Queue the cursor move, unless the cursor already holds `col` (a plain decode step commits column 0 of
        a slot already at 0: no device op, no dispatch, every step)."""
        info = self.slots[ref.slot]
        if self.check(ref) and info.cursor != col:
            self._ops.append(("cursor", (ref.slot, ref.gen, col)))
            info.cursor = col

    # ---- pages
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def allocate_pages(self, n: int, owner) -> list[int]:
        while len(self.free_pages) < n and self._evict_one():
            pass
        if len(self.free_pages) < n:
            raise OutOfPages(f"need {n} pages, {len(self.free_pages)} free")
        out = [self.free_pages.popleft() for _ in range(n)]
        for p in out:
            assert self.page_refs[p] == 0
            self.page_refs[p], self.page_owner[p] = 1, owner
        return out

    def can_allocate_pages(self, n: int) -> bool:
        evictable = [e for e in self.snaps.values() if e.refs == 0]
        if len(self.free_pages) >= n:
            return True
        # pages that would come free if every unreferenced snapshot were evicted
        gain = collections.Counter(p for e in evictable for p in e.pages)
        freeable = sum(1 for p, c in gain.items() if self.page_refs[p] == c)
        return len(self.free_pages) + freeable >= n

    def share_page(self, p: int):
        """Add a read-only reference (prefix sharing): the page loses its exclusive writer."""
        assert self.page_refs[p] > 0
        self.page_refs[p] += 1
        self.page_owner[p] = None

    def release_pages(self, pages: Iterable[int]):
        for p in pages:
            assert self.page_refs[p] > 0, p
            self.page_refs[p] -= 1
            if self.page_refs[p] == 0:
                self.page_owner[p] = None
                self._ops.append(("poison_page", (p,)))
                self.free_pages.append(p)

    def check_page_writable(self, p: int, owner):
        if not (0 <= p < self.dims.num_pages and self.page_refs[p] == 1 and self.page_owner[p] == owner):
            raise StaleWrite(f"page {p} is not exclusively owned by {owner!r} "
                             f"(refs {self.page_refs[p] if 0 <= p < self.dims.num_pages else '-'}, "
                             f"owner {self.page_owner[p] if 0 <= p < self.dims.num_pages else '-'})")

    def copy_page(self, src: int, dst: int):
        self._ops.append(("copy_page", (src, dst)))

    # ---- prefix snapshots
    def lookup(self, tokens: Sequence[int], block: int, salt: Salt = _no_salt,
               allowed: Callable[[int], bool] | None = None) -> SnapEntry | None:
        """Longest published snapshot at a multiple of `block` strictly shorter than `tokens` (with the images
        `salt(length)` names for a prefix of that length), of a length `allowed` accepts (default: any)."""
        for m in range((len(tokens) - 1) // block, 0, -1):
            if allowed is not None and not allowed(m * block):
                continue
            key = prefix_key(tokens[: m * block], salt(m * block))
            e = self.snaps.get(key)
            if e is not None and e.tokens == tuple(tokens[: m * block]) and e.salt == salt(m * block):
                self.snaps.move_to_end(key)
                self.stats["prefix_hits"] += 1
                return e
        return None

    def has_snapshot(self, tokens: Sequence[int], salt: bytes = b"") -> bool:
        return prefix_key(tokens, salt) in self.snaps

    def acquire(self, e: SnapEntry):
        e.refs += 1

    def release(self, e: SnapEntry):
        assert e.refs > 0
        e.refs -= 1

    def publish(self, ref: SlotRef, col: int, tokens: Sequence[int], pages: Sequence[int], owner,
                salt: bytes = b"") -> SnapEntry | None:
        """Capture the slot's column `col` (state after exactly len(tokens) tokens) as an immutable snapshot.

        Full pages are shared read-only; a partial last page is copied so the owner's later writes cannot reach it.
        Called only from a commit, so the snapshot becomes visible after its write and never to the same step.
        """
        key = prefix_key(tokens, salt)
        if key in self.snaps or not self.check(ref, owner):
            return None
        if not self.free_snaps and not self._evict_one():
            return None
        ps = self.dims.page_size
        n_full, rem = divmod(len(tokens), ps)
        if rem and not self.can_allocate_pages(1):
            return None
        snap_id = self.free_snaps.popleft()
        self._ops.append(("capture", (ref.slot, ref.gen, col, snap_id)))
        own = []
        for p in pages[:n_full]:
            self.share_page(p)
            own.append(p)
        if rem:
            (cp,) = self.allocate_pages(1, None)
            self.page_owner[cp] = None
            self.copy_page(pages[n_full], cp)
            own.append(cp)
        e = SnapEntry(snap_id, tuple(tokens), tuple(own), salt=salt)
        self.snaps[key] = e
        self.stats["snapshots_published"] += 1
        return e

    def _evict_one(self) -> bool:
        for key, e in self.snaps.items():  # LRU first
            if e.refs == 0:
                del self.snaps[key]
                self.release_pages(e.pages)
                self._ops.append(("poison_snap", (e.snap_id,)))
                self.free_snaps.append(e.snap_id)
                self.stats["snapshots_evicted"] += 1
                return True
        return False

    # ---- device
    def flush(self):
        """Apply queued device ops in program order (consecutive ops of one kind go in one jitted call per
        MAX_OP_ROWS of them, so the calls take a few row counts whatever a request's size: `warm_ops`)."""
        ops, self._ops = self._ops, []
        i = 0
        while i < len(ops):
            kind = ops[i][0]
            j = i
            while j < len(ops) and ops[j][0] == kind and j - i < MAX_OP_ROWS:
                j += 1
            rows = [o[1] for o in ops[i:j]]
            self._apply(kind, _pad(rows, len(rows[0])))
            i = j

    def warm_ops(self):
        """Run every op kind at every row count a flush uses, on rows that name nothing (slot, page or snapshot
        -1: dropped), so that each is compiled now and no request's flush compiles one (the first 32K request
        on the H200 compiled 2 store ops, 0.15 s of its TTFT: the release of the warm-up's pages among them).
        The integer-leaf writes (`set_slot:*`, image steps) are left to their first use."""
        n = MIN_OP_ROWS
        while n <= MAX_OP_ROWS:
            for kind, width in OP_WIDTHS.items():
                self._apply(kind, np.full((n, width), -1, np.int32))
            n *= 2

    def _apply(self, kind: str, a: np.ndarray):
        if self._applied is not None:
            self._applied.update(kind.encode() + a.tobytes())

        def one(st, inits):  # `a` goes to the jitted op as numpy: jit's own transfer, not an eager one first
            if kind == "reset":  # (half the dispatch time of a store op: an MTP step's cursor move 66 -> 32 us)
                return _op_reset(st, a, inits)
            if kind.startswith("set_slot:"):
                return _op_set_slot(st, a, kind.split(":", 1)[1])
            return _OPS[kind](st, a)
        stores = self.store if self.staged else (self.store,)
        stores = tuple(one(st, inits) if held else st for st, inits, held in zip(stores, self._inits, self.held))
        self.store = stores if self.staged else stores[0]

    def usage(self) -> dict:
        return {"slots_used": self.dims.num_slots - len(self.free_slots), "slots": self.dims.num_slots,
                "pages_used": self.dims.num_pages - len(self.free_pages), "pages": self.dims.num_pages,
                "snapshots": len(self.snaps), "snapshot_capacity": self.dims.num_snaps}
