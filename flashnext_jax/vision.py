"""The Qwen3-VL style vision tower of Qwen3.8-Flash-Next as pure functions over its params (`model.visual.*`).

patches [N, 3*T*P*P] -> patch embedding (the stride = kernel Conv3d is one matmul over the flattened patch)
+ learned position embeddings (a square table, bilinearly resampled with aligned corners to each image's grid)
-> `depth` pre-LayerNorm ViT blocks whose attention is bidirectional within each image and rotated by 2-D RoPE
(row and column frequencies, each over half the head) -> the merger: LayerNorm, then every merge x merge block of
neighbouring patches (contiguous in the preprocessing order) concatenated and mapped by a 2-layer GELU MLP to the
language model's width. One output row per image pad token. The qwen4_exp tower has no deepstack outputs: only
the merger's output reaches the language model.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .layers import apply_rope, rope_inv_freq


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    in_channels: int
    hidden_act: str
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        return int(self.num_position_embeddings**0.5)


def vision_config(hf: dict) -> VisionConfig | None:
    """From config.json (the qwen4_exp wrapper); None when the checkpoint has no vision tower."""
    v = hf.get("vision_config")
    if not isinstance(v, dict):
        return None
    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"vision_config.rope_parameters.rope_type {rope['rope_type']!r}: only 'axial'")
    if v.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"vision_config.hidden_act {v['hidden_act']!r}: only 'gelu_pytorch_tanh'")
    ints = ("depth", "hidden_size", "num_heads", "intermediate_size", "patch_size", "temporal_patch_size",
            "spatial_merge_size", "out_hidden_size", "num_position_embeddings", "in_channels")
    missing = [k for k in ints if k not in v]
    if missing:
        raise ValueError(f"vision_config is missing {missing}")
    # transformers' Qwen4ExpVisionConfig default: axial RoPE with theta 10000 when rope_parameters is absent
    return VisionConfig(**{k: int(v[k]) for k in ints}, hidden_act="gelu_pytorch_tanh",
                        rope_theta=float(rope.get("rope_theta", 10000.0)))


def vision_tensor_shapes(cfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tower, by canonical name (`visual.*`, as convert.read_vision names them), and its shape
    as transformers stores it: what a checkpoint with this vision_config must hold (the converter checks it)."""
    d, i, o, m2 = cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size, cfg.spatial_merge_size ** 2
    shapes = {"visual.patch_embed.proj.weight": (d, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                                 cfg.patch_size),
              "visual.patch_embed.proj.bias": (d,),
              "visual.pos_embed.weight": (cfg.num_position_embeddings, d),
              "visual.merger.norm.weight": (d,), "visual.merger.norm.bias": (d,),
              "visual.merger.linear_fc1.weight": (d * m2, d * m2), "visual.merger.linear_fc1.bias": (d * m2,),
              "visual.merger.linear_fc2.weight": (o, d * m2), "visual.merger.linear_fc2.bias": (o,)}
    for b in range(cfg.depth):
        for name, shape in (("norm1.weight", (d,)), ("norm1.bias", (d,)), ("norm2.weight", (d,)), ("norm2.bias", (d,)),
                            ("attn.qkv.weight", (3 * d, d)), ("attn.qkv.bias", (3 * d,)),
                            ("attn.proj.weight", (d, d)), ("attn.proj.bias", (d,)),
                            ("mlp.linear_fc1.weight", (i, d)), ("mlp.linear_fc1.bias", (i,)),
                            ("mlp.linear_fc2.weight", (d, i)), ("mlp.linear_fc2.bias", (d,))):
            shapes[f"visual.blocks.{b}.{name}"] = shape
    return shapes


def load_vision_params(path: str | Path, dtype) -> tuple[VisionConfig, dict] | None:
    """(config, params) of a checkpoint's vision tower (`model.visual.*` of an HF directory, the "vision" group of a
    converted one: `convert.read_vision`), or None when it has none."""
    from convert import read_vision

    path = Path(path)
    cfg = vision_config(json.loads((path / "config.json").read_text()))
    if cfg is None:
        return None
    tensors = read_vision(str(path))
    if not tensors:
        return None
    params: dict = {}
    for name, value in tensors.items():
        node = params
        *parents, leaf = name[len("visual."):].split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = jnp.asarray(np.asarray(value, np.float32), dtype)
    params["blocks"] = [params["blocks"][str(i)] for i in range(cfg.depth)]
    w = params["patch_embed"]["proj"]["weight"]  # Conv3d [D, C, T, P, P] -> [D, C*T*P*P]
    params["patch_embed"]["proj"]["weight"] = w.reshape(w.shape[0], -1)
    return cfg, params


# ---- host-side grid tables (static per image grid) ----------------------------------------------------------
def merge_order_rows_cols(gh: int, gw: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of every patch of a gh x gw grid in the preprocessing's merge-block order."""
    rows, cols = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    shape = (gh // merge, merge, gw // merge, merge)
    return rows.reshape(shape).transpose(0, 2, 1, 3).ravel(), cols.reshape(shape).transpose(0, 2, 1, 3).ravel()


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear, aligned corners: the 2 source taps into a `side`-long axis and their weights (fp32)."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    raw = floor.astype(np.int64)[:, None] + np.arange(2)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)), 0, None)
    return np.clip(raw, 0, side - 1), weights.astype(np.float32)


def grid_tables(cfg: VisionConfig, grid_thw) -> dict[str, np.ndarray]:
    """Per-patch tables for a list of (t, gh, gw) grids: position-embedding taps [N, 4] and weights [N, 4], rotary
    (row, col) [N, 2], and the image each patch belongs to [N] (attention stays within an image and frame)."""
    taps, weights, rc, segment = [], [], [], []
    side, merge = cfg.grid_side, cfg.spatial_merge_size
    frames = 0  # frames so far: each frame of each image is its own attention segment (transformers' cu_seqlens)
    for t, gh, gw in np.asarray(grid_thw).tolist():
        if gh % merge or gw % merge:
            raise ValueError(f"image grid {gh}x{gw} is not a multiple of spatial_merge_size {merge}")
        rows, cols = merge_order_rows_cols(gh, gw, merge)
        ht, hw = _axis_taps(rows, gh, side)
        wt, ww = _axis_taps(cols, gw, side)
        taps.append(np.tile((ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4), (t, 1)))
        weights.append(np.tile((hw[:, :, None] * ww[:, None, :]).reshape(-1, 4), (t, 1)))
        rc.append(np.tile(np.stack([rows, cols], -1), (t, 1)))
        segment.append(np.repeat(np.arange(t) + frames, gh * gw))
        frames += t
    return {"taps": np.concatenate(taps), "weights": np.concatenate(weights), "rc": np.concatenate(rc),
            "segment": np.concatenate(segment)}


# ---- the tower ------------------------------------------------------------------------------------------------
def _dense(x, p):
    precision = "highest" if x.dtype == jnp.float32 else None
    y = jnp.einsum("ni,oi->no", x, p["weight"], precision=precision, preferred_element_type=jnp.float32)
    return (y + p["bias"].astype(jnp.float32)).astype(x.dtype)


def _layer_norm(x, p, eps=1e-6):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, -1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), -1, keepdims=True)
    out = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (out * p["weight"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def rotary_cos_sin(cfg: VisionConfig, rc: jax.Array) -> tuple[jax.Array, jax.Array]:
    """2-D RoPE cos/sin [N, head_dim] fp32: the same frequencies for rows (first quarter) and columns (second),
    the whole repeated (rotate_half layout)."""
    spatial = cfg.head_dim // 2
    freqs = rc.astype(jnp.float32)[:, :, None] * rope_inv_freq(spatial, cfg.rope_theta)  # [N, 2, spatial/2]
    emb = jnp.concatenate([freqs[:, 0], freqs[:, 1]], -1)
    emb = jnp.concatenate([emb, emb], -1)
    return jnp.cos(emb), jnp.sin(emb)


def _rotate(x, cos, sin):
    """RoPE over the whole head in fp32 (cos/sin [N, head_dim], broadcast over the heads of x [N, heads, hd])."""
    return apply_rope(x.astype(jnp.float32), cos[:, None], sin[:, None]).astype(x.dtype)


def attention(p: dict, cfg: VisionConfig, x, cos, sin, same_image):
    n = x.shape[0]
    qkv = _dense(x, p["qkv"]).reshape(n, 3, cfg.num_heads, cfg.head_dim)
    q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
    precision = "highest" if x.dtype == jnp.float32 else None
    scores = jnp.einsum("qhd,khd->hqk", q, k, precision=precision, preferred_element_type=jnp.float32)
    scores = jnp.where(same_image[None], scores * cfg.head_dim**-0.5, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("hqk,khd->qhd", probs, v, precision=precision, preferred_element_type=jnp.float32)
    return _dense(out.astype(x.dtype).reshape(n, -1), p["proj"])


def block(p: dict, cfg: VisionConfig, x, cos, sin, same_image):
    x = x + attention(p["attn"], cfg, _layer_norm(x, p["norm1"]), cos, sin, same_image)
    h = jax.nn.gelu(_dense(_layer_norm(x, p["norm2"]), p["mlp"]["linear_fc1"]), approximate=True)
    return x + _dense(h, p["mlp"]["linear_fc2"])


def merger(p: dict, cfg: VisionConfig, x):
    x = _layer_norm(x, p["norm"]).reshape(-1, cfg.hidden_size * cfg.spatial_merge_size**2)
    return _dense(jax.nn.gelu(_dense(x, p["linear_fc1"]), approximate=False), p["linear_fc2"])


@partial(jax.jit, static_argnames=("cfg",))
def vision_forward(params: dict, cfg: VisionConfig, pixel_values, taps, weights, rc, segment):
    """pixel_values [N, 3*T*P*P] (+ grid_tables' arrays) -> image embeddings [N / merge^2, out_hidden_size]."""
    dtype = params["pos_embed"]["weight"].dtype
    x = _dense(pixel_values.astype(dtype), params["patch_embed"]["proj"])
    pos = jnp.sum(params["pos_embed"]["weight"][taps].astype(jnp.float32) * weights[:, :, None], axis=1)
    x = x + pos.astype(dtype)
    cos, sin = rotary_cos_sin(cfg, rc)
    same_image = segment[:, None] == segment[None, :]
    for bp in params["blocks"]:
        x = block(bp, cfg, x, cos, sin, same_image)
    return merger(params["merger"], cfg, x)


def image_embeddings(params: dict, cfg: VisionConfig, pixel_values: np.ndarray, grid_thw) -> jax.Array:
    """The tower over preprocessed images (vision_preprocess.preprocess_images' output)."""
    tables = grid_tables(cfg, grid_thw)
    if pixel_values.shape[0] != tables["segment"].shape[0]:
        raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, image_grid_thw describes "
                         f"{tables['segment'].shape[0]}")
    return vision_forward(params, cfg, jnp.asarray(pixel_values), *(jnp.asarray(tables[k]) for k in
                                                                     ("taps", "weights", "rc", "segment")))
