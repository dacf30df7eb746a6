"""QSA straight from the engine's paged store: the indexer's top blocks and the tail, nothing else, per query.

Same selection as `qsa.selection_mask` (the oracle), computed without any per-row dense copy and without a
[T, L] array (docs/long-context.md):
1. the step's K, V and raw index keys are written into their pages first, so its own tokens are visible to it;
2. a token that completes a block (position 4j + 3) writes the block's compressed key (`qsa.block_keys` of the
   block's four raw keys, as transformers computes it) into the block-key pages, one entry per block; so no
   step recomputes the keys of the whole context;
3. the indexer scores the row's complete blocks from those pages. A decode step (the whole width's scores fit
   the score budget) scores the whole page-table width in one pass and takes one top-k: no loop whose trip
   count depends on the context (a GPU while loop waits for its predicate on the host every iteration: 9 waits
   per layer at 128K, bench/results/select_decode.json). A prefill chunk scores tile by tile and merges each
   tile into a running top-k. The running entries come first in each merge and `lax.top_k` prefers the lower
   position among equal values, so ties go to the lowest block index, exactly as one top-k over all blocks;
4. attention reads only the chosen blocks and the tail block (the tokens after the last complete one, up to the
   query itself) from the K/V pages (pallas_kernels/qsa_sparse.py, kernel or reference per the switch).
Peak temporaries are [T, tile] scores and [query tile, budget] keys: they grow with the chunk, not the context.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import qsa_sparse

from . import qsa_offload
from .config import ModelConfig
from .layers import linear
from .qsa import block_keys, project
from .state_store import token_page_index

SCORE_TILE_ELEMENTS = 1 << 24  # scores per tile (T x index heads x blocks, fp32): 64 MiB
MAX_TILE_BLOCKS = 4096  # 16K tokens of context per tile at ratio 4


class PagedKV(NamedTuple):
    """The store's QSA page leaves as one layer sees them: pools [P + 1, page, n_qsa, ...] (last page = the
    poisoned null page) of K, V and raw index keys, the block-key pool [P + 1, page / ratio, n_qsa, dI], the rows'
    page tables [B, MP], which tokens get written ([B, T]: valid tokens of live rows), this layer's index among
    the QSA layers, the scoring tile's size in scores (the memory knob), and whether K and V live in pinned host
    memory (qsa_offload.py: then only what a step attends comes to the device)."""

    k: jax.Array
    v: jax.Array
    index: jax.Array
    block_keys: jax.Array
    page_table: jax.Array
    write: jax.Array
    layer: int
    score_elements: int = SCORE_TILE_ELEMENTS
    offload: bool = False


def page_rows(kv: PagedKV, positions):
    """(page, row) of absolute positions [B, ...]; unmapped positions read the null page."""
    shape = positions.shape
    page, row = token_page_index(kv.page_table, positions.reshape(shape[0], -1), kv.k.shape[1])
    page = jnp.where(page >= 0, page, kv.k.shape[0] - 1)
    return page.reshape(shape), row.reshape(shape)


def write_tokens(pool, kv: PagedKV, positions, values):
    """pool with values [B, T, ...] written at absolute positions [B, T] where kv.write (others dropped)."""
    page, row = token_page_index(kv.page_table, positions, pool.shape[1])
    page = jnp.where(kv.write & (page >= 0), page, pool.shape[0])  # out of range: dropped
    return pool.at[page, row, kv.layer].set(values.astype(pool.dtype), mode="drop")


def write_block_keys(p: dict, cfg: ModelConfig, kv: PagedKV, positions, mrope=None, shift: int = 0):
    """The block-key pool with the keys of the blocks this step's tokens complete (a token at cache index 4j + 3
    completes block j), each from its block's raw keys in the pages (this step's just written). A draft token that
    is rejected later is rewritten by a later step, its block key with it, before any query counts that block.
    `shift`: the pages hold cache index x at page position x + shift (the MTP layer's 1, mtp_paged.py); a block's
    key goes in the page row holding its completing token, so it lives in that token's page."""
    ratio = cfg.indexer_compress_ratio
    b, t = positions.shape
    block = positions // ratio
    page, row = page_rows(kv, shift + (block[..., None] * ratio + jnp.arange(ratio)).reshape(b, t * ratio))
    keys = block_keys(p, cfg, kv.index[page, row, kv.layer].reshape(b, t, ratio, -1), block, mrope)
    pid, off = token_page_index(kv.page_table, positions + shift, kv.index.shape[1])
    completes = kv.write & ((positions + 1) % ratio == 0) & (pid >= 0)
    pid = jnp.where(completes, pid, kv.block_keys.shape[0])  # out of range: dropped
    return kv.block_keys.at[pid, off // ratio, kv.layer].set(keys.astype(kv.block_keys.dtype), mode="drop")


def score_tile_blocks(batch: int, tokens: int, index_heads: int, n_blocks: int, elements: int) -> int:
    """Blocks per scoring tile: a power of two with batch x tokens x heads x tile <= elements (at least 1), and
    at most MAX_TILE_BLOCKS (a decode step's tile would otherwise span the whole page-table width)."""
    tile = min(MAX_TILE_BLOCKS, max(1, elements // max(1, batch * tokens * index_heads)))
    tile = 1 << (tile.bit_length() - 1)
    return min(tile, max(1, n_blocks))


def select_blocks(cfg: ModelConfig, q_index, kv: PagedKV, positions):
    """Top `block_topk` complete blocks per query -> (block numbers [B, T, K], chosen [B, T, K] bool), scored
    from the block-key pages (the keys of every block complete at a query were written by then)."""
    vals, idx = top_blocks(cfg, q_index, kv, (positions + 1) // cfg.indexer_compress_ratio)
    return idx, jnp.isfinite(vals)


def top_blocks(cfg: ModelConfig, q_index, kv: PagedKV, n_complete, first: int = 0):
    """The `block_topk` best of blocks 0 .. n_complete - 1 ([B, T] per query) -> (scores [B, T, K] in descending
    order, -inf past the candidates; block numbers [B, T, K]). Block j's key is in page row j + `first` of the
    rows' block-key pages (the MTP layer's 1: mtp_paged.py)."""
    b, t = n_complete.shape
    ratio, top = cfg.indexer_compress_ratio, cfg.block_topk
    n_blocks = kv.page_table.shape[1] * kv.block_keys.shape[1] - first
    tile = score_tile_blocks(b, t, cfg.indexer_n_heads, n_blocks, kv.score_elements)

    if b * t * n_blocks <= kv.score_elements:
        # a decode step: one pass over the whole width and ONE top-k (lax.top_k prefers the lower index among
        # equal values). At least `top` entries: the extra ones stay -inf, are never chosen and name blocks past
        # the page table (the null page).
        table = jnp.where(kv.page_table >= 0, kv.page_table, kv.block_keys.shape[0] - 1)
        keys = kv.block_keys[table, :, kv.layer].reshape(b, n_blocks + first, -1)[:, first:]
        scores = qsa_sparse.indexer_scores(q_index, keys, n_complete, 0)
        if n_blocks < top:
            scores = jnp.pad(scores, ((0, 0), (0, 0), (0, top - n_blocks)), constant_values=-jnp.inf)
        return jax.lax.top_k(scores, top)

    def tile_scores(start):  # [B, T, tile] scores of blocks start .. start + tile - 1
        blocks = start + jnp.arange(tile)
        page, row = page_rows(kv, jnp.broadcast_to((blocks + first) * ratio, (b, tile)))
        keys = kv.block_keys[page, row // ratio, kv.layer]
        return qsa_sparse.indexer_scores(q_index, keys, n_complete, start), blocks

    def merge(carry, start):
        vals, idx = carry
        scores, blocks = tile_scores(start)
        vals, pick = jax.lax.top_k(jnp.concatenate([vals, scores], axis=-1), top)  # running entries first: ties
        idx = jnp.take_along_axis(jnp.concatenate([idx, jnp.broadcast_to(blocks, (b, t, tile))], -1), pick, -1)
        return vals, idx

    # a prefill chunk: only the tiles holding some query's complete blocks (the trip count follows the rows'
    # context, not the page-table width, so one padded width costs little at short contexts)
    n_tiles = jnp.minimum(-(-jnp.max(n_complete) // tile), -(-n_blocks // tile))
    init = (jnp.full((b, t, top), -jnp.inf, jnp.float32), jnp.full((b, t, top), n_blocks, jnp.int32))
    return jax.lax.fori_loop(0, n_tiles, lambda i, carry: merge(carry, i * tile), init)


def qsa_paged_forward(p: dict, cfg: ModelConfig, u, positions, valid, kv: PagedKV, mrope=None, *,
                      query_tile: int = 128):
    """One QSA layer over the paged store. u [B, T, H]; positions, valid [B, T] (cache indices); mrope: the rows'
    3-D rotary positions (mrope.SpanRope) when some row has images, as `qsa.qsa_forward` (None: text positions).
    Returns (y [B, T, H], kv with this step's K/V/index entries written into its pools)."""
    ratio, page_size = cfg.indexer_compress_ratio, kv.k.shape[1]
    if not cfg.qsa_enabled or page_size % ratio:
        raise ValueError(f"paged QSA needs the indexer and a page size that is a multiple of the block ratio "
                         f"({ratio}); got page size {page_size}")
    bsz, t, _ = u.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, gate, k, v, q_index, k_index = project(p, cfg, u, positions, mrope)
    if kv.offload:
        k_pool, v_pool = (qsa_offload.write_entries(pool, kv.layer, kv.page_table, positions, kv.write, new)
                          for pool, new in ((kv.k, k), (kv.v, v)))
    else:
        k_pool, v_pool = write_tokens(kv.k, kv, positions, k), write_tokens(kv.v, kv, positions, v)
    kv = kv._replace(k=k_pool, v=v_pool, index=write_tokens(kv.index, kv, positions, k_index))
    kv = kv._replace(block_keys=write_block_keys(p["indexer"], cfg, kv, positions, mrope))

    with jax.named_scope("select"):
        idx, chosen = select_blocks(cfg, q_index, kv, positions)
    n_complete = (positions + 1) // ratio
    blocks = jnp.concatenate([idx, n_complete[..., None]], axis=-1)  # the chosen blocks, then the tail block
    length = jnp.concatenate([jnp.where(chosen, ratio, 0), ((positions + 1) % ratio)[..., None]], axis=-1)
    # never past the row's last written key (padding queries), as the dense path's `written` mask
    last = jnp.max(jnp.where(valid, positions, -1), axis=1)
    length = jnp.clip(jnp.minimum(length, last[:, None, None] - blocks * ratio + 1), 0, ratio)
    page, row = page_rows(kv, blocks * ratio)

    qh = q.reshape(bsz, t, nkv, nh // nkv, hd)
    with jax.named_scope("attend"):
        if kv.offload:
            out = qsa_offload.attend(qh, kv, blocks, page, row, length, ratio=ratio, query_tile=query_tile)
        else:
            out = qsa_sparse.sparse_attention(qh, kv.k, kv.v, kv.layer, page, row, length, ratio=ratio,
                                              query_tile=query_tile)
    out = out.astype(u.dtype).reshape(bsz, t, nh * hd) * jax.nn.sigmoid(gate)
    return linear(out, p["o_proj"]), kv


__all__ = ["PagedKV", "qsa_paged_forward", "select_blocks", "top_blocks", "score_tile_blocks", "SCORE_TILE_ELEMENTS"]
