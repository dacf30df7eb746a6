"""MTP head: one extra full-attention (QSA) layer that drafts the token after next.

Follows SGLang/vLLM (transformers has no MTP): at position p it combines the main model's pre-final-mixer hyper
state h_p with the embedding of token p+1, runs one QSA decoder layer (own KV/index cache, RoPE position p, no PLE)
and reads logits through its own final mixer and the shared lm_head. Chained drafts feed the layer's output
(pre-mixer) back as h.

Image prompts (transformers has no MTP head; this follows vLLM's drafter for the multimodal Qwen3.5 MTP, which
passes the target's MRoPE positions and reads multimodal embeddings one position ahead): the layer reads its inputs
as the main model does. Its RoPE position p is the main model's 3-D (MRoPE)
position of cache index p (an image's pads on their grid, p + rope_delta after the images), and the embedding of a
next token that is an image pad is the vision tower's row for it, not the pad's token embedding.
"""

from __future__ import annotations

import jax.numpy as jnp

from .config import ModelConfig
from .hyper import hyper_read, hyper_write
from .layers import linear, rms_norm
from .model import embed_inputs, final_logits
from .mrope import MRope
from .moe import moe_forward
from .qsa import qsa_forward


def init_mtp_cache(cfg: ModelConfig, batch: int, max_len: int, dtype):
    ratio = cfg.indexer_compress_ratio or 1
    max_len = -(-max_len // ratio) * ratio
    kv = jnp.zeros((batch, max_len, cfg.num_key_value_heads, cfg.head_dim), dtype)
    return kv, kv, jnp.zeros((batch, max_len, cfg.indexer_head_dim or 1), dtype)


def mtp_input(params: dict, cfg: ModelConfig, hyper, next_tokens, image_embeds=None, image_mask=None):
    """The layer's input X0 [B, T, S*H] from hyper [B, T, S*H] and the embeddings of next_tokens [B, T] (image_embeds
    [B, T, H] instead where image_mask [B, T]: pads)."""
    mp = params["mtp"]
    s, h = cfg.hc_count, cfg.hidden_size
    bsz, t, _ = hyper.shape
    h_normed = rms_norm(hyper, mp["pre_fc_norm_hidden"], cfg.rms_norm_eps)  # ONE norm over all S*H features
    e_normed = rms_norm(embed_inputs(params, next_tokens, image_embeds, image_mask).astype(hyper.dtype),
                        mp["pre_fc_norm_embedding"], cfg.rms_norm_eps)
    x = linear(h_normed.reshape(bsz, t, s, h), mp["fc_hidden"]) + linear(e_normed, mp["fc_embedding"])[:, :, None]
    return x.reshape(bsz, t, s * h)


def attention_input(params: dict, cfg: ModelConfig, x):
    """What the layer's attention reads from X0: u [B, T, H] (all a cache fold needs: mtp_paged.py)."""
    return hyper_read(params["mtp"]["layers"][0]["attn_hyper_connection"], cfg, x)[0]


def mtp_layer(params: dict, cfg: ModelConfig, x, attention):
    """The decoder layer on X0 with `attention(layer params, u) -> (y, cache)` (dense `qsa_forward` here, the paged
    draft attention in mtp_paged.py) -> (logits [B, T, V] fp32, layer output [B, T, S*H], cache)."""
    mp = params["mtp"]
    lp = mp["layers"][0]
    u, gains = hyper_read(lp["attn_hyper_connection"], cfg, x)
    y, cache = attention(lp["self_attn"], u)
    x = hyper_write(x, y, gains)
    u, gains = hyper_read(lp["mlp_hyper_connection"], cfg, x)
    x = hyper_write(x, moe_forward(lp["mlp"], cfg, u), gains)
    return final_logits(params, cfg, x, mixer=mp["hyper_connection_mixer"]), x, cache


def mtp_forward(params: dict, cfg: ModelConfig, hyper, next_tokens, start, n_valid, cache,
                mrope: MRope | None = None, image_embeds=None, image_mask=None):
    """hyper [B, T, S*H] at positions start..; next_tokens [B, T] = the token after each position.

    Image input: `mrope` (an mrope.MRope table or SpanRope spans) gives the positions' 3-D rotary positions, and
    image_embeds [B, T, H] replace the embeddings of next tokens where image_mask [B, T] (pads).
    Returns (draft logits [B, T, V] fp32, layer output [B, T, S*H] for chaining, new cache).
    """
    t = hyper.shape[1]
    positions = start[:, None] + jnp.arange(t)[None, :]
    valid = jnp.arange(t)[None, :] < n_valid[:, None]
    x = mtp_input(params, cfg, hyper, next_tokens, image_embeds, image_mask)
    return mtp_layer(params, cfg, x, lambda p, u: qsa_forward(p, cfg, u, positions, valid, cache, mrope))


__all__ = ["mtp_forward", "mtp_input", "mtp_layer", "attention_input", "init_mtp_cache"]
