"""Exact numpy unpacking of the source formats' integers (see docs/checkpoint-formats.md).

Every function returns plain integers; nothing here touches scales or floats, so the converter can hand the
integers and the source scales to `pallas_kernels.quant_layout.pack` unchanged.
"""

from __future__ import annotations

import numpy as np


def bitstream(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Unsigned b-bit fields of a dense little-endian bitstream packed along axis 0.

    words: int32/uint32 [W, ...]; element k occupies bits [k*b, k*b + b) of the stream whose word w holds bits
    [32w, 32w + 32). Returns int32 [count, ...]. For b in {1, 2, 4, 8} this is also GPTQ's word packing
    (row k = (32/b)*j + i in bits [b*i, b*i + b) of word j)."""
    w = np.ascontiguousarray(words).view(np.uint32)
    mask = np.uint32((1 << bits) - 1)
    if count * bits > w.shape[0] * 32:
        raise ValueError(f"{w.shape[0]} words hold fewer than {count} {bits}-bit values")
    if 32 % bits == 0:
        per = 32 // bits
        shifts = (np.arange(per, dtype=np.uint32) * bits).reshape((1, per) + (1,) * (w.ndim - 1))
        v = (w[:, None] >> shifts) & mask
        v = v.reshape((w.shape[0] * per,) + w.shape[1:])[:count]
        return v.astype(np.int32)
    k = np.arange(count, dtype=np.int64) * bits
    idx, sh = k >> 5, (k & 31).astype(np.uint64)
    w64 = np.concatenate([w, np.zeros((1,) + w.shape[1:], np.uint32)]).astype(np.uint64)
    sh = sh.reshape((count,) + (1,) * (w.ndim - 1))
    v = ((w64[idx] | (w64[idx + 1] << np.uint64(32))) >> sh) & np.uint64(mask)
    return v.astype(np.int32)


AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # nibble i of a word holds column 8w + AWQ_ORDER[i]


def awq_nibbles(words: np.ndarray) -> np.ndarray:
    """AutoAWQ GEMM packing along the last axis: [R, N/8] int32 -> [R, N] int32 (4-bit, unsigned)."""
    w = np.ascontiguousarray(words).view(np.uint32)
    shifts = np.arange(8, dtype=np.uint32) * 4
    nib = ((w[..., None] >> shifts) & np.uint32(15)).astype(np.int32)  # [..., N/8, 8] in nibble order
    out = np.empty_like(nib)
    out[..., AWQ_ORDER] = nib
    return out.reshape(*w.shape[:-1], w.shape[-1] * 8)


def fp8_block_dequant(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """Block-FP8 (DeepSeek-V3 style) weight [N, K] e4m3 * scale_inv[n // bn, k // bk] -> float32."""
    bn, bk = block
    n, k = w.shape[-2:]
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), bn, axis=-2)[..., :n, :], bk, axis=-1)[..., :k]
    return w.astype(np.float32) * s


def int4_plane_from_pairs(pairs: np.ndarray, group_size: int) -> np.ndarray:
    """Fast path (uint8 only) equal to quant_layout.pack(q, ..., bits=4).planes[0] for q = u - 8.

    pairs: uint8 [K/2, cols], byte r holding the unsigned 4-bit values of rows 2r (low nibble) and 2r+1 (high
    nibble), which is how both compressed-tensors (per row) and GPTQ (per column) store 4-bit data."""
    k2, cols = pairs.shape
    k = 2 * k2
    n4 = np.empty((k, cols), np.uint8)
    np.bitwise_and(pairs, 15, out=n4[0::2])
    np.right_shift(pairs, 4, out=n4[1::2])
    n4 ^= 8  # (u - 8) mod 16: the two's complement nibble of q
    n4 = n4.reshape(k // group_size, 2, group_size // 2, cols)
    out = np.left_shift(n4[:, 1], 4)
    out |= n4[:, 0]
    return out.reshape(k2, cols)


def words_to_bytes_along_rows(words: np.ndarray) -> np.ndarray:
    """int32 [R, cols] packed along rows -> uint8 [4R, cols]: byte i of word (r, c) becomes row 4r + i."""
    r, cols = words.shape
    b = np.ascontiguousarray(words).view(np.uint8).reshape(r, cols, 4)
    return np.ascontiguousarray(b.transpose(0, 2, 1)).reshape(4 * r, cols)
