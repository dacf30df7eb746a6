"""The Qwen3.8-Flash-Next text model as pure functions over a params pytree and a per-row state pytree.

`forward(params, cfg, batch, state)` runs T new tokens for each of B rows (right-padded; row b has `n_valid[b]`
real tokens starting at absolute position `start[b]`) on top of that row's state, and returns logits, the
pre-final-mixer hyper state (the MTP head reads it) and the new state. Prefill and decode are the same function
with different T; `prefill`/`decode_step` in `api.py` jit it with the state donated.

Params are nested dicts mirroring the checkpoint names (`params["layers"][3]["self_attn"]["q_proj"]`), linear
weights stored [in, out] (plain arrays or `QuantizedWeight`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from .config import GDN, ModelConfig
from .gdn import gdn_forward
from .hyper import hyper_read, hyper_write
from .layers import linear
from .moe import moe_forward
from .ple import ple_forward
from .qsa import qsa_forward


@struct.dataclass
class State:
    """Per-row decode state. Leading axes: layer-of-kind, then row. KV caches are dense per row ([B, L, ...])."""

    gdn_conv: jax.Array  # [n_gdn, B, K-1, conv_dim]
    gdn_rec: jax.Array  # [n_gdn, B, Hv, Dk, Dv] fp32
    kv_k: jax.Array  # [n_qsa, B, L, kv_heads, head_dim]
    kv_v: jax.Array  # [n_qsa, B, L, kv_heads, head_dim]
    kv_index: jax.Array  # [n_qsa, B, L, indexer_head_dim]
    ple_conv: jax.Array  # [n_ple, B, 9, S*H]


@struct.dataclass
class Batch:
    tokens: jax.Array  # [B, T] int32
    start: jax.Array  # [B] int32: tokens already in this row's state
    n_valid: jax.Array  # [B] int32: real tokens in this row (the rest is right padding)
    ple_rows: jax.Array  # [n_ple, B, T, E]: host-gathered n-gram rows (zeros where padding)


def init_state(cfg: ModelConfig, batch: int, max_len: int, dtype) -> State:
    ratio = cfg.indexer_compress_ratio or 1
    max_len = -(-max_len // ratio) * ratio
    n_g, n_q, n_p = len(cfg.gdn_layers), len(cfg.qsa_layers), len(cfg.ple_layers)
    d_index = cfg.indexer_head_dim or 1
    return State(
        gdn_conv=jnp.zeros((n_g, batch, cfg.linear_conv_kernel_dim - 1, cfg.gdn_conv_dim), dtype),
        gdn_rec=jnp.zeros(
            (n_g, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), jnp.float32
        ),
        kv_k=jnp.zeros((n_q, batch, max_len, cfg.num_key_value_heads, cfg.head_dim), dtype),
        kv_v=jnp.zeros((n_q, batch, max_len, cfg.num_key_value_heads, cfg.head_dim), dtype),
        kv_index=jnp.zeros((n_q, batch, max_len, d_index), dtype),
        ple_conv=jnp.zeros((n_p, batch, cfg.ple_conv_state_len, cfg.hc_hidden_size), dtype),
    )


def decoder_layer(lp: dict, cfg: ModelConfig, layer: int, x, batch: Batch, positions, valid, state: State, slots):
    """One decoder layer: (PLE) -> read -> GDN|QSA -> write -> read -> MoE -> write. Returns (x, state)."""
    gdn_i, qsa_i, ple_i = slots
    if "ple" in lp:
        delta, new_conv = ple_forward(lp["ple"], cfg, x, batch.ple_rows[ple_i], state.ple_conv[ple_i], valid,
                                      batch.n_valid)
        x = x + delta
        state = state.replace(ple_conv=state.ple_conv.at[ple_i].set(new_conv))

    u, gains = hyper_read(lp["attn_hyper_connection"], cfg, x)
    if cfg.layer_types[layer] == GDN:
        y, conv, rec = gdn_forward(lp["linear_attn"], cfg, u, state.gdn_conv[gdn_i], state.gdn_rec[gdn_i], valid,
                                   batch.n_valid)
        state = state.replace(gdn_conv=state.gdn_conv.at[gdn_i].set(conv), gdn_rec=state.gdn_rec.at[gdn_i].set(rec))
    else:
        cache = (state.kv_k[qsa_i], state.kv_v[qsa_i], state.kv_index[qsa_i])
        y, (kk, vv, ii) = qsa_forward(lp["self_attn"], cfg, u, positions, valid, cache)
        state = state.replace(
            kv_k=state.kv_k.at[qsa_i].set(kk), kv_v=state.kv_v.at[qsa_i].set(vv),
            kv_index=state.kv_index.at[qsa_i].set(ii),
        )
    x = hyper_write(x, y, gains)

    u, gains = hyper_read(lp["mlp_hyper_connection"], cfg, x)
    x = hyper_write(x, moe_forward(lp["mlp"], cfg, u), gains)
    return x, state


def forward_hidden(params: dict, cfg: ModelConfig, batch: Batch, state: State):
    """Embeddings through all decoder layers -> (pre-final-mixer hyper state [B, T, S*H], new state)."""
    t = batch.tokens.shape[1]
    positions = batch.start[:, None] + jnp.arange(t)[None, :]
    valid = jnp.arange(t)[None, :] < batch.n_valid[:, None]
    emb = embed(params, batch.tokens)
    x = jnp.tile(emb, (1, 1, cfg.hc_count))
    gdn_i = qsa_i = ple_i = 0
    for layer, lp in enumerate(params["layers"]):
        x, state = decoder_layer(lp, cfg, layer, x, batch, positions, valid, state, (gdn_i, qsa_i, ple_i))
        gdn_i += cfg.layer_types[layer] == GDN
        qsa_i += cfg.layer_types[layer] != GDN
        ple_i += "ple" in lp
    return x, state


def embed(params: dict, tokens: jax.Array) -> jax.Array:
    table = params["embed_tokens"]
    if isinstance(table, jax.Array):
        return table[tokens]
    from pallas_kernels.quant_layout import dequantize_columns  # quantized embedding [K=H, N=V]

    return dequantize_columns(table, tokens)


def final_logits(params: dict, cfg: ModelConfig, hyper: jax.Array, mixer: dict | None = None) -> jax.Array:
    """Final mixer (gated read, no write) and lm_head -> fp32 logits."""
    from .hyper import hyper_read as read

    u, _ = read(params["hyper_connection_mixer"] if mixer is None else mixer, cfg, hyper)
    return linear(u, params["lm_head"]).astype(jnp.float32)


def forward(params: dict, cfg: ModelConfig, batch: Batch, state: State, logits_last_only: bool = False):
    """-> (logits [B, T or 1, V] fp32, hyper [B, T, S*H], new state)."""
    hyper, state = forward_hidden(params, cfg, batch, state)
    if logits_last_only:
        idx = jnp.maximum(batch.n_valid - 1, 0)
        sel = jnp.take_along_axis(hyper, idx[:, None, None], axis=1)
        return final_logits(params, cfg, sel), hyper, state
    return final_logits(params, cfg, hyper), hyper, state
