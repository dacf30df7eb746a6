"""Multimodal RoPE (MRoPE): 3-D (temporal, height, width) positions for prompts with images.

Text tokens have the same position on all three axes (so text-only prompts are plain RoPE and never come here).
An image's pad tokens are laid out on its merged grid, gh/merge x gw/merge: (start, start + row, start + col),
where `start` is the position after the preceding token; the text after the image resumes at
start + max(gh, gw)/merge. A prompt therefore spans fewer positions than tokens; every later token p (decode steps
included) sits at p + rope_delta on all three axes, rope_delta = (largest position + 1) - prompt length <= 0.

The rotary frequencies are interleaved over the axes (`mrope_interleaved`): frequency j uses the height position
when j % 3 == 1 and j < 3 * mrope_section[1], the width position when j % 3 == 2 and j < 3 * mrope_section[2],
else the temporal one.

Two equal descriptions of the same layout: `position_table` (the one-shot path: every cache index of a row, [3, L])
and `SpanRope` (the engine: per image a span (start index, t, h, w), a few ints per slot, from which any index's
position is computed on the device, so a decode step at any context length needs no table).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .layers import rope_inv_freq


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MRope:
    """The 3-D position of every cache index of each row, table [B, 3, L] int32 (prompt, then p + rope_delta)."""

    table: jax.Array
    section: tuple[int, int, int] = dataclasses.field(metadata=dict(static=True))

    def at(self, index: jax.Array) -> jax.Array:
        """3-D positions [..., 3] of cache indices index [B, ...] (clamped into the table)."""
        b, _, length = self.table.shape
        flat = jnp.clip(index.reshape(b, -1), 0, length - 1)
        rows = jnp.take_along_axis(self.table, flat[:, None, :], axis=2)  # [B, 3, n]
        return jnp.moveaxis(rows, 1, -1).reshape(*index.shape, 3)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpanRope:
    """3-D positions computed from each row's image spans [B, M, 4] int32: (first pad index, merged t, h, w) per
    image in prompt order, unused entries all zero (a row of zeros is a text row: position = index)."""

    spans: jax.Array
    section: tuple[int, int, int] = dataclasses.field(metadata=dict(static=True))

    def at(self, index: jax.Array) -> jax.Array:
        """3-D positions [..., 3] of cache indices index [B, ...] (the same as `prompt_positions` / the table)."""
        b = index.shape[0]
        i = index.reshape(b, -1)[:, :, None]  # [B, n, 1]
        first, lt, lh, lw = (self.spans[:, None, :, c] for c in range(4))  # [B, 1, M]
        size = lt * lh * lw
        shift = jnp.maximum(lh, lw) - size  # how far the counter falls behind the index over the image (<= 0)
        start = first + jnp.cumsum(shift, axis=-1) - shift  # the counter at the image's first pad
        delta = jnp.sum(jnp.where(first + size <= i, shift, 0), axis=-1)  # images wholly before the index
        inside = (first <= i) & (i < first + size)
        local = i - first
        plane = jnp.maximum(lh * lw, 1)
        grid = jnp.stack([local // plane, local % plane // jnp.maximum(lw, 1), local % jnp.maximum(lw, 1)], -1)
        in_image = jnp.sum(jnp.where(inside[..., None], start[..., None] + grid, 0), axis=2)  # [B, n, 3]
        text = jnp.broadcast_to((i[:, :, 0] + delta)[..., None], in_image.shape)
        pos = jnp.where(jnp.any(inside, axis=-1)[..., None], in_image, text)
        return pos.reshape(*index.shape, 3)


def image_spans(token_ids, grid_thw, image_token_id: int, merge: int, max_images: int) -> np.ndarray:
    """[max_images, 4] int32 spans (first pad index, t, gh/merge, gw/merge) of a prompt's images (SpanRope)."""
    ids = np.asarray(token_ids)
    grids = np.asarray(grid_thw).reshape(-1, 3)
    if len(grids) > max_images:
        raise ValueError(f"{len(grids)} images in one prompt; at most {max_images}")
    prompt_positions(ids, grids, image_token_id, merge)  # the runs must fit the grids (a clear error if not)
    is_image = (ids == image_token_id).astype(np.int8)
    firsts = np.nonzero(np.diff(np.concatenate([[0], is_image])) == 1)[0]
    if len(firsts) != len(grids):
        raise ValueError(f"{len(grids)} images but {len(firsts)} image-token runs in the prompt")
    out = np.zeros((max_images, 4), np.int32)
    for j, (a, (t, gh, gw)) in enumerate(zip(firsts, grids.tolist())):
        out[j] = (a, t, gh // merge, gw // merge)
    return out


def section_of(hf_text_config: dict) -> tuple[int, int, int]:
    """mrope_section from the text config's rope_parameters (interleaved layout required)."""
    rope = hf_text_config.get("rope_parameters") or {}
    section = rope.get("mrope_section")
    if section is None or len(section) != 3:
        raise ValueError("text_config.rope_parameters.mrope_section (3 integers) is required for image input")
    if not rope.get("mrope_interleaved", False):
        raise ValueError("text_config.rope_parameters.mrope_interleaved is false: only the interleaved layout")
    return tuple(int(s) for s in section)


def axis_of_frequency(section: tuple[int, int, int], n_freq: int) -> np.ndarray:
    """Which position axis (0 t, 1 h, 2 w) drives each rotary frequency."""
    j = np.arange(n_freq)
    return np.where((j % 3 == 1) & (j < 3 * section[1]), 1, np.where((j % 3 == 2) & (j < 3 * section[2]), 2, 0))


def mrope_cos_sin(pos3: jax.Array, section: tuple[int, int, int], rotary_dim: int, theta: float, dtype):
    """cos/sin [..., rotary_dim] for 3-D positions pos3 [..., 3] (NeoX layout, like layers.rope_cos_sin)."""
    inv = rope_inv_freq(rotary_dim, theta)
    freqs = pos3.astype(jnp.float32)[..., :, None] * inv  # [..., 3, F]
    n = inv.shape[0]
    freqs = freqs[..., axis_of_frequency(section, n), np.arange(n)]  # [..., F]: each frequency's own axis
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def prompt_positions(token_ids, grid_thw, image_token_id: int, merge: int) -> tuple[np.ndarray, int]:
    """(positions [3, T] int64, rope_delta) of a prompt whose images are runs of image_token_id, in grid order."""
    ids = np.asarray(token_ids)
    grids = [tuple(int(x) for x in g) for g in np.asarray(grid_thw).reshape(-1, 3)]
    pos = np.zeros((3, len(ids)), np.int64)
    is_image = ids == image_token_id
    i, current, image = 0, 0, 0
    while i < len(ids):
        j = i
        while j < len(ids) and is_image[j] == is_image[i]:
            j += 1
        if not is_image[i]:
            pos[:, i:j] = current + np.arange(j - i)
            current += j - i
        else:
            if image >= len(grids):
                raise ValueError("the prompt has more image-token runs than images")
            t, gh, gw = grids[image]
            lt, lh, lw = t, gh // merge, gw // merge
            if j - i != lt * lh * lw:
                raise ValueError(f"image {image}: {j - i} pad tokens in a run, its grid needs {lt * lh * lw}")
            tt, hh, ww = np.meshgrid(np.arange(lt), np.arange(lh), np.arange(lw), indexing="ij")
            pos[:, i:j] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + current
            current += max(gh, gw) // merge
            image += 1
        i = j
    if image != len(grids):
        raise ValueError(f"{len(grids)} images but {image} image-token runs in the prompt")
    return pos, int(pos.max()) + 1 - len(ids)


def position_table(positions: np.ndarray, rope_delta: int, length: int) -> np.ndarray:
    """[3, length] int32: the prompt's positions, then index + rope_delta for every later cache index."""
    t = positions.shape[1]
    if length < t:
        raise ValueError(f"table length {length} is shorter than the prompt ({t})")
    later = np.arange(t, length) + rope_delta
    return np.concatenate([positions, np.broadcast_to(later, (3, length - t))], axis=1).astype(np.int32)
