"""Readers of HF checkpoint directories: config -> quantization scheme -> canonical entries, streamed.

`open_checkpoint(path)` only parses config and shard headers and validates names and shapes against the set
derived from the config (convert.spec); tensor data is read when an entry's `load()` runs, one canonical
tensor (a whole expert stack for routed experts) at a time.

Canonical values: plain tensors as np.ndarray in torch orientation and source dtype (block-FP8 linears are
dequantised to bfloat16, the only lossy-by-format case: our kernels have no FP8 path); quantized linears as
`QuantizedWeight` (logical [..., K=in, N=out]) holding exactly the source integers (zero point subtracted) and
the source scales, repacked with `quant_layout.pack`. Integers that need more bits than the source width
(asymmetric formats: q - zero needs b + 1 bits; 2/3/5/7-bit) are widened to the next of 4/6/8 bits (exact).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Callable, Iterator

import ml_dtypes
import numpy as np

from convert import spec as specmod
from convert.errors import ConvertError
from convert.ngram import as_table
from convert.safetensors_io import TensorInfo, open_checkpoint_files
from flashnext_jax.vision import vision_config, vision_tensor_shapes
from convert.unpack import (awq_nibbles, bitstream, fp8_block_dequant, int4_plane_from_pairs,
                            words_to_bytes_along_rows)
from pallas_kernels.quant_layout import PLANE_FORMATS, QuantizedWeight, pack

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                   "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                   "generation_config.json", "tokenizer.model",
                   "preprocessor_config.json")  # copied as they are (the last: the image preprocessing)

QUANT_PARAMS = {"weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx",
                "qweight", "qzeros", "scales", "g_idx", "weight_scale_inv"}
IGNORED = re.compile(r"(^|\.)(hashstats_[^.]*|token_lookup)(\.|$)")
EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)(\.weight)?$")
NGRAM = re.compile(r"^(.*\.ple\.ple_embedding\.ngram_embedding)\.(?:shard_(\d+)\.weight|(weight)|(weight_scale))$")
CHUNK_BYTES = 64 << 20  # int32 working set per packing chunk
FAST_PATHS = True  # uint8 fast paths for symmetric 4/8-bit sources (tests check them against pack())


def canonical_name(src: str) -> str | None:
    """HF name -> canonical name; None for tensors the text model does not use (vision: `vision_name`)."""
    if vision_name(src) is not None:
        return None
    for p in ("model.language_model.", "model."):
        if src.startswith(p):
            return src[len(p):]
    return src


def vision_name(src: str) -> str | None:
    """HF name of a vision-tower tensor -> its canonical name `visual.<name within the tower>`; None for others."""
    for p in ("model.visual.", "visual."):
        if src.startswith(p):
            return "visual." + src[len(p):]
    return None


def target_bits(bits: int, symmetric: bool) -> int:
    """Smallest of our 4/6/8-bit layouts that holds q - zero exactly."""
    need = bits if symmetric else bits + 1
    for b in (4, 6, 8):
        if need <= b:
            return b
    raise ConvertError(f"unsupported: {'asymmetric ' if not symmetric else ''}{bits}-bit integers do not fit the "
                       "8-bit layout exactly")


# ---------------------------------------------------------------------------------------------------------
# linear sources: one source module (a torch Linear / Embedding), plain or quantized

@dataclasses.dataclass
class QuantInfo:
    bits: int  # our layout's bits (>= source bits)
    group_size: int
    source_bits: int
    symmetric: bool
    scale_dtype: np.dtype
    source: str  # e.g. "compressed-tensors pack-quantized group"

    def as_json(self) -> dict:
        return {"bits": self.bits, "group_size": self.group_size, "source_bits": self.source_bits,
                "symmetric": self.symmetric, "scales_dtype": str(self.scale_dtype), "source": self.source}


class LinearSource:
    name: str  # source module name (for messages)
    n: int
    k: int
    quant: QuantInfo | None = None
    dtype: np.dtype
    nbytes: int

    def dense(self) -> np.ndarray:  # plain: [N, K]
        raise NotImplementedError

    def open(self) -> None:  # quantized: load the raw source tensors
        pass

    def close(self) -> None:
        pass

    def q_cols(self, n0: int, n1: int) -> tuple[np.ndarray, np.ndarray]:
        """Quantized: signed integers q [K, n1-n0] (int32, zero subtracted) and scales [K/G, n1-n0]."""
        raise NotImplementedError

    def planes_cols(self, n0: int, n1: int):
        """Optional fast path: (planes, scales) exactly as pack(*q_cols(n0, n1)) would give, or None."""
        return None


class PlainLinear(LinearSource):
    def __init__(self, name: str, t: TensorInfo):
        if len(t.shape) != 2:
            raise ConvertError(f"tensor {t.name} must be 2-D, got shape {list(t.shape)}")
        self.name, self.t = name, t
        self.n, self.k = t.shape
        self.dtype, self.nbytes = t.dtype, t.nbytes

    def dense(self) -> np.ndarray:
        return self.t.read()


class FP8BlockLinear(LinearSource):
    def __init__(self, name: str, w: TensorInfo, scale_inv: TensorInfo, block: tuple[int, int]):
        self.name, self.w, self.s, self.block = name, w, scale_inv, block
        self.n, self.k = w.shape
        want = (-(-self.n // block[0]), -(-self.k // block[1]))
        if tuple(scale_inv.shape) != want:
            raise ConvertError(f"shape mismatch: {scale_inv.name} is {list(scale_inv.shape)}, expected {list(want)} "
                               f"for a {block[0]}x{block[1]}-block FP8 weight of shape {[self.n, self.k]}")
        self.dtype, self.nbytes = np.dtype(ml_dtypes.bfloat16), w.nbytes + scale_inv.nbytes

    def dense(self) -> np.ndarray:
        return fp8_block_dequant(self.w.read(), self.s.read(), self.block).astype(ml_dtypes.bfloat16)


class CTLinear(LinearSource):
    """compressed-tensors pack-quantized / int-quantized: weight [N, K] (row = output), scales [N, K/G]."""

    def __init__(self, name: str, p: dict[str, TensorInfo], args: dict, fmt: str):
        self.name, self.p, self.fmt = name, p, fmt
        b = int(args.get("num_bits", 8))
        strategy = args.get("strategy", "group")
        sym = bool(args.get("symmetric", True))
        if args.get("type", "int") != "int":
            raise ConvertError(f"unsupported: {name} uses {args.get('type')} weights (only int is supported)")
        if not 2 <= b <= 8:
            raise ConvertError(f"unsupported bits: {name} has {b}-bit weights (supported 2..8)")
        if strategy not in ("group", "channel"):
            raise ConvertError(f"unsupported: {name} uses strategy {strategy!r} (supported: group, channel)")
        if "weight_g_idx" in p or args.get("actorder"):
            raise ConvertError(f"unsupported: {name} uses activation ordering (weight_g_idx)")
        if not sym and "weight_zero_point" not in p:
            raise ConvertError(f"missing tensor {name}.weight_zero_point (asymmetric scheme)")
        if "weight_scale" not in p:
            raise ConvertError(f"missing tensor {name}.weight_scale")
        if fmt == "pack-quantized":
            if "weight_packed" not in p or "weight_shape" not in p:
                raise ConvertError(f"missing tensor {name}.weight_packed/weight_shape")
            self.n, self.k = (int(x) for x in p["weight_shape"].read().reshape(-1))
            want = (self.n, -(-self.k * b // 32))
            if tuple(p["weight_packed"].shape) != want:
                raise ConvertError(f"shape mismatch: {name}.weight_packed is {list(p['weight_packed'].shape)}, "
                                   f"expected {list(want)} for {b}-bit weights of shape {[self.n, self.k]}")
        elif fmt == "int-quantized":
            if "weight" not in p or p["weight"].dtype != np.int8:
                raise ConvertError(f"missing tensor {name}.weight (int8) for int-quantized format")
            self.n, self.k = p["weight"].shape
        else:
            raise ConvertError(f"unsupported compressed-tensors format {fmt!r} for {name}")
        s = p["weight_scale"].shape
        g = self.k if strategy == "channel" else int(args.get("group_size") or 0)
        if g <= 0 or self.k % g or tuple(s) != (self.n, self.k // g):
            raise ConvertError(f"shape mismatch: {name}.weight_scale is {list(s)}, expected {[self.n, self.k // max(g, 1)]} "
                               f"({strategy}, group_size {args.get('group_size')})")
        self.b, self.g, self.sym = b, g, sym
        self.quant = QuantInfo(target_bits(b, sym), g, b, sym, p["weight_scale"].dtype,
                               f"compressed-tensors {fmt} {strategy}")
        self.dtype = self.quant.scale_dtype
        self.nbytes = sum(t.nbytes for t in p.values())
        self._raw = None

    def open(self) -> None:
        p = self.p
        w = p["weight_packed"].read() if self.fmt == "pack-quantized" else p["weight"].read()
        zp = None
        if not self.sym:
            z = p["weight_zero_point"].read()
            if self.fmt == "pack-quantized" and z.dtype == np.int32:
                zp = bitstream(z, self.b, self.n) - (1 << (self.b - 1))  # packed along N (dim 0)
            else:
                zp = z.astype(np.int32)
            zp = zp.reshape(self.n, self.k // self.g)
        self._raw = (w, p["weight_scale"].read(), zp)

    def close(self) -> None:
        self._raw = None

    def q_cols(self, n0, n1):
        w, s, zp = self._raw
        if self.fmt == "pack-quantized":
            q = bitstream(w[n0:n1].T, self.b, self.k) - (1 << (self.b - 1))
        else:
            q = w[n0:n1].T.astype(np.int32)
        if zp is not None:
            q = q - np.repeat(zp[n0:n1].T, self.g, axis=0)
        return q, np.ascontiguousarray(s[n0:n1].T)

    def planes_cols(self, n0, n1):
        if self.fmt != "pack-quantized" or not self.sym or self.b not in (4, 8) or self.k % 32:
            return None
        w, s, _ = self._raw
        u8 = np.ascontiguousarray(w[n0:n1]).view(np.uint8)  # [cols, K*b/8], little-endian bitstream
        if self.b == 8:
            plane = np.ascontiguousarray((u8 ^ 0x80).view(np.int8).T)
        else:
            plane = int4_plane_from_pairs(u8.T, self.g)
        return (plane,), np.ascontiguousarray(s[n0:n1].T)


class GPTQLinear(LinearSource):
    """GPTQ / AutoRound auto_gptq: qweight [K*b/32, N] packed along K, qzeros [K/G, N*b/32], scales [K/G, N]."""

    def __init__(self, name: str, p: dict[str, TensorInfo], bits: int, group_size: int, sym: bool,
                 zero_offset: int, source: str):
        self.name, self.p = name, p
        for x in ("qweight", "qzeros", "scales"):
            if x not in p:
                raise ConvertError(f"missing tensor {name}.{x}")
        if bits not in (2, 3, 4, 6, 8):
            raise ConvertError(f"unsupported bits: {name} has {bits}-bit weights ({source}: 2, 3, 4, 6, 8)")
        qw, qz, sc = p["qweight"].shape, p["qzeros"].shape, p["scales"].shape
        self.n = sc[1]
        self.k = qw[0] * 32 // bits
        groups = sc[0]
        if qw[0] * 32 % bits or qw[1] != self.n or self.k % groups or qz != (groups, -(-self.n * bits // 32)):
            raise ConvertError(f"shape mismatch: {name} qweight {list(qw)} / qzeros {list(qz)} / scales {list(sc)} "
                               f"do not fit {bits}-bit weights (check the config's bits for this module)")
        self.g = self.k // groups
        if group_size not in (-1, 0, None) and group_size != self.g:
            raise ConvertError(f"shape mismatch: {name} scales have {groups} groups, config group_size {group_size} "
                               f"for K={self.k}")
        self.b, self.sym, self.zero_offset = bits, sym, zero_offset
        self.quant = QuantInfo(target_bits(bits, sym), self.g, bits, sym, p["scales"].dtype, source)
        self.dtype = self.quant.scale_dtype
        self.nbytes = sum(t.nbytes for t in p.values())
        self._raw = None

    def open(self) -> None:
        p = self.p
        if "g_idx" in p:
            gi = p["g_idx"].read().astype(np.int64)
            if not np.array_equal(gi, np.arange(self.k) // self.g):
                raise ConvertError(f"unsupported: {self.name} uses activation ordering (non-trivial g_idx)")
        zeros = bitstream(p["qzeros"].read().T, self.b, self.n).T + self.zero_offset  # [K/G, N]
        self._uniform_zero = bool(np.all(zeros == (1 << (self.b - 1))))
        self._raw = (p["qweight"].read(), zeros, p["scales"].read())

    def close(self) -> None:
        self._raw = None

    def q_cols(self, n0, n1):
        qweight, zeros, scales = self._raw
        q = bitstream(qweight[:, n0:n1], self.b, self.k)
        q -= np.repeat(zeros[:, n0:n1], self.g, axis=0)
        return q, np.ascontiguousarray(scales[:, n0:n1])

    def planes_cols(self, n0, n1):
        if self.b not in (4, 8) or self.quant.bits != self.b or not self._uniform_zero:
            return None
        qweight, _, scales = self._raw
        b = words_to_bytes_along_rows(qweight[:, n0:n1])  # [K*b/8, cols]
        plane = (b ^ 0x80).view(np.int8) if self.b == 8 else int4_plane_from_pairs(b, self.g)
        return (plane,), np.ascontiguousarray(scales[:, n0:n1])


class AWQLinear(LinearSource):
    """AutoAWQ GEMM / AutoRound auto_awq (4-bit, asymmetric): qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]."""

    def __init__(self, name: str, p: dict[str, TensorInfo], bits: int, group_size: int, source: str):
        self.name, self.p = name, p
        for x in ("qweight", "qzeros", "scales"):
            if x not in p:
                raise ConvertError(f"missing tensor {name}.{x}")
        if bits != 4:
            raise ConvertError(f"unsupported bits: {name} has {bits}-bit AWQ weights (only 4)")
        qw, qz, sc = p["qweight"].shape, p["qzeros"].shape, p["scales"].shape
        self.k, self.n = qw[0], sc[1]
        if qw[1] * 8 != self.n or self.k % sc[0] or qz != (sc[0], qw[1]):
            raise ConvertError(f"shape mismatch: {name} qweight {list(qw)} / qzeros {list(qz)} / scales {list(sc)}")
        self.g = self.k // sc[0]
        self.b = 4
        self.quant = QuantInfo(target_bits(4, False), self.g, 4, False, p["scales"].dtype, source)
        self.dtype = self.quant.scale_dtype
        self.nbytes = sum(t.nbytes for t in p.values())
        self._raw = None

    def open(self) -> None:
        p = self.p
        self._raw = (p["qweight"].read(), awq_nibbles(p["qzeros"].read()), p["scales"].read())

    def close(self) -> None:
        self._raw = None

    def q_cols(self, n0, n1):
        qweight, zeros, scales = self._raw
        assert n0 % 8 == 0 and (n1 % 8 == 0 or n1 == self.n)
        q = awq_nibbles(qweight[:, n0 // 8: -(-n1 // 8)])[:, : n1 - n0]
        q -= np.repeat(zeros[:, n0:n1], self.g, axis=0)
        return q, np.ascontiguousarray(scales[:, n0:n1])


# ---------------------------------------------------------------------------------------------------------
# schemes: quantization_config -> LinearSource per quantized module

class Scheme:
    name = "plain"

    def linear(self, module: str, p: dict[str, TensorInfo]) -> LinearSource:
        if "weight_scale_inv" in p:
            raise ConvertError(f"unexpected tensor {module}.weight_scale_inv: the config declares no fp8 quantization")
        q = sorted(set(p) & QUANT_PARAMS)
        raise ConvertError(f"unexpected tensors {module}.{{{','.join(q)}}}: config.json has no quantization_config")


class FP8Scheme(Scheme):
    name = "fp8"

    def __init__(self, q: dict):
        blk = q.get("weight_block_size") or [128, 128]
        self.block = (int(blk[0]), int(blk[1]))
        if q.get("fmt", "e4m3") not in ("e4m3", None):
            raise ConvertError(f"unsupported fp8 format {q.get('fmt')!r}")

    def linear(self, module, p):
        if "weight" not in p or "weight_scale_inv" not in p:
            raise ConvertError(f"missing tensor {module}.weight / weight_scale_inv (block fp8)")
        extra = set(p) - {"weight", "weight_scale_inv"}
        if extra:
            raise ConvertError(f"unexpected tensor {module}.{sorted(extra)[0]}")
        return FP8BlockLinear(module, p["weight"], p["weight_scale_inv"], self.block)


class CTScheme(Scheme):
    name = "compressed-tensors"

    def __init__(self, q: dict):
        self.format = q.get("format")
        status = q.get("quantization_status", "compressed")
        if status != "compressed":
            raise ConvertError(f"unsupported compressed-tensors quantization_status {status!r} (need compressed)")
        self.groups = list((q.get("config_groups") or {}).values())
        self.ignore = list(q.get("ignore") or [])
        if q.get("sparsity_config"):
            raise ConvertError("unsupported: compressed-tensors sparsity_config")

        # exact names -> first group (O(1)); regexes and class names are few
        self.exact: dict[str, int] = {}
        self.regex: list[tuple[re.Pattern, int]] = []
        self.classes: list[tuple[str, int]] = []
        for gi, g in enumerate(self.groups):
            for t in g.get("targets") or []:
                if t.startswith("re:"):
                    self.regex.append((re.compile(t[3:]), gi))
                elif t in ("Linear", "Embedding") or "." not in t and t[:1].isupper():
                    self.classes.append((t, gi))
                else:
                    self.exact.setdefault(t, gi)
        self.ignore_exact = {t for t in self.ignore if not t.startswith("re:")}
        self.ignore_regex = [re.compile(t[3:]) for t in self.ignore if t.startswith("re:")]

    @staticmethod
    def _class(module: str) -> str:
        return "Embedding" if module.endswith("embed_tokens") else "Linear"

    def args_for(self, module: str) -> tuple[dict, str] | None:
        """Like compressed-tensors: ignore first; then exact name, regex (re.match), class name."""
        if module in self.ignore_exact or self._class(module) in self.ignore_exact or any(
                rx.match(module) for rx in self.ignore_regex):
            return None
        gi = self.exact.get(module)
        if gi is None:
            gi = next((i for rx, i in self.regex if rx.match(module)), None)
        if gi is None:
            gi = next((i for t, i in self.classes if t == self._class(module)), None)
        if gi is None:
            return None
        g = self.groups[gi]
        return g.get("weights") or {}, g.get("format") or self.format

    def linear(self, module, p):
        found = self.args_for(module)
        if found is None:
            raise ConvertError(f"unexpected quantized tensor {module}.weight_packed: no config_groups target "
                               "matches it (or it is in ignore)")
        args, fmt = found
        if args.get("dynamic"):
            raise ConvertError(f"unsupported: dynamic weight quantization for {module}")
        return CTLinear(module, p, args, fmt or "pack-quantized")


class GPTQScheme(Scheme):
    """AutoRound native (auto_gptq / gptqmodel / auto_round packings) and plain GPTQ checkpoints."""

    def __init__(self, q: dict, method: str):
        self.method = method
        self.bits = int(q.get("bits", 4))
        self.group_size = int(q.get("group_size", 128))
        self.sym = bool(q.get("sym", True))
        self.data_type = q.get("data_type", "int")
        self.extra = dict(q.get("extra_config") or {})
        if method == "gptq":
            fmt = q.get("checkpoint_format", "gptq")
            self.zero_offset = 1 if fmt == "gptq" else 0
            self.packing = f"gptq:{fmt}"
            if q.get("desc_act"):
                self.packing += "+desc_act"
        else:
            self.packing = q.get("packing_format") or "auto_round:auto_gptq"
            if self.packing in ("auto_round:auto_gptq", "auto_gptq", "auto_round:gptq"):
                self.zero_offset = 1
            elif self.packing in ("auto_round:gptqmodel", "auto_round"):
                self.zero_offset = 0
            elif self.packing in ("auto_round:auto_awq", "auto_awq"):
                self.zero_offset = 0
            else:
                raise ConvertError(f"unsupported auto-round packing_format {self.packing!r}")
        self.name = f"{method} {self.packing}"
        self._regex = []
        for key in self.extra:
            try:
                self._regex.append((key, re.compile(key)))
            except re.error:
                pass

    def spec_for(self, module: str) -> dict:
        out = {"bits": self.bits, "group_size": self.group_size, "sym": self.sym, "data_type": self.data_type}
        if module in self.extra:
            out.update(self.extra[module])
        else:
            for key, rx in self._regex:
                if rx.search(module):
                    out.update(self.extra[key])
                    break
        return out

    def linear(self, module, p):
        s = self.spec_for(module)
        bits = int(s.get("bits", self.bits))
        if bits >= 16:
            raise ConvertError(f"unexpected quantized tensor {module}.qweight: the config keeps {module} at {bits} bits")
        dt = str(s.get("data_type", "int"))
        if not dt.startswith("int"):
            raise ConvertError(f"unsupported: {module} uses data_type {dt!r} (only int)")
        if "awq" in self.packing:
            return AWQLinear(module, p, bits, int(s.get("group_size", self.group_size)), self.name)
        return GPTQLinear(module, p, bits, int(s.get("group_size", self.group_size)), bool(s.get("sym", self.sym)),
                          self.zero_offset, self.name)


class AWQScheme(GPTQScheme):
    def __init__(self, q: dict):
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise ConvertError(f"unsupported AWQ version {version!r} (only gemm)")
        super().__init__({"bits": q.get("bits", q.get("w_bit", 4)), "group_size": q.get("group_size", q.get("q_group_size", 128)),
                          "sym": False, "packing_format": "auto_awq"}, "auto-round")
        self.name = "awq gemm"


def scheme_for(hf_config: dict) -> Scheme:
    q = hf_config.get("quantization_config") or specmod.text_config(hf_config).get("quantization_config")
    if not q:
        return Scheme()
    method = str(q.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return CTScheme(q)
    if method in ("auto-round", "intel/auto-round", "auto_round"):
        return GPTQScheme(q, "auto-round")
    if method == "gptq":
        return GPTQScheme(q, "gptq")
    if method == "awq":
        return AWQScheme(q)
    if method == "fp8":
        return FP8Scheme(q)
    raise ConvertError(f"unsupported quant_method {q.get('quant_method')!r} "
                       "(supported: compressed-tensors, auto-round, gptq, awq, fp8)")


# ---------------------------------------------------------------------------------------------------------
# entries

@dataclasses.dataclass
class Entry:
    """One canonical tensor: metadata known from headers, value produced by load()."""

    name: str
    shape: tuple[int, ...]  # plain: torch orientation; quantized: logical [..., K, N]
    dtype: np.dtype  # plain dtype, or the scales' dtype
    quant: QuantInfo | None
    source_bytes: int
    sources: list[str]
    load: Callable[[], np.ndarray | QuantizedWeight]

    @property
    def group(self) -> str:
        return specmod.group_of(self.name)


def _chunks(n: int, k: int) -> Iterator[tuple[int, int]]:
    step = max(32, (CHUNK_BYTES // max(4 * k, 1)) // 32 * 32)
    for n0 in range(0, n, step):
        yield n0, min(n, n0 + step)


def build_quantized(name: str, rows: list[list[LinearSource]], stacked: bool) -> QuantizedWeight:
    """Pack rows[e] (sources concatenated along N) for each leading index e into one QuantizedWeight."""
    first = rows[0][0]
    bits, g, k = first.quant.bits, first.quant.group_size, first.k
    ntot = sum(s.n for s in rows[0])
    lead = (len(rows),) if stacked else ()
    planes = [np.empty(lead + (k * w // 8, ntot), np.int8 if bits == 8 else np.uint8)
              for w, _ in PLANE_FORMATS[bits]]
    scales = np.empty(lead + (k // g, ntot), first.quant.scale_dtype)
    for e, row in enumerate(rows):
        off = 0
        for src in row:
            src.open()
            try:
                for n0, n1 in _chunks(src.n, k):
                    fast = src.planes_cols(n0, n1) if FAST_PATHS else None
                    if fast is not None:
                        out_planes, s = fast
                    else:
                        q, s = src.q_cols(n0, n1)
                        try:
                            out_planes = pack(q, s, bits, g).planes
                        except ValueError as err:
                            raise ConvertError(f"{src.name}: cannot repack exactly: {err}") from None
                    idx = (e,) if stacked else ()
                    for dst, pl in zip(planes, out_planes):
                        dst[idx + (slice(None), slice(off + n0, off + n1))] = pl
                    scales[idx + (slice(None), slice(off + n0, off + n1))] = s
            finally:
                src.close()
            off += src.n
    return QuantizedWeight(planes=tuple(planes), scales=scales, bits=bits, group_size=g, k=k, n=ntot)


def _linear_entry(name: str, src: LinearSource, sources: list[str]) -> Entry:
    if src.quant is None:
        return Entry(name, (src.n, src.k), src.dtype, None, src.nbytes, sources, src.dense)
    return Entry(name, (src.k, src.n), src.dtype, src.quant, src.nbytes, sources,
                 lambda: build_quantized(name, [[src]], stacked=False))


def _expert_entries(prefix: str, experts: dict[int, dict[str, LinearSource]]) -> list[Entry]:
    n_exp = max(experts) + 1
    for e in range(n_exp):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            if proj not in experts.get(e, {}):
                raise ConvertError(f"missing tensor {prefix}.{e}.{proj}.weight")
    srcs = [experts[e][p] for e in range(n_exp) for p in ("gate_proj", "up_proj", "down_proj")]
    quant = {s.quant is not None for s in srcs}
    if len(quant) > 1:
        raise ConvertError(f"unsupported: experts of {prefix} are partly quantized, partly not")

    def check_same(group: list[LinearSource], what: str):
        ref = group[0]
        for s in group[1:]:
            if (s.n, s.k) != (ref.n, ref.k) or s.dtype != ref.dtype or (
                    s.quant and (s.quant.bits, s.quant.group_size) != (ref.quant.bits, ref.quant.group_size)):
                raise ConvertError(f"shape mismatch: {s.name} differs from {ref.name} ({what})")

    gu = [experts[e][p] for e in range(n_exp) for p in ("gate_proj", "up_proj")]
    dn = [experts[e]["down_proj"] for e in range(n_exp)]
    check_same(gu, "stacked gate_up_proj")
    check_same(dn, "stacked down_proj")
    i, h = gu[0].n, gu[0].k
    names = [s.name for s in srcs]
    gu_bytes, dn_bytes = sum(s.nbytes for s in gu), sum(s.nbytes for s in dn)
    if quant == {False}:
        def load_gu():
            out = np.empty((n_exp, 2 * i, h), gu[0].dtype)
            for e in range(n_exp):
                out[e, :i] = experts[e]["gate_proj"].dense()
                out[e, i:] = experts[e]["up_proj"].dense()
            return out

        def load_dn():
            out = np.empty((n_exp, dn[0].n, dn[0].k), dn[0].dtype)
            for e in range(n_exp):
                out[e] = experts[e]["down_proj"].dense()
            return out

        return [Entry(f"{prefix}.gate_up_proj", (n_exp, 2 * i, h), gu[0].dtype, None, gu_bytes, names, load_gu),
                Entry(f"{prefix}.down_proj", (n_exp, dn[0].n, dn[0].k), dn[0].dtype, None, dn_bytes, names, load_dn)]
    rows_gu = [[experts[e]["gate_proj"], experts[e]["up_proj"]] for e in range(n_exp)]
    rows_dn = [[experts[e]["down_proj"]] for e in range(n_exp)]
    return [
        Entry(f"{prefix}.gate_up_proj", (n_exp, h, 2 * i), gu[0].dtype, gu[0].quant, gu_bytes, names,
              lambda: build_quantized(f"{prefix}.gate_up_proj", rows_gu, stacked=True)),
        Entry(f"{prefix}.down_proj", (n_exp, dn[0].k, dn[0].n), dn[0].dtype, dn[0].quant, dn_bytes, names,
              lambda: build_quantized(f"{prefix}.down_proj", rows_dn, stacked=True)),
    ]


# ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class NgramSource:
    canonical: str  # e.g. layers.1.ple.ple_embedding.ngram_embedding
    parts: list[TensorInfo]
    scale: float | None
    shape: tuple[int, int]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def table(self):
        return as_table([p.memmap() for p in self.parts])


class Checkpoint:
    """An opened, validated HF checkpoint directory (headers only until entries are loaded)."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isdir(path):
            raise ConvertError(f"source {path} is not a directory")
        if not os.path.exists(cfg_path):
            raise ConvertError(f"missing config.json in {path}")
        with open(cfg_path) as f:
            self.hf_config = json.load(f)
        self.text_config = specmod.text_config(self.hf_config)
        mt = self.text_config.get("model_type")
        if mt not in ("qwen4_exp_text", "qwen4_exp"):
            raise ConvertError(f"unsupported model_type {mt!r} (expected qwen4_exp / qwen4_exp_text)")
        self.scheme = scheme_for(self.hf_config)
        self.files = open_checkpoint_files(path)
        self.tokenizer_files = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(path, f))]
        self._build()
        self._validate()

    @property
    def source_format(self) -> str:
        return self.scheme.name

    def _build(self) -> None:
        modules_q: dict[str, dict[str, TensorInfo]] = {}
        plain: dict[str, TensorInfo] = {}
        ngram: dict[str, dict] = {}
        vision: dict[str, TensorInfo] = {}
        for src, t in self.files.items():
            if vision_name(src) is not None:
                vision[src] = t
                continue
            c = canonical_name(src)
            if c is None or IGNORED.search(src):
                continue
            m = NGRAM.match(c)
            if m:
                d = ngram.setdefault(m.group(1), {"shards": {}, "weight": None, "scale": None})
                if m.group(2) is not None:
                    d["shards"][int(m.group(2))] = t
                elif m.group(3):
                    d["weight"] = t
                else:
                    d["scale"] = t
                continue
            module, _, param = src.rpartition(".")
            if param in QUANT_PARAMS:
                modules_q.setdefault(module, {})[param] = t
            else:
                plain[src] = t
        for src in list(plain):  # weights / biases that belong to a quantized module
            module, _, param = src.rpartition(".")
            if module in modules_q and param in ("weight", "bias"):
                modules_q[module][param] = plain.pop(src)

        entries: list[Entry] = []
        experts: dict[str, dict[int, dict[str, LinearSource]]] = {}

        def add_linear(c_module: str, src: LinearSource, sources: list[str]):
            m = EXPERT.match(c_module)
            if m:
                experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = src
            else:
                entries.append(_linear_entry(c_module + ".weight", src, sources))

        for module, p in modules_q.items():
            if "bias" in p:
                raise ConvertError(f"unexpected tensor {module}.bias")
            src = self.scheme.linear(module, p)
            add_linear(canonical_name(module), src, [f"{module}.{k}" for k in sorted(p)])
        for src_name, t in plain.items():
            c = canonical_name(src_name)
            m = EXPERT.match(c)
            if m and c.endswith(".weight"):
                add_linear(c[: -len(".weight")], PlainLinear(src_name, t), [src_name])
            elif t.dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
                raise ConvertError(f"missing tensor {src_name[:-len('.weight')]}.weight_scale_inv for fp8 weight "
                                   f"{src_name}")
            else:
                entries.append(Entry(c, t.shape, t.dtype, None, t.nbytes, [src_name], t.read))
        for prefix, ex in experts.items():
            entries.extend(_expert_entries(prefix, ex))
        order = {"embed": (0, 0), "head": (2, 0), "mtp": (3, 0)}

        def key(e: Entry):
            g = e.group
            return (order.get(g, (1, int(g.split("_")[1]) if g.startswith("layer_") else 0)), e.name)

        entries.sort(key=key)
        self.vision = self._vision_entries(vision)
        seen = set()
        for e in entries + self.vision:
            if e.name in seen:
                raise ConvertError(f"duplicate tensor {e.name} (from {', '.join(e.sources)})")
            seen.add(e.name)
        self.entries = entries

        self.ngram: NgramSource | None = None
        if len(ngram) > 1:
            raise ConvertError(f"unsupported: {len(ngram)} n-gram tables (one PLE layer supported)")
        for canon, d in ngram.items():
            if d["weight"] is not None and d["shards"]:
                raise ConvertError(f"unexpected tensor {canon}.weight next to its shards")
            if d["weight"] is not None:
                parts = [d["weight"]]
            else:
                idx = sorted(d["shards"])
                if idx != list(range(len(idx))):
                    missing = sorted(set(range(max(idx) + 1)) - set(idx))
                    raise ConvertError(f"missing tensor {canon}.shard_{missing[0]}.weight")
                parts = [d["shards"][i] for i in idx]
            width, dt = parts[0].shape[1:], parts[0].dtype
            for p in parts:
                if len(p.shape) != 2 or p.shape[1:] != width or p.dtype != dt:
                    raise ConvertError(f"shape mismatch: n-gram shard {p.name} is {p.dtype}{list(p.shape)}, "
                                       f"expected {dt}[*, {width[0]}]")
            scale = None
            if d["scale"] is not None:
                s = d["scale"].read().astype(np.float32).reshape(-1)
                if s.size != 1:
                    raise ConvertError(f"unsupported: n-gram weight_scale with {s.size} values (one expected)")
                scale = float(s[0])
            elif dt.itemsize == 1:
                raise ConvertError(f"missing tensor {canon}.weight_scale for the fp8 n-gram table")
            rows = sum(p.shape[0] for p in parts)
            self.ngram = NgramSource(canon, parts, scale, (rows, width[0]), dt)

    def _vision_entries(self, files: dict[str, TensorInfo]) -> list[Entry]:
        """The vision tower's tensors (canonical `visual.*`, group "vision"), kept unquantized: the release keeps
        the tower so and `vision.py` has no quantized path. Plain tensors stay byte-identical; a block-FP8 linear is
        dequantised to bf16 like the text model's; any other quantized vision module is refused by name."""
        modules_q: dict[str, dict[str, TensorInfo]] = {}
        for src, t in files.items():
            module, _, param = src.rpartition(".")
            if param in QUANT_PARAMS:
                modules_q.setdefault(module, {})[param] = t
        entries = []
        for src, t in files.items():
            module, _, param = src.rpartition(".")
            if param in QUANT_PARAMS or (module in modules_q and param == "weight"):
                continue  # a quantized module's parts (its bias, if any, stays a plain tensor)
            if t.dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
                raise ConvertError(f"missing tensor {module}.weight_scale_inv for fp8 weight {src}")
            entries.append(Entry(vision_name(src), t.shape, t.dtype, None, t.nbytes, [src], t.read))
        for module, p in modules_q.items():
            if f"{module}.weight" in files:
                p = {**p, "weight": files[f"{module}.weight"]}
            src = self.scheme.linear(module, p)
            if src.quant is not None:
                raise ConvertError(f"unsupported: quantized vision tower module {module} (the tower is kept "
                                   "unquantized; the release does not quantize it)")
            entries.append(Entry(vision_name(module) + ".weight", (src.n, src.k), src.dtype, None, src.nbytes,
                                 [f"{module}.{k}" for k in sorted(p)], src.dense))
        return sorted(entries, key=lambda e: e.name)

    def _validate(self) -> None:
        has_mtp = any(e.name.startswith("mtp.") for e in self.entries)
        expected = specmod.expected_tensors(self.hf_config, with_mtp=has_mtp)
        got = {e.name: e for e in self.entries}
        unexpected, wrong = [], []
        for name, e in got.items():
            if name not in expected:
                unexpected.append(f"{e.sources[0]} (canonical {name})")
                continue
            sp = expected[name]
            want = sp.shape
            if e.quant is not None:
                if not sp.quantizable:
                    raise ConvertError(f"unexpected quantized tensor {e.sources[0]}: {name} must be unquantized")
                want = want[:-2] + (want[-1], want[-2])
            if tuple(e.shape) != tuple(want):
                wrong.append(f"{name} is {list(e.shape)}{' (quantized, [..., in, out])' if e.quant else ''}, "
                             f"expected {list(want)}")
        missing = [name for name, sp in expected.items() if name not in got and not sp.optional]
        _raise_tensor_problems(missing, unexpected, wrong)
        ple = specmod.ple_layers(self.text_config)
        if ple:
            want = specmod.ngram_table_shape(self.text_config)
            canon = f"layers.{ple[0]}.ple.ple_embedding.ngram_embedding"
            if self.ngram is None:
                raise ConvertError(f"missing tensor {canon}.shard_0.weight (n-gram table)")
            if self.ngram.canonical != canon:
                raise ConvertError(f"unexpected tensor {self.ngram.canonical} (the PLE layer is {canon})")
            if tuple(self.ngram.shape) != tuple(want):
                raise ConvertError(f"shape mismatch: n-gram table {canon} is {list(self.ngram.shape)}, expected "
                                   f"{list(want)}")
        elif self.ngram is not None:
            raise ConvertError(f"unexpected tensor {self.ngram.canonical} (no ple_layer_ids in config)")
        self._validate_vision()

    def _validate_vision(self) -> None:
        """A checkpoint with a vision_config holds the tower it describes (names and shapes), or none at all (a
        text-only conversion of a multimodal release): a tower that would fail only when `load()` builds it is
        refused now, with every problem named. A vision_config the engine cannot read is left to `load()`, which
        names what it lacks (the quantization fixtures carry a stand-in one beside a few vision tensors)."""
        if not self.vision:
            return
        try:
            cfg = vision_config(self.hf_config)
        except ValueError:
            return
        if cfg is None:
            return
        expected, got = vision_tensor_shapes(cfg), {e.name: e for e in self.vision}
        missing = [n for n in expected if n not in got]
        unexpected = [f"{e.sources[0]} (canonical {n})" for n, e in got.items() if n not in expected]
        wrong = [f"{n} is {list(e.shape)}, expected {list(expected[n])}" for n, e in got.items()
                 if n in expected and tuple(e.shape) != expected[n]]
        _raise_tensor_problems(missing, unexpected, wrong, "vision tower: ")

    def tensors(self) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
        for e in self.entries:
            yield e.name, e.load()

    @property
    def source_bytes(self) -> int:
        return (sum(e.source_bytes for e in self.entries + self.vision)
                + (self.ngram.nbytes if self.ngram else 0))


def _raise_tensor_problems(missing: list[str], unexpected: list[str], wrong: list[str], prefix: str = "") -> None:
    """One ConvertError listing every missing, unexpected and misshapen tensor (up to 12 of each), if any."""
    problems = [f"{prefix}{label} {', '.join(items[:12])}{' ...' if len(items) > 12 else ''}"
                for label, items in (("missing tensor" + ("s" if len(missing) > 1 else ""), missing),
                                     ("unexpected tensor" + ("s" if len(unexpected) > 1 else ""), unexpected),
                                     ("shape mismatch:", wrong)) if items]
    if problems:
        raise ConvertError("; ".join(problems))


def open_checkpoint(path: str) -> Checkpoint:
    return Checkpoint(path)


def read_checkpoint(path: str):
    """(hf_config, iterator of (canonical_name, np.ndarray | QuantizedWeight), ngram_table, ngram_scale).

    Accepts an HF directory (any supported format) or a directory written by `python -m convert`.
    ngram_table: np.memmap (one source tensor) or ShardedRows (row-concatenation of memory-mapped shards), or
    None; ngram_scale: float for an FP8 table, else None."""
    from convert import writer

    if writer.is_converted(path):
        return writer.load_converted(path)
    ck = open_checkpoint(path)
    table = ck.ngram.table() if ck.ngram else None
    return ck.hf_config, ck.tensors(), table, (ck.ngram.scale if ck.ngram else None)


def read_vision(path: str) -> dict[str, np.ndarray]:
    """The vision tower's tensors of an HF directory or a directory written by `python -m convert`, by canonical
    name (`visual.<name within the tower>`, e.g. `visual.blocks.0.attn.qkv.weight`), in their stored dtype;
    empty when the checkpoint has none. Kept apart from `read_checkpoint`'s text-model stream: only a model that
    takes images loads them."""
    from convert import writer

    if writer.is_converted(path):
        return writer.load_converted_vision(path)
    return {e.name: e.load() for e in open_checkpoint(path).vision}
