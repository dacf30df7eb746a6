"""QSA K/V pages in pinned host memory (`--qsa-kv-offload`, issue 14 item 6; docs/long-context.md).

For small GPUs: the QSA layers' K and V page pools (`qsa_k`, `qsa_v`, 4/5 of the store's bytes per token) live in
pinned host memory; the indexer's raw and compressed keys stay on the device (every step scores them). A step
moves to the device only what its attention reads, one QSA layer at a time, and writes its new entries back:

* `write_entries`: each row's pages that the step's tokens go to come to the device, take the entries and go
  back into the host pool (dynamic_update_slice of the donated pool: an in-place write);
* `attend`: a decode-sized step fetches exactly the blocks each query attends (its chosen blocks and its tail,
  4 rows each) into a small device pool and runs the usual `sparse_attention` over it; a prefill chunk, whose
  queries together read most of their row, fetches each row's written pages instead, one row at a time.

The fetches (`fetch`: a decode step's blocks, the pages a write patches) are ONE gather per pool and layer,
computed on the host (`compute_on("device_host")`, tools/host_offload_probe.py `take_compute_on_host`, here in
windows of rows rather than single rows): the (small) index array goes to host memory, the host gathers the
blocks out of the pinned pool, and the result crosses to the device in one copy. A plain gather (`jnp.take`)
of the host operand inside the device program does not trace in JAX 0.11.2 (its operands' memory spaces differ);
the compute_on one does, and on an H100 it fetched 509 blocks of 4 rows from a 128K-token pool in 0.377 ms where
a scan of one `dynamic_slice` + `device_put` per block took 3.85 ms (bench/results/host_offload_probe_h100.json).
The writes stay single slices (a device value moved to the host and `dynamic_update_slice`d into the donated
pool, the probe's `write_fori_dus`: the compute_on scatter took 20.7 ms there), and so do a prefill chunk's
per-row page reads (a loop whose trip count follows the row's attended pages, where a gather's size would be the
whole page-table width). The attention reads the same values as from the device pools, so the tokens and logits
are those of the on-device path (tests/test_qsa_offload.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on

from pallas_kernels import qsa_sparse

from .state_store import token_page_index

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device
HOST_MEMORY_KIND = "pinned_host"
# a step fetches single blocks while it attends at most this many (32 decode rows of 513 blocks); beyond, or when
# its queries' blocks hold more rows than a row's whole page table, it fetches each row's pages
MAX_BLOCK_FETCHES = 1 << 14


def supported(device=None) -> bool:
    """Whether the device's backend has pinned host memory that a jitted step can read and write."""
    device = device or jax.devices()[0]
    return HOST_MEMORY_KIND in {m.kind for m in device.addressable_memories()}


def fetch(pool, layer: int, page, row, rows: int):
    """Rows `row .. row + rows - 1` of page `page` (int32 arrays of one shape S) of layer `layer` of a host pool
    [P, page, n_layers, kv, hd] -> [*S, rows, kv, hd] on the device: one gather computed on the host.

    Each entry is a window of `rows` rows, its start taken as a `dynamic_slice` takes it (the scan of slices
    this replaces): a negative index counts from the end, then the window is clamped into the pool. The callers
    pass only valid windows (pages in the pool, the null page for unmapped ones; rows a whole page or a block
    inside one), so this only guards. The index array is built on the device and moved to the host: constants
    made inside the host computation would be device values there, which it cannot mix."""
    page, row = _slice_start(page, pool.shape[0], 1), _slice_start(row, pool.shape[1], rows)
    at = jnp.stack([page, row, jnp.full_like(page, layer)], axis=-1)
    return jax.device_put(_gather_on_host(pool, jax.device_put(at, HOST), rows), DEVICE)


def _slice_start(i, size: int, window: int):
    """Start indices as `dynamic_slice` reads them: negative from the end, clamped so the window fits."""
    i = i.astype(jnp.int32)
    return jnp.clip(jnp.where(i < 0, i + size, i), 0, size - window)


def _gather_on_host(pool, at, rows: int):
    """The windows pool[at[..., 0], at[..., 1] : at[..., 1] + rows, at[..., 2]] ([*S, rows, kv, hd]) of a host pool
    by host-resident start indices at [*S, 3] (in range), gathered on the host and left in host memory."""
    s = at.ndim - 1
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(s, s + 1, s + 2), collapsed_slice_dims=(0, 2),
                                          start_index_map=(0, 1, 2))
    gather = lambda p, i: jax.lax.gather(p, i, dims, (1, rows, 1, *p.shape[3:]),  # noqa: E731
                                         mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    return compute_on(compute_type="device_host", out_memory_spaces=HOST)(gather)(pool, at)


def write_entries(pool, layer: int, page_table, positions, write, values):
    """The host pool with values [B, T, kv, hd] written at positions [B, T] where `write`, in layer `layer`.

    Row b's tokens are consecutive positions, so they go to at most `n` consecutive page-table columns from its
    first token's page: those pages come to the device, take their tokens (a scatter on the device) and go back
    whole. Columns no token of the step goes to are the null page (the pool's last), put back as it was."""
    b, t = positions.shape
    page_size, null, width = pool.shape[1], pool.shape[0] - 1, page_table.shape[1]
    n = (t + page_size - 2) // page_size + 1
    pid, off = token_page_index(page_table, positions, page_size)
    write = write & (pid >= 0)
    col = jnp.where(write, positions // page_size - positions[:, :1] // page_size, n)  # n: dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    touched = jnp.zeros((b, n), bool).at[rows, col].set(True, mode="drop")
    first = positions[:, :1] // page_size + jnp.arange(n)
    pages = jnp.take_along_axis(page_table, jnp.clip(first, 0, width - 1), axis=1)
    pages = jnp.where(touched & (pages >= 0), pages, null)
    window = fetch(pool, layer, pages, jnp.zeros_like(pages), page_size)  # [B, n, page, kv, hd]
    window = window.at[rows, col, off].set(values.astype(pool.dtype), mode="drop")

    def put(i, pool):
        part = jax.device_put(window.reshape(b * n, 1, page_size, 1, *pool.shape[3:])[i], HOST)
        return jax.lax.dynamic_update_slice(pool, part, (pages.reshape(-1)[i], 0, layer, 0, 0))

    # a barrier: XLA would otherwise read the attended blocks as slices of the pool *before* this write, patched
    # with the written pages, which keeps the old pool alive beside the new one (a whole copy of it)
    return jax.lax.optimization_barrier(jax.lax.fori_loop(0, b * n, put, pool))


def fetches_blocks(batch: int, tokens: int, blocks: int, ratio: int, table_width: int, page_size: int) -> bool:
    """Whether a step attends from fetched blocks (decode-sized steps) rather than its rows' whole pages."""
    return batch * tokens * blocks <= MAX_BLOCK_FETCHES and tokens * blocks * ratio <= table_width * page_size


def attend(q, kv, blocks, page, row, length, *, ratio: int, query_tile: int):
    """`qsa_sparse.sparse_attention` of q [B, T, kv, G, hd] over its blocks (numbers `blocks`, at `page`, `row`,
    `length` rows: [B, T, J] as qsa_paged builds them) with K/V read from the host pools of `kv` (a PagedKV)."""
    b, t, j = blocks.shape
    page_size, width = kv.k.shape[1], kv.page_table.shape[1]
    if fetches_blocks(b, t, j, ratio, width, page_size):
        # the blocks themselves: entry (b, t, j) is page b * T * J + t * J + j of a small device pool
        k, v = (fetch(pool, kv.layer, page, row, ratio).reshape(b * t * j, ratio, 1, *pool.shape[3:])
                for pool in (kv.k, kv.v))
        at = jnp.arange(b * t * j, dtype=jnp.int32).reshape(b, t, j)
        return qsa_sparse.sparse_attention(q, k, v, 0, at, jnp.zeros_like(row), length, ratio=ratio,
                                           query_tile=query_tile)

    null = kv.k.shape[0] - 1
    column = blocks * ratio // page_size  # the page-table column of each block

    def one_row(args):  # the row's pages up to its last attended one, in page-table order
        qb, table, cols, rows, n = args
        used = jnp.max(jnp.where(n > 0, cols, -1)) + 1
        table = jnp.where(table >= 0, table, null)

        def get(i, win):
            k, v = (jax.device_put(jax.lax.dynamic_slice(pool, (table[i], 0, kv.layer, 0, 0),
                                                         (1, page_size, 1, *pool.shape[3:])), DEVICE)
                    for pool in (kv.k, kv.v))
            return tuple(jax.lax.dynamic_update_slice(w, x, (i, 0, 0, 0, 0)) for w, x in zip(win, (k, v)))

        win = tuple(jnp.zeros((width, page_size, 1, *pool.shape[3:]), pool.dtype) for pool in (kv.k, kv.v))
        k, v = jax.lax.fori_loop(0, used, get, win)
        return qsa_sparse.sparse_attention(qb[None], k, v, 0, jnp.minimum(cols, width - 1)[None], rows[None],
                                           n[None], ratio=ratio, query_tile=query_tile)[0]

    return jax.lax.map(one_row, (q, kv.page_table, column, row, length))


__all__ = ["supported", "fetch", "write_entries", "attend", "fetches_blocks", "HOST_MEMORY_KIND"]
