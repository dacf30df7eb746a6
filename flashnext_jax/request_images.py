"""A request's images as the engine carries them: the vision tower's rows, the MRoPE spans and content hashes.

Why a record per request: the tower runs once, as its own jitted program, before the request's prefill (the
server runs it on a worker thread, off the engine's lock: `Engine.encode_images`), and its rows stay with the
request. Every prefill chunk (a chunk may split an image, a
preemption recomputes the prompt) takes the rows of the pads it covers from here; no batch row ever holds them
beyond its step. The spans go into the request's slot (`RealRunner`'s `mrope_spans` leaf, written by the ledger
when the slot is allocated), so every later step, decodes included, computes its 3-D positions from the slot.

The prefix cache keys a prefix by its tokens and, when the prefix holds pads of some images, by those images'
content hashes too (`prefix_salt`): the same text with other pixels never shares state.
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax.numpy as jnp
import numpy as np

from .mrope import image_spans


@dataclasses.dataclass(frozen=True)
class RequestImages:
    """embeds [pads, H] (prompt order, on the host), pad_index [pads] (their prompt positions), spans [M, 4]
    (mrope.SpanRope), per image (first pad index, blake2b of its grid and pixels) for the prefix keys, and the
    digest of the prompt they were encoded for (`prompt_digest`: the engine refuses them for another prompt)."""

    embeds: np.ndarray
    pad_index: np.ndarray
    spans: np.ndarray
    hashes: tuple[tuple[int, bytes], ...]
    prompt: bytes

    def prefix_salt(self, length: int) -> bytes:
        """The content hashes of the images whose pads start within the first `length` tokens."""
        return b"".join(h for first, h in self.hashes if first < length)

    def rows_for(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(row offsets within tokens [start, start + n), their embeddings) of the pads that range covers."""
        lo, hi = np.searchsorted(self.pad_index, [start, start + n])
        return self.pad_index[lo:hi] - start, self.embeds[lo:hi]


def prompt_digest(prompt) -> bytes:
    """What RequestImages.prompt holds for a prompt of token ids."""
    return hashlib.blake2b(np.asarray(prompt, np.int64).tobytes(), digest_size=16).digest()


def patch_bucket(n: int, merge: int) -> int:
    """Patches the tower runs for n real ones: a power of two of merge^2 groups (one compile per bucket)."""
    groups = -(-n // (merge * merge))
    return (1 << max(0, (groups - 1).bit_length())) * merge * merge


def bucketed_embeddings(tower, pixel_values: np.ndarray, grid_thw: np.ndarray) -> np.ndarray:
    """The tower's rows [n / merge^2, H] for the real patches, run at `patch_bucket` patches: the padding patches
    form a segment of their own (attention stays within a segment), so they never reach a real patch's row."""
    from .vision import grid_tables, vision_forward

    cfg = tower.cfg
    merge = cfg.spatial_merge_size
    tables = grid_tables(cfg, grid_thw)
    n = pixel_values.shape[0]
    if n != tables["segment"].shape[0]:
        raise ValueError(f"pixel_values has {n} patches, image_grid_thw describes {tables['segment'].shape[0]}")
    pad = patch_bucket(n, merge) - n

    def padded(a, fill=0):
        return np.concatenate([a, np.full((pad, *a.shape[1:]), fill, a.dtype)])
    rows = vision_forward(tower.params, cfg, jnp.asarray(padded(pixel_values)), jnp.asarray(padded(tables["taps"])),
                          jnp.asarray(padded(tables["weights"])), jnp.asarray(padded(tables["rc"])),
                          jnp.asarray(padded(tables["segment"], -1)))
    return np.asarray(rows[: n // (merge * merge)])


def encode_images(tower, prompt, images, dtype, max_images: int) -> RequestImages:
    """A prompt with expanded pads (api.Model.image_prompt) and its ImageInput -> the request's RequestImages."""
    ids = np.asarray(prompt)
    merge = tower.cfg.spatial_merge_size
    grid = np.asarray(images.grid_thw).reshape(-1, 3)
    spans = image_spans(ids, grid, tower.image_token_id, merge, max_images)  # checks the runs against the grids
    pad_index = np.nonzero(ids == tower.image_token_id)[0]
    embeds = bucketed_embeddings(tower, np.asarray(images.pixel_values), grid)
    if len(embeds) != len(pad_index):
        raise ValueError(f"the prompt has {len(pad_index)} image pad tokens, the images give {len(embeds)}")
    hashes, patch = [], 0
    for j, (t, gh, gw) in enumerate(grid.tolist()):
        pixels = np.ascontiguousarray(images.pixel_values[patch: patch + t * gh * gw], np.float32)
        digest = hashlib.blake2b(np.asarray([t, gh, gw], np.int64).tobytes() + pixels.tobytes(), digest_size=16)
        hashes.append((int(spans[j, 0]), digest.digest()))
        patch += t * gh * gw
    return RequestImages(np.asarray(embeds, dtype), pad_index, spans, tuple(hashes), prompt_digest(ids))


__all__ = ["RequestImages", "bucketed_embeddings", "encode_images", "patch_bucket", "prompt_digest"]
