"""The MTP head's QSA layer straight from its pages, as the main layers' (qsa_paged.py; docs/long-context.md).

Same outputs as the dense oracle (`mtp.mtp_forward` on a per-row copy of the pages, `RealRunner(paged_mtp=False)`)
without that copy: the copy spans the whole page-table width, and the drafts repeated it for each tail column, so
an MTP engine could not pad its page tables to one width (issue 14, items 1 and 4).

Coordinates. The MTP cache entry of pair (h_{q-1}, e_q) has cache index (RoPE position) q - 1 but lives at page
position q, in the page of the token that creates it, so a prefix-cached page is complete on its own (runner.py).
QSA blocks are in cache indices (block j = indices 4j .. 4j + 3 = page positions 4j + 1 .. 4j + 4, which may
straddle two pages); block j's compressed key is written by the pair that completes it (cache index 4j + 3) into
the `mtp_block_keys` page row holding page position 4j + 4 (row j + 1; row 0 is never written or scored).

A step's two parts:
* `fold`: this step's pairs' K, V and raw index keys (the layer's projections only: the fold's attention output
  is never used) and the block keys they complete, written into the pages;
* `drafts`: column c of each row drafts from its tail token at cache index t_c, chained k times at p = t_c + i.
  The columns are alternative futures, so the chain's own entries (indices >= t_c) are not written to the pages
  but kept in a side buffer [B, K1, k, ...]; what the pages hold at indices >= t_c (this step's later pairs,
  stale drafts) is never read. A draft query at p scores blocks j < t_c // 4 from the block-key pages (all their
  entries precede t_c, so this step's fold or an earlier step wrote them) and the few blocks from there on,
  which mix page and side-buffer entries, with keys computed here; the scores are merged in increasing block
  order (`lax.top_k` keeps the lower position among equal values), so ties go to the lowest block as in the
  oracle. It attends the chosen blocks and its tail (indices 4 * ((p + 1) // 4) .. p), gathered per key.
Temporaries: a decode step's scores over the width's block keys (as the main layers'), the chosen keys
[B, K1, (budget / 4 + 1) * 4, ...] and the side buffer; nothing of [L] per token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import qsa_sparse
from pallas_kernels.qsa_sparse_reference import gathered_attention

from .config import ModelConfig
from .layers import linear
from .mtp import attention_input, mtp_input, mtp_layer
from .qsa import block_keys, project
from .qsa_paged import PagedKV, page_rows, top_blocks, write_block_keys, write_tokens

SHIFT = 1  # page position = cache index + 1


def fold(params: dict, cfg: ModelConfig, kv: PagedKV, hyper, next_tokens, q, mrope=None, image_embeds=None,
         image_mask=None) -> PagedKV:
    """Write the pairs (hyper [B, T, S*H] = h_{q-1}, next_tokens [B, T] = token q) at page positions q [B, T]
    where kv.write: their K, V and raw index keys, and the keys of the blocks they complete. `mrope`: the rows'
    3-D rotary positions (image steps; image_embeds / image_mask as in mtp.mtp_forward)."""
    p = params["mtp"]["layers"][0]["self_attn"]
    u = attention_input(params, cfg, mtp_input(params, cfg, hyper, next_tokens, image_embeds, image_mask))
    _, _, k, v, _, k_index = project(p, cfg, u, q - SHIFT, mrope)
    kv = kv._replace(k=write_tokens(kv.k, kv, q, k), v=write_tokens(kv.v, kv, q, v),
                     index=write_tokens(kv.index, kv, q, k_index))
    return kv._replace(block_keys=write_block_keys(p["indexer"], cfg, kv, q - SHIFT, mrope, shift=SHIFT))


def drafts(params: dict, cfg: ModelConfig, kv: PagedKV, h_tail, tail_logits, tail_index, k: int, mrope=None):
    """Draft logits [B, K1, k, V]: column c chains k MTP steps from h_tail [B, K1, S*H] and the argmax of
    tail_logits [B, K1, V] at cache index tail_index [B, K1] (its tail token's position), reading the pages
    (`fold` done) and never writing them."""
    b, c, _ = h_tail.shape
    nkv, hd, di = cfg.num_key_value_heads, cfg.head_dim, cfg.indexer_head_dim
    side = (jnp.zeros((b, c, k, nkv, hd), kv.k.dtype), jnp.zeros((b, c, k, nkv, hd), kv.v.dtype),
            jnp.zeros((b, c, k, di), kv.index.dtype))
    h, y = h_tail, jnp.argmax(tail_logits, axis=-1).astype(jnp.int32)
    out = []
    for i in range(k):
        attention = functools.partial(_draft_attention, cfg=cfg, kv=kv, t=tail_index, i=i, side=side, mrope=mrope)
        logits, h, side = mtp_layer(params, cfg, mtp_input(params, cfg, h, y), attention)
        out.append(logits)
        y = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jnp.stack(out, 2)


def _entries(pool, side, kv: PagedKV, x, t):
    """Entries [B, C, S, ...] of cache indices x [B, C, S] for the chains from tail indices t [B, C]: below t from
    the pages (page position x + 1), from t on from the side buffer [B, C, k, ...] (entry x - t)."""
    b, c, s = x.shape
    page, row = page_rows(kv, (x + SHIFT).reshape(b, c * s))
    paged = pool[page, row, kv.layer].reshape(b, c, s, *pool.shape[3:])
    expand = lambda a: a.reshape(b, c, s, *([1] * (side.ndim - 3)))  # noqa: E731
    own = jnp.take_along_axis(side, expand(jnp.clip(x - t[..., None], 0, side.shape[2] - 1)), axis=2)
    return jnp.where(expand(x < t[..., None]), paged, own)


def _draft_attention(p: dict, u, *, cfg: ModelConfig, kv: PagedKV, t, i: int, side, mrope=None):
    """The QSA layer for draft step i of every chain (query at cache index t + i; u [B, C, H]) -> (y [B, C, H],
    the side buffer with this step's entries)."""
    b, c, _ = u.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, gate, k, v, q_index, k_index = project(p, cfg, u, t + i, mrope)
    side = tuple(s.at[:, :, i].set(new.astype(s.dtype)) for s, new in zip(side, (k, v, k_index)))
    x, on = _draft_keys(p["indexer"], cfg, kv, q_index, t, t + i, side[2], mrope)
    out = gathered_attention(q.reshape(b, c, nkv, nh // nkv, hd), _entries(kv.k, side[0], kv, x, t),
                             _entries(kv.v, side[1], kv, x, t), on)
    out = out.astype(u.dtype).reshape(b, c, nh * hd) * jax.nn.sigmoid(gate)
    return linear(out, p["o_proj"]), side


def _draft_keys(p: dict, cfg: ModelConfig, kv: PagedKV, q_index, t, pos, side_index, mrope=None):
    """The cache indices a draft query at pos [B, C] attends, x [B, C, S], and which of them it does, on [B, C, S]:
    the indexer's top blocks, then the tail block (its first (pos + 1) % 4 entries: up to the query itself)."""
    b, c = t.shape
    ratio, top = cfg.indexer_compress_ratio, cfg.block_topk
    # blocks before the tail token's block: their cached keys; from there on (at most `n_fresh` complete ones by
    # the last draft) keys from their raw keys, pages and side buffer mixed, scored after them (ties: lower block)
    tail_block = t // ratio
    vals, idx = top_blocks(cfg, q_index, kv, tail_block, first=SHIFT)
    n_fresh = (ratio - 1 + side_index.shape[2]) // ratio
    fresh = tail_block[..., None] + jnp.arange(n_fresh)  # [B, C, n_fresh]
    raw = _entries(kv.index, side_index, kv, (fresh[..., None] * ratio + jnp.arange(ratio)).reshape(b, c, -1), t)
    keys = block_keys(p, cfg, raw.reshape(b, c * n_fresh, ratio, -1), fresh.reshape(b, c * n_fresh), mrope)
    n_complete = (pos + 1) // ratio
    scores = qsa_sparse.indexer_scores(q_index.reshape(b * c, 1, *q_index.shape[2:]),
                                       keys.reshape(b * c, n_fresh, -1), (n_complete - tail_block).reshape(b * c, 1), 0)
    vals, pick = jax.lax.top_k(jnp.concatenate([vals, scores.reshape(b, c, n_fresh)], axis=-1), top)
    idx = jnp.take_along_axis(jnp.concatenate([idx, fresh], axis=-1), pick, axis=-1)

    blocks = jnp.concatenate([idx, n_complete[..., None]], axis=-1)
    length = jnp.concatenate([jnp.where(jnp.isfinite(vals), ratio, 0), ((pos + 1) % ratio)[..., None]], axis=-1)
    x = (blocks[..., None] * ratio + jnp.arange(ratio)).reshape(b, c, -1)
    return x, (jnp.arange(ratio) < length[..., None]).reshape(b, c, -1)


__all__ = ["fold", "drafts"]
