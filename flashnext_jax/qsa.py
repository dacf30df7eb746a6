"""QSA layers: gated GQA attention whose keys are restricted per query by a block indexer.

Selection, exactly as the reference: the visible tokens of a query at position p (0..p) are grouped in consecutive
blocks of `ratio` from the sequence start; each COMPLETE block gets a key kbar = RoPE_{first pos}(k_norm(mean of its
raw index keys)); a block scores sum_h relu(<qI_h, kbar>) / sqrt(dI); the top `budget / ratio` blocks plus the
incomplete tail block are attended. Consequences: at most budget + ratio - 1 visible tokens means dense attention;
when p + 1 is a multiple of `ratio` the query's own token sits in a complete block and is attended only if that
block is selected. Ties between equal scores go to the lowest block index (`lax.top_k`).

The caches are dense per row here: K/V [B, L, kv_heads, head_dim] and raw index keys [B, L, dI], written at each
token's position. Keys past a row's last written position are masked and zeroed, so stale or poisoned cache
contents never reach an output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import fixed_order

from .config import ModelConfig
from .layers import apply_rope, linear, linear_group, rms_norm, rope_cos_sin
from .mrope import MRope, mrope_cos_sin


def _scatter_rows(cache: jax.Array, new: jax.Array, positions: jax.Array, valid: jax.Array) -> jax.Array:
    """cache[b, positions[b, t]] = new[b, t] for valid tokens; invalid ones are dropped (never written)."""
    length = cache.shape[1]
    pos = jnp.where(valid, positions, length)  # out of range -> dropped
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, pos].set(new.astype(cache.dtype), mode="drop")


def block_keys(p: dict, cfg: ModelConfig, raw, blocks, mrope: MRope | None = None):
    """Compressed block keys [B, N, dI] from the raw index keys of N complete blocks raw [B, N, ratio, dI] with
    block numbers blocks [N] (or per row, [B, N]): RoPE at the block's first position of k_layernorm(mean_fp32(raw) cast back). With
    image input (`mrope`: an mrope.MRope table or SpanRope spans) that is the 3-D position of the block's first
    token."""
    pooled = fixed_order.mean(raw.astype(jnp.float32), 2).astype(raw.dtype)
    pooled = rms_norm(pooled, p["k_layernorm"], cfg.rms_norm_eps)
    if mrope is None:
        cos, sin = rope_cos_sin(blocks * cfg.indexer_compress_ratio, cfg.rotary_dim, cfg.rope_theta, pooled.dtype)
    else:
        starts = jnp.broadcast_to(blocks * cfg.indexer_compress_ratio, raw.shape[:2])
        cos, sin = mrope_cos_sin(mrope.at(starts), mrope.section, cfg.rotary_dim, cfg.rope_theta, pooled.dtype)
    return apply_rope(pooled, cos, sin)


def block_scores(q_index, keys):
    """Indexer scores [B, T, N] = sum_h relu(<qI_h, kbar_n>) / sqrt(dI), fp32; q_index [B, T, nI, dI]."""
    scores = jnp.einsum("bthd,bnd->bthn", q_index.astype(jnp.float32), keys.astype(jnp.float32),
                        precision="highest")
    return fixed_order.tree_sum(jax.nn.relu(scores), 2) / jnp.sqrt(jnp.float32(keys.shape[-1]))


def project(p: dict, cfg: ModelConfig, u, positions, mrope: MRope | None = None):
    """The layer's per-token projections: q [B, T, nh, hd] (normed, roped), gate [B, T, nh*hd], k (normed, roped) and
    v [B, T, kv, hd], and with the indexer on, q_index [B, T, nI, dI] (normed, roped) and the raw index key
    [B, T, dI] (what the cache holds); both None when QSA is off. `mrope` (image input): the 3-D positions of
    the cache indices `positions` drive the rotation instead."""
    bsz, t, _ = u.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qg, k, v = linear_group(u, p, ("q_proj", "k_proj", "v_proj"))
    qg = qg.reshape(bsz, t, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(bsz, t, nh * hd)
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k.reshape(bsz, t, nkv, hd), p["k_norm"], cfg.rms_norm_eps)
    v = v.reshape(bsz, t, nkv, hd)
    if mrope is None:
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, u.dtype)
    else:
        cos, sin = mrope_cos_sin(mrope.at(positions), mrope.section, cfg.rotary_dim, cfg.rope_theta, u.dtype)
    q = apply_rope(q, cos[:, :, None], sin[:, :, None])
    k = apply_rope(k, cos[:, :, None], sin[:, :, None])
    if not cfg.qsa_enabled:
        return q, gate, k, v, None, None
    ni, di = cfg.indexer_n_heads, cfg.indexer_head_dim
    qk_index = linear(u, p["indexer"]["index_qk_proj"])
    q_index = rms_norm(qk_index[..., : ni * di].reshape(bsz, t, ni, di), p["indexer"]["q_layernorm"],
                       cfg.rms_norm_eps)
    q_index = apply_rope(q_index, cos[:, :, None], sin[:, :, None])
    return q, gate, k, v, q_index, qk_index[..., ni * di :]


def selection_mask(p: dict, cfg: ModelConfig, q_index, index_cache, positions, mrope: MRope | None = None):
    """Allowed-key mask [B, T, L] from the indexer (causal AND selected blocks OR tail).

    q_index [B, T, nI, dI] (normed and roped); index_cache [B, L, dI] raw keys; positions [B, T] query positions.
    """
    bsz, length, d = index_cache.shape
    ratio = cfg.indexer_compress_ratio
    nblocks = length // ratio
    raw = index_cache[:, : nblocks * ratio].reshape(bsz, nblocks, ratio, d)
    scores = block_scores(q_index, block_keys(p, cfg, raw, jnp.arange(nblocks), mrope))  # [B, T, nblocks]
    complete = (jnp.arange(nblocks)[None, None, :] + 1) * ratio <= positions[..., None] + 1
    k = min(cfg.block_topk, nblocks)
    top_val, top_idx = jax.lax.top_k(jnp.where(complete, scores, -jnp.inf), k)
    chosen = jnp.isfinite(top_val)
    block_on = jnp.zeros((bsz, positions.shape[1], nblocks + 1), bool)
    block_on = block_on.at[
        jnp.arange(bsz)[:, None, None], jnp.arange(positions.shape[1])[None, :, None], jnp.where(chosen, top_idx, nblocks)
    ].set(True)[..., :nblocks]

    key_pos = jnp.arange(length)
    key_block = jnp.minimum(key_pos // ratio, nblocks - 1)
    in_block = jnp.take_along_axis(block_on, jnp.broadcast_to(key_block, (*block_on.shape[:2], length)), axis=-1)
    in_block = in_block & (key_pos < nblocks * ratio)
    tail_start = ((positions + 1) // ratio) * ratio
    in_tail = key_pos[None, None, :] >= tail_start[..., None]
    causal = key_pos[None, None, :] <= positions[..., None]
    return causal & (in_block | in_tail)


def qsa_forward(p: dict, cfg: ModelConfig, u, positions, valid, cache, mrope: MRope | None = None):
    """One QSA layer. u [B, T, H]; positions [B, T] (cache indices); valid [B, T]; cache = (k [B, L, kv, hd], v,
    index [B, L, dI]); mrope: the rows' 3-D rotary positions when the prompt has images (None: text positions).

    Returns (y [B, T, H], new cache).
    """
    bsz, t, _ = u.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    k_cache, v_cache, index_cache = cache
    length = k_cache.shape[1]

    q, gate, k, v, q_index, k_index = project(p, cfg, u, positions, mrope)
    k_cache = _scatter_rows(k_cache, k, positions, valid)
    v_cache = _scatter_rows(v_cache, v, positions, valid)

    key_pos = jnp.arange(length)
    if cfg.qsa_enabled:
        index_cache = _scatter_rows(index_cache, k_index, positions, valid)
        allowed = selection_mask(p["indexer"], cfg, q_index, index_cache, positions, mrope)
    else:
        allowed = key_pos[None, None, :] <= positions[..., None]

    # Rows never read past their last written key: zero V there so poisoned cache slots cannot leak via 0 * NaN.
    written = key_pos[None, :] <= jnp.max(jnp.where(valid, positions, -1), axis=1)[:, None]  # [B, L]
    v_read = jnp.where(written[:, :, None, None], v_cache, 0).astype(u.dtype)
    k_read = jnp.where(written[:, :, None, None], k_cache, 0).astype(u.dtype)

    group = nh // nkv
    qh = q.reshape(bsz, t, nkv, group, hd)
    precision = "highest" if u.dtype == jnp.float32 else None
    scores = jnp.einsum("btkgd,bskd->bkgts", qh, k_read, precision=precision,
                        preferred_element_type=jnp.float32) * (hd**-0.5)
    scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
    probs = fixed_order.softmax(scores, axis=-1)
    probs = jnp.where(allowed[:, None, None], probs, 0.0).astype(u.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_read, precision=precision, preferred_element_type=jnp.float32)
    out = out.astype(u.dtype).reshape(bsz, t, nh * hd) * jax.nn.sigmoid(gate)
    return linear(out, p["o_proj"]), (k_cache, v_cache, index_cache)
