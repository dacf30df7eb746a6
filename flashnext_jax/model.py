"""The Qwen3.8-Flash-Next text model as pure functions over a params pytree and a per-row state pytree.

`forward(params, cfg, batch, state)` runs T new tokens for each of B rows (right-padded; row b has `n_valid[b]`
real tokens starting at absolute position `start[b]`) on top of that row's state, and returns logits, the
pre-final-mixer hyper state (the MTP head reads it) and the new state. Prefill and decode are the same function
with different T; `prefill`/`decode_step` in `api.py` jit it with the state donated.

Params are nested dicts mirroring the checkpoint names (`params["layers"][3]["self_attn"]["q_proj"]`); linear
weights are plain arrays in torch's [out, in] or `QuantizedWeight`s [in, out] (`layers.linear` takes both).
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
from .mrope import MRope
from .ple import ple_forward
from .qsa import qsa_forward
from .qsa_paged import qsa_paged_forward


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
    # image input (None for text): vision-tower rows replacing the embeddings where image_mask, 3-D rotary positions
    image_embeds: jax.Array | None = None  # [B, T, H]
    image_mask: jax.Array | None = None  # [B, T] bool
    mrope: MRope | None = None


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


def layer_state_index(cfg: ModelConfig, layer: int, first: int = 0) -> dict[str, int]:
    """The `State` fields decoder layer `layer` owns -> its index along their leading layer-of-kind axis.

    A GDN layer owns gdn_conv/gdn_rec, a QSA layer kv_k/kv_v/kv_index, and a PLE layer also its ple_conv. The
    index is stage-local: it counts only the layers of that kind in [first, layer), so a pipeline stage that
    starts at layer `first` holds just its own layers' states (first = 0: the whole model).
    """
    def local(kind_layers):
        return sum(1 for x in kind_layers if first <= x < layer)

    if cfg.layer_types[layer] == GDN:
        i = local(cfg.gdn_layers)
        index = {"gdn_conv": i, "gdn_rec": i}
    else:
        i = local(cfg.qsa_layers)
        index = {"kv_k": i, "kv_v": i, "kv_index": i}
    if layer in cfg.ple_layers:
        index["ple_conv"] = local(cfg.ple_layers)
    return index


def layer_counts(cfg: ModelConfig, layers: range) -> dict[str, int]:
    """How many GDN, QSA and PLE layers a range of decoder layers holds (a stage's share of the state)."""
    return {"gdn": sum(1 for x in cfg.gdn_layers if x in layers), "qsa": sum(1 for x in cfg.qsa_layers if x in layers),
            "ple": sum(1 for x in cfg.ple_layers if x in layers)}


def decoder_layer(lp: dict, cfg: ModelConfig, layer: int, x, ple_rows, positions, valid, n_valid, layer_state: dict,
                  ends=None, mrope=None):
    """One decoder layer: (PLE) -> read -> GDN|QSA -> write -> read -> MoE -> write. Returns (x, new layer_state).

    `layer_state` holds this layer's own state under its `State` field names (see `layer_state_index`), so the
    caller decides where states live: `forward_hidden` slices a dense `State`, the runner passes per-row states
    gathered from the store. With `ends` [B, K1] (token counts) the GDN and PLE states come back per checkpoint
    column (a leading K1 axis after the row axis) instead of after each row's last valid token; the QSA caches
    always come back whole, with this step's keys written at `positions`. A QSA layer given `qsa_pages` (a
    `qsa_paged.PagedKV`) instead of dense caches reads and writes the store's pages and returns the PagedKV.
    `mrope` (image input: an `mrope.MRope` table or, in the engine, `mrope.SpanRope` spans) gives the QSA layers
    3-D rotary positions, on either path.
    """
    new = {}
    # The named scopes only label the compiled program's ops (profiles group GPU time by them: bench/device_profile.py).
    if layer in cfg.ple_layers:
        with jax.named_scope("ple"):
            delta, new["ple_conv"] = ple_forward(lp["ple"], cfg, x, ple_rows, layer_state["ple_conv"], valid,
                                                 n_valid, ends)
        x = x + delta

    with jax.named_scope("hyper"):
        u, gains = hyper_read(lp["attn_hyper_connection"], cfg, x)
    if cfg.layer_types[layer] == GDN:
        with jax.named_scope("gdn"):
            y, new["gdn_conv"], new["gdn_rec"] = gdn_forward(lp["linear_attn"], cfg, u, layer_state["gdn_conv"],
                                                             layer_state["gdn_rec"], valid, n_valid, ends,
                                                             start=positions[:, 0])
    elif "qsa_pages" in layer_state:  # the engine's paged store, read and written in place (qsa_paged.py)
        with jax.named_scope("qsa"):
            y, new["qsa_pages"] = qsa_paged_forward(lp["self_attn"], cfg, u, positions, valid,
                                                    layer_state["qsa_pages"], mrope)
    else:
        cache = (layer_state["kv_k"], layer_state["kv_v"], layer_state["kv_index"])
        with jax.named_scope("qsa"):
            y, (new["kv_k"], new["kv_v"], new["kv_index"]) = qsa_forward(lp["self_attn"], cfg, u, positions, valid,
                                                                         cache, mrope)
    with jax.named_scope("hyper"):
        x = hyper_write(x, y, gains)
        u, gains = hyper_read(lp["mlp_hyper_connection"], cfg, x)
    with jax.named_scope("moe"):
        y = moe_forward(lp["mlp"], cfg, u)
    with jax.named_scope("hyper"):
        x = hyper_write(x, y, gains)
    return x, new


def decoder_stack(layer_params, cfg: ModelConfig, layers: range, x, ple_rows, positions, valid, n_valid,
                  state: dict, ends=None, keep=None, mrope=None):
    """Decoder layers `layers` (a pipeline stage; range(num_layers) = the whole model) -> (x, new state).

    `layer_params` iterates the params of exactly these layers, in order. `state[name]` has the stage-local
    layer-of-kind axis first (`layer_state_index(cfg, layer, layers.start)`); `ple_rows` is indexed the same way
    ([n_ple_local, B, T, E]). The new state comes back in that layout, one entry per layer of the kind, after
    `keep(name, a)` (default: keep all) trims a layer's output (the engine keeps only this step's K/V tokens).
    A `gdn_rec` that is a `gdn.StoreRecState` (the engine's in-place kernel path) is threaded through the GDN
    layers instead: each layer's kernels update the store leaf, and the last leaf comes back as `new["gdn_rec"]`;
    a `qsa_pages` (`qsa_paged.PagedKV`, the engine's paged K/V/index store) likewise through the QSA layers, each
    reading and writing its layer of the pages in place, and comes back as `new["qsa_pages"]`.
    """
    keep = keep or (lambda name, a: a)
    rec = state.get("gdn_rec")
    in_place = rec is not None and not isinstance(rec, jax.Array)
    pages = state.get("qsa_pages")  # the engine's paged K/V/index store (qsa_paged.PagedKV), threaded like rec
    new: dict[str, list] = {}
    for layer, lp in zip(layers, layer_params, strict=True):
        index = layer_state_index(cfg, layer, layers.start)
        rows = ple_rows[index["ple_conv"]] if "ple_conv" in index else None
        layer_state = {name: state[name][i] for name, i in index.items()
                       if name in state and (name != "gdn_rec" or not in_place)}
        if in_place and "gdn_rec" in index:
            layer_state["gdn_rec"] = rec._replace(layer=index["gdn_rec"])
        if pages is not None and "kv_k" in index:
            layer_state["qsa_pages"] = pages._replace(layer=index["kv_k"])
        x, layer_state = decoder_layer(lp, cfg, layer, x, rows, positions, valid, n_valid, layer_state, ends, mrope)
        if in_place and "gdn_rec" in layer_state:
            rec = layer_state.pop("gdn_rec")
        if "qsa_pages" in layer_state:
            pages = layer_state.pop("qsa_pages")
        for name, a in layer_state.items():
            new.setdefault(name, []).append(keep(name, a))
    out = {name: jnp.stack(a) for name, a in new.items()}
    if in_place:
        out["gdn_rec"] = rec.leaf
    if pages is not None:
        out["qsa_pages"] = pages
    return x, out


def embed_inputs(params: dict, tokens: jax.Array, image_embeds: jax.Array | None = None,
                 image_mask: jax.Array | None = None) -> jax.Array:
    """Input embeddings [B, T, H]: the token embeddings, with image input the vision tower's rows image_embeds
    [B, T, H] where image_mask [B, T] (the pads). The main model and the MTP head both read their tokens so."""
    rows = embed(params, tokens)
    if image_embeds is not None:
        rows = jnp.where(image_mask[..., None], image_embeds.astype(rows.dtype), rows)
    return rows


def embed_hyper(params: dict, cfg: ModelConfig, tokens: jax.Array, image_embeds: jax.Array | None = None,
                image_mask: jax.Array | None = None) -> jax.Array:
    """Input embeddings (`embed_inputs`) widened to the hc_count-stream hyper state [B, T, S*H] the decoder layers
    carry (PLE still hashes the pad ids)."""
    return jnp.tile(embed_inputs(params, tokens, image_embeds, image_mask), (1, 1, cfg.hc_count))


def forward_hidden(params: dict, cfg: ModelConfig, batch: Batch, state: State):
    """Embeddings through all decoder layers -> (pre-final-mixer hyper state [B, T, S*H], new state)."""
    t = batch.tokens.shape[1]
    positions = batch.start[:, None] + jnp.arange(t)[None, :]
    valid = jnp.arange(t)[None, :] < batch.n_valid[:, None]
    x = embed_hyper(params, cfg, batch.tokens, batch.image_embeds, batch.image_mask)
    fields = {f: getattr(state, f) for f in ("gdn_conv", "gdn_rec", "kv_k", "kv_v", "kv_index", "ple_conv")}
    x, new = decoder_stack(params["layers"], cfg, range(cfg.num_hidden_layers), x, batch.ple_rows, positions, valid,
                           batch.n_valid, fields, mrope=batch.mrope)
    return x, state.replace(**new)


def embed(params: dict, tokens: jax.Array) -> jax.Array:
    """Token embeddings in the model's activation dtype.

    A quantized table is dequantized to float32 rows; they are cast to the dtype of the (always unquantized)
    final mixer norm, i.e. the dtype the checkpoint was loaded in. Without the cast a bf16 load of a quantized
    checkpoint would run every layer in float32, which `linear` sends to the exact reference path instead of
    the kernels (measured: 27 ms per real-size decode step on the H200,
    bench/results/decode_step_before_embed_fix.json; 11 ms with the cast, bench/results/decode_step.json)."""
    table = params["embed_tokens"]
    if isinstance(table, jax.Array):
        return table[tokens]
    from pallas_kernels.quant_layout import dequantize_columns  # quantized embedding [K=H, N=V]

    return dequantize_columns(table, tokens).astype(params["hyper_connection_mixer"]["hc_norm"].dtype)


def final_logits(params: dict, cfg: ModelConfig, hyper: jax.Array, mixer: dict | None = None) -> jax.Array:
    """Final mixer (gated read, no write) and lm_head -> fp32 logits."""
    u, _ = hyper_read(params["hyper_connection_mixer"] if mixer is None else mixer, cfg, hyper)
    return linear(u, params["lm_head"]).astype(jnp.float32)


def forward(params: dict, cfg: ModelConfig, batch: Batch, state: State, logits_last_only: bool = False):
    """-> (logits [B, T or 1, V] fp32, hyper [B, T, S*H], new state)."""
    hyper, state = forward_hidden(params, cfg, batch, state)
    if logits_last_only:
        idx = jnp.maximum(batch.n_valid - 1, 0)
        sel = jnp.take_along_axis(hyper, idx[:, None, None], axis=1)
        return final_logits(params, cfg, sel), hyper, state
    return final_logits(params, cfg, hyper), hyper, state
