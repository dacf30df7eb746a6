"""A request's images as the engine carries them: the vision tower's rows, the MRoPE spans and content hashes.

Why a record per request: the tower runs once per image, as its own jitted program, before the request's prefill
(the server runs it on a worker thread, off the engine's lock: `Engine.encode_images`; an image seen recently is
taken from the `EncoderCache`), and its rows stay with the request. Every prefill chunk (a chunk may split an image, a
preemption recomputes the prompt) takes the rows of the pads it covers from here; no batch row ever holds them
beyond its step. The spans go into the request's slot (`RealRunner`'s `mrope_spans` leaf, written by the ledger
when the slot is allocated), so every later step, decodes included, computes its 3-D positions from the slot.

The prefix cache keys a prefix by its tokens and, when the prefix holds pads of some images, by those images'
content hashes too (`prefix_salt`): the same text with other pixels never shares state.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading

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


class EncoderCache:
    """The tower's rows of recently seen images, by content hash (blake2b of the grid and pixels), least recently
    used first out past `max_bytes`. A chat resends its images with every turn: each turn would run the tower over
    them again (vLLM keeps an encoder cache for the same reason). Thread-safe: requests are encoded on worker
    threads (llm.LLM.stream). max_bytes 0: nothing is kept."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.nbytes = int(max_bytes), 0
        self._rows: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.stats = collections.Counter()  # hits, misses

    def get(self, key: bytes) -> np.ndarray | None:
        with self._lock:
            rows = self._rows.get(key)
            self.stats["hits" if rows is not None else "misses"] += 1
            if rows is not None:
                self._rows.move_to_end(key)
            return rows

    def put(self, key: bytes, rows: np.ndarray) -> None:
        with self._lock:
            if key in self._rows or rows.nbytes > self.max_bytes:
                return
            self._rows[key] = rows
            self.nbytes += rows.nbytes
            while self.nbytes > self.max_bytes:
                self.nbytes -= self._rows.popitem(last=False)[1].nbytes


def encode_images(tower, prompt, images, dtype, max_images: int, cache: EncoderCache | None = None) -> RequestImages:
    """A prompt with expanded pads (api.Model.image_prompt) and its ImageInput -> the request's RequestImages.

    The tower runs once per image (its rows depend on that image alone: attention stays within an image), so rows
    taken from `cache` equal the rows this request would compute, bit for bit."""
    ids = np.asarray(prompt)
    merge = tower.cfg.spatial_merge_size
    grid = np.asarray(images.grid_thw).reshape(-1, 3)
    spans = image_spans(ids, grid, tower.image_token_id, merge, max_images)  # checks the runs against the grids
    pad_index = np.nonzero(ids == tower.image_token_id)[0]
    pixel_values = np.asarray(images.pixel_values)
    patches = [int(t * gh * gw) for t, gh, gw in grid.tolist()]
    if sum(patches) != pixel_values.shape[0]:
        raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, image_grid_thw describes {sum(patches)}")
    hashes, embeds, start = [], [], 0
    for j, n in enumerate(patches):
        pixels = pixel_values[start: start + n]
        digest = hashlib.blake2b(np.asarray(grid[j], np.int64).tobytes()
                                 + np.ascontiguousarray(pixels, np.float32).tobytes(), digest_size=16).digest()
        hashes.append((int(spans[j, 0]), digest))
        rows = None if cache is None else cache.get(digest)
        if rows is None:
            rows = bucketed_embeddings(tower, pixels, grid[j: j + 1])
            if cache is not None:
                cache.put(digest, rows)
        embeds.append(rows)
        start += n
    embeds = np.concatenate(embeds) if embeds else np.zeros((0, tower.cfg.out_hidden_size), np.float32)
    if len(embeds) != len(pad_index):
        raise ValueError(f"the prompt has {len(pad_index)} image pad tokens, the images give {len(embeds)}")
    return RequestImages(np.asarray(embeds, dtype), pad_index, spans, tuple(hashes), prompt_digest(ids))


__all__ = ["EncoderCache", "RequestImages", "bucketed_embeddings", "encode_images", "patch_bucket", "prompt_digest"]
