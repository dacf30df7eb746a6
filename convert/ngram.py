"""The hashed n-gram table as a row-concatenation of memory-mapped parts (never loaded whole)."""

from __future__ import annotations

import numpy as np


class ShardedRows:
    """Read-only [rows, width] view over parts concatenated along rows (np.memmap each).

    Supports what the engine needs from the table: `.shape`, `.dtype`, `.nbytes`, `len()`, integer / slice /
    integer-array row indexing (a gather that touches only the requested rows), and `np.asarray(table)` (which
    materialises everything: only for small tables)."""

    def __init__(self, parts: list[np.ndarray]):
        if not parts:
            raise ValueError("ShardedRows needs at least one part")
        width, dtype = parts[0].shape[1:], parts[0].dtype
        for p in parts:
            if p.shape[1:] != width or p.dtype != dtype:
                raise ValueError("all parts must share width and dtype")
        self.parts = parts
        self.offsets = np.cumsum([0] + [p.shape[0] for p in parts])
        self.shape = (int(self.offsets[-1]),) + tuple(width)
        self.dtype = dtype
        self.ndim = len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def _gather(self, idx: np.ndarray) -> np.ndarray:
        flat = idx.reshape(-1).astype(np.int64)
        flat = np.where(flat < 0, flat + self.shape[0], flat)
        if flat.size and (flat.min() < 0 or flat.max() >= self.shape[0]):
            raise IndexError(f"row index out of range for {self.shape[0]} rows")
        part = np.searchsorted(self.offsets, flat, side="right") - 1
        out = np.empty((flat.size,) + self.shape[1:], self.dtype)
        for j in np.unique(part):
            sel = part == j
            out[sel] = self.parts[j][flat[sel] - self.offsets[j]]
        return out.reshape(idx.shape + self.shape[1:])

    def __getitem__(self, key):
        rest = ()
        if isinstance(key, tuple):
            key, rest = key[0], key[1:]
        if isinstance(key, slice):
            rows = np.arange(*key.indices(self.shape[0]))
            out = self._gather(rows)
        elif isinstance(key, (int, np.integer)):
            out = self._gather(np.asarray([key]))[0]
        else:
            out = self._gather(np.asarray(key))
        return out[(Ellipsis,) + rest] if rest else out

    def __array__(self, dtype=None, copy=None):
        out = np.concatenate([np.asarray(p) for p in self.parts], axis=0)
        return out.astype(dtype) if dtype is not None else out

    def __repr__(self) -> str:
        return f"ShardedRows(shape={self.shape}, dtype={self.dtype}, parts={len(self.parts)})"


def as_table(parts: list[np.ndarray]):
    """One part: the np.memmap itself; several: a ShardedRows."""
    return parts[0] if len(parts) == 1 else ShardedRows(parts)
