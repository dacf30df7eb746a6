"""QSA K/V pages in pinned host memory (`--qsa-kv-offload`, issue 14 item 6; docs/long-context.md).

For small GPUs: the QSA layers' K and V page pools (`qsa_k`, `qsa_v`, 4/5 of the store's bytes per token) live in
pinned host memory; the indexer's raw and compressed keys stay on the device (every step scores them). A step
moves to the device only what its attention reads, one QSA layer at a time, and writes its new entries back:

* `write_entries`: each row's pages that the step's tokens go to come to the device, take the entries and go
  back into the host pool (dynamic_update_slice of the donated pool: an in-place write);
* `attend`: a decode-sized step fetches exactly the blocks each query attends (its chosen blocks and its tail,
  4 rows each) into a small device pool and runs the usual `sparse_attention` over it; a prefill chunk, whose
  queries together read most of their row, fetches each row's written pages instead, one row at a time.

Only single slices cross between the memories (a `dynamic_slice` of the host pool moved with `device_put`, a
device value moved to the host and `dynamic_update_slice`d into it): the patterns XLA streams between host and
device inside loops. A gather or scatter on a host operand does not even trace in JAX 0.11.2
(tools/host_offload_probe.py). The attention reads the same values as from the device pools, so the tokens and
logits are those of the on-device path (tests/test_qsa_offload.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
    [P, page, n_layers, kv, hd] -> [*S, rows, kv, hd] on the device, one slice per entry (a scan)."""
    def one(carry, at):
        part = jax.lax.dynamic_slice(pool, (at[0], at[1], layer, 0, 0), (1, rows, 1, *pool.shape[3:]))
        return carry, jax.device_put(part, DEVICE)[0, :, 0]

    _, out = jax.lax.scan(one, 0, (page.reshape(-1), row.reshape(-1)))
    return out.reshape(*page.shape, *out.shape[1:])


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
