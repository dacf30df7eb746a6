"""Minimal streaming safetensors reader: header parsing, positioned reads, memory maps.

We parse the (trivial) format ourselves instead of `safetensors.safe_open` because we need, without reading any
tensor data: every dtype including bfloat16 and float8 as numpy (ml_dtypes), a truncation check of each shard
against the offsets in its header, positioned reads into freshly allocated arrays (so that peak memory is the
tensor itself, not a mapped shard), and np.memmap views for the n-gram table.
Format: u64 little-endian header length n, n bytes of JSON {name: {dtype, shape, data_offsets: [b, e]}, ...},
then the data; offsets are relative to byte 8 + n.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import ml_dtypes
import numpy as np

from convert.errors import ConvertError

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16), "U16": np.dtype(np.uint16), "I32": np.dtype(np.int32), "U32": np.dtype(np.uint32),
    "I64": np.dtype(np.int64), "U64": np.dtype(np.uint64), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: "SafetensorsFile"
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    nbytes: int

    def read(self) -> np.ndarray:
        return self.file.read(self)

    def memmap(self) -> np.ndarray:
        return self.file.memmap(self)


class SafetensorsFile:
    """Header of one shard; data is read on demand (pread) and never cached."""

    def __init__(self, path: str):
        self.path = path
        self.size = os.path.getsize(path)
        base = os.path.basename(path)
        if self.size < 8:
            raise ConvertError(f"truncated shard {base}: {self.size} bytes, no header")
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if 8 + n > self.size:
                raise ConvertError(f"truncated shard {base}: header of {n} bytes but file has {self.size}")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise ConvertError(f"corrupt shard {base}: bad header JSON ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        for name, h in header.items():
            if h["dtype"] not in DTYPES:
                raise ConvertError(f"unsupported dtype {h['dtype']} for tensor {name} in {base}")
            dtype = DTYPES[h["dtype"]]
            shape = tuple(int(s) for s in h["shape"])
            b, e = h["data_offsets"]
            if e - b != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                raise ConvertError(f"corrupt shard {base}: tensor {name} has {e - b} bytes for shape {list(shape)}")
            if self.data_start + e > self.size:
                raise ConvertError(f"truncated shard {base}: tensor {name} ends at byte {self.data_start + e} "
                                   f"but the file has {self.size} bytes")
            self.tensors[name] = TensorInfo(self, name, dtype, shape, self.data_start + b, e - b)
        self._fd: int | None = None

    def read(self, t: TensorInfo) -> np.ndarray:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        buf = np.empty(t.nbytes, np.uint8)
        view = memoryview(buf)
        done = 0
        while done < t.nbytes:  # os.preadv fills our buffer directly (no intermediate bytes object)
            got = os.preadv(self._fd, [view[done:]], t.begin + done)
            if got <= 0:
                raise ConvertError(f"truncated shard {os.path.basename(self.path)}: short read of {t.name}")
            done += got
        return buf.view(t.dtype).reshape(t.shape)

    def memmap(self, t: TensorInfo) -> np.ndarray:
        if t.nbytes == 0:
            return np.zeros(t.shape, t.dtype)
        return np.memmap(self.path, dtype=t.dtype, mode="r", offset=t.begin, shape=t.shape)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def open_checkpoint_files(path: str) -> dict[str, TensorInfo]:
    """All tensors of an HF checkpoint directory: name -> TensorInfo (headers only).

    Uses model.safetensors.index.json when present (every listed tensor must be in the named shard), else every
    *.safetensors file in the directory."""
    index = os.path.join(path, "model.safetensors.index.json")
    files: dict[str, SafetensorsFile] = {}

    def shard(fname: str) -> SafetensorsFile:
        if fname not in files:
            p = os.path.join(path, fname)
            if not os.path.exists(p):
                raise ConvertError(f"missing shard {fname} (listed in model.safetensors.index.json)")
            files[fname] = SafetensorsFile(p)
        return files[fname]

    out: dict[str, TensorInfo] = {}
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        for name, fname in weight_map.items():
            sf = shard(fname)
            if name not in sf.tensors:
                raise ConvertError(f"missing tensor {name}: listed in the index but absent from {fname}")
            out[name] = sf.tensors[name]
    else:
        names = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not names:
            raise ConvertError(f"no *.safetensors files in {path}")
        for fname in names:
            for name, t in shard(fname).tensors.items():
                if name in out:
                    raise ConvertError(f"tensor {name} appears in both {os.path.basename(out[name].file.path)} "
                                       f"and {fname}")
                out[name] = t
    return out
