"""Pure-JAX references of the sparse QSA kernels (qsa_sparse.py): indexer block scoring and gathered attention.

Both read only what a query needs: `indexer_scores` one tile of compressed block keys, `sparse_attention` the
selected blocks of the paged K/V pools (docs/long-context.md). They define the kernels' contracts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import fixed_order

NEG_INF = -jnp.inf


def indexer_scores(q_index, keys, n_complete, block0):
    """Masked indexer scores of one tile of blocks.

    q_index [B, T, nI, dI]; keys [B, N, dI] the compressed keys of blocks block0 .. block0 + N - 1; n_complete
    [B, T] int32, how many complete blocks query t sees ((p + 1) // ratio). Returns fp32 [B, T, N]:
    sum_h relu(<qI_h, kbar_n>) / sqrt(dI) where block0 + n < n_complete, -inf elsewhere.
    """
    scores = jnp.einsum("bthd,bnd->bthn", q_index.astype(jnp.float32), keys.astype(jnp.float32),
                        precision="highest")
    scores = fixed_order.tree_sum(jax.nn.relu(scores), 2) / jnp.sqrt(jnp.float32(keys.shape[-1]))
    blocks = block0 + jnp.arange(keys.shape[1])
    return jnp.where(blocks[None, None, :] < n_complete[..., None], scores, NEG_INF)


def sparse_attention(q, k_pool, v_pool, layer: int, blk_page, blk_off, blk_len, *, ratio: int, query_tile: int = 128):
    """Softmax attention of each query over its own list of key blocks, read from the page pools.

    q [B, T, kv, G, hd] (scores are scaled by hd^-0.5 here); k_pool, v_pool [P, page, n_layers, kv,
    hd]; layer: which layer of the pools; blk_page / blk_off / blk_len [B, T, J]: block j of query t is the
    blk_len tokens (0 .. ratio) at rows blk_off .. blk_off + blk_len - 1 of page blk_page. Queries with no key get
    0. Returns [B, T, kv, G, hd] in q's dtype. Queries are processed `query_tile` at a time so the gathered keys
    are [B, query_tile, J * ratio, kv, hd], whatever T.
    """
    b, t = q.shape[:2]
    tile = min(query_tile, t)
    n_tiles = -(-t // tile)
    pad = n_tiles * tile - t
    padq = lambda a: jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))
    q, blk_page, blk_off, blk_len = (padq(a) for a in (q, blk_page, blk_off, blk_len))
    split = lambda a: jnp.moveaxis(a.reshape(b, n_tiles, tile, *a.shape[2:]), 1, 0)

    def one_tile(args):
        qt, page, off, n = args
        rows = off[..., None] + jnp.arange(ratio)  # [B, tile, J, ratio]
        take = lambda pool: pool[page[..., None], jnp.minimum(rows, pool.shape[1] - 1), layer]  # [B,tile,J,r,kv,hd]
        on = (jnp.arange(ratio) < n[..., None]).reshape(b, tile, -1)  # [B, tile, S]
        return gathered_attention(qt, take(k_pool).reshape(b, tile, -1, *k_pool.shape[3:]),
                                  take(v_pool).reshape(b, tile, -1, *v_pool.shape[3:]), on)

    out = jax.lax.map(one_tile, tuple(split(a) for a in (q, blk_page, blk_off, blk_len)))
    return jnp.moveaxis(out, 0, 1).reshape(b, n_tiles * tile, *q.shape[2:])[:, :t]


def gathered_attention(q, k, v, on):
    """Softmax attention of each query over its own gathered keys: q [B, T, kv, G, hd] (scaled by hd^-0.5 here),
    k, v [B, T, S, kv, hd], on [B, T, S] which of them it attends. Keys and values off the list are zeroed first,
    so poisoned or stale entries never reach an output; a query with no key gets 0. Returns q's shape and dtype."""
    k = jnp.where(on[..., None, None], k, 0).astype(q.dtype)
    v = jnp.where(on[..., None, None], v, 0).astype(q.dtype)
    precision = "highest" if q.dtype == jnp.float32 else None
    s = jnp.einsum("btkgd,btskd->btkgs", q, k, precision=precision, preferred_element_type=jnp.float32)
    s = jnp.where(on[:, :, None, None], s * (q.shape[-1] ** -0.5), NEG_INF)
    p = jnp.where(on[:, :, None, None], fixed_order.softmax(s, axis=-1), 0.0).astype(q.dtype)
    return jnp.einsum("btkgs,btskd->btkgd", p, v, precision=precision,
                      preferred_element_type=jnp.float32).astype(q.dtype)


__all__ = ["indexer_scores", "sparse_attention", "gathered_attention"]
