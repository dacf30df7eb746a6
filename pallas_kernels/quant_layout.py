"""Packed layout of symmetric group-quantized weights (int4 / int6 / int8), shared by the converter and kernels.

A logical weight W has shape [..., K, N] (K = input features, N = outputs, leading dims e.g. experts E), and
    W[..., k, n] = q[..., k, n] * scales[..., k // G, n]
with q a signed integer of `bits` bits (two's complement, range [-2^(b-1), 2^(b-1) - 1]), G = group_size
along K, and scales of any sign (AutoRound writes about half of them negative), kept in the source dtype
(float16 / bfloat16 / float32); kernels compute in float32.

Byte layout ("slot planes", chosen so a kernel never has to interleave or permute anything):
Each group of G consecutive K rows is cut into r contiguous slots of G/r rows. A plane with r slots per byte
stores, at byte row  g*(G/r) + j  (g = group, 0 <= j < G/r), column n, the value of logical row
    k = g*G + s*(G/r) + j
in bits [s*w, s*w + w) of the byte, for s = 0..r-1 (w = 8/r bits per value, little end first). Planes are
row-major [..., K*w/8, N] (N is the fastest axis, so a column tile is one contiguous run per row).
A kernel that processes one group reads G/r plane rows and, for slot s, the contiguous activation slice
x[:, g*G + s*G/r : g*G + (s+1)*G/r]: the activations stay in natural order.

* bits=8: planes = (p8,)        p8 int8  [..., K,   N]  = q (r = 1).
* bits=4: planes = (p4,)        p4 uint8 [..., K/2, N]  r = 2: low nibble = q of slot 0 (rows j), high nibble
                                                         = q of slot 1 (rows G/2 + j), both two's complement.
* bits=6: planes = (p4, p2)     q = 16*h + l, l = q & 15 in [0, 15] (unsigned), h = q >> 4 in [-2, 1] (signed).
                                p4 uint8 [..., K/2, N]: l, r = 2, as for int4 but unsigned nibbles;
                                p2 uint8 [..., K/4, N]: h, r = 4, 2-bit two's complement fields.
                                0.75 bytes per weight: bytes are 6-bit bytes (no widening to int8).

Constraints: K % G == 0; G % r == 0 for every plane (G % 2 for int4, G % 4 for int6). Kernels add their own
(e.g. G/r a power of two >= 16, N a multiple of 16): see quant_matmul.check_kernel_shape.

`pack` / `unpack_ints` are numpy (host side, exact); `dequantize` is the pure-JAX reference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_BITS = (4, 6, 8)

# (bits per stored value, slots per byte) of each plane, per logical bit width.
PLANE_FORMATS: dict[int, tuple[tuple[int, int], ...]] = {
    8: ((8, 1),),
    4: ((4, 2),),
    6: ((4, 2), (2, 4)),
}


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """Logical matrix W [..., K, N] = q * scales[k // G]; see the module docstring for the plane layout."""

    planes: tuple[Any, ...]
    scales: Any  # [..., K // G, N], source dtype
    bits: int = dataclasses.field(metadata=dict(static=True), default=4)
    group_size: int = dataclasses.field(metadata=dict(static=True), default=128)
    k: int = dataclasses.field(metadata=dict(static=True), default=0)
    n: int = dataclasses.field(metadata=dict(static=True), default=0)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.scales.shape[:-2]) + (self.k, self.n)

    @property
    def lead_shape(self) -> tuple[int, ...]:
        return tuple(self.scales.shape[:-2])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return self.scales.dtype

    @property
    def source_bytes(self) -> int:
        """Bytes of the packed weight at its source bit width plus the scales."""
        n_planes = sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in self.planes)
        return n_planes + int(np.prod(self.scales.shape)) * self.scales.dtype.itemsize

    def __getitem__(self, idx) -> "QuantizedWeight":
        """Index leading dims only (e.g. one expert: w[e])."""
        if not isinstance(idx, tuple):
            idx = (idx,)
        if len(idx) > len(self.lead_shape):
            raise IndexError(f"QuantizedWeight only indexes its leading dims {self.lead_shape}, got {idx}")
        return dataclasses.replace(
            self, planes=tuple(p[idx] for p in self.planes), scales=self.scales[idx])


jax.tree_util.register_dataclass(QuantizedWeight)


@dataclasses.dataclass(frozen=True)
class LayerSlice:
    """Layer `layer` of a QuantizedWeight stacked over layers (planes and scales [L, ...]), left unsliced.

    The model keeps same-shaped weights of all its layers in one array each (`flashnext_jax.layer_stack`): a jitted
    call costs ~2.3 us of host time per argument array on the H200 (bench/results/dispatch_probe.json), ~4 ms per
    engine step with 1659 per-layer arrays. Slicing a layer out inside the jitted step would be free for XLA's
    fusions but a copy for a Pallas call, so the kernels take the stacked arrays and read only this layer's blocks
    (their BlockSpecs index the leading axis with `layer`); reference paths slice (`get`)."""

    stack: QuantizedWeight
    layer: int = dataclasses.field(metadata=dict(static=True), default=0)

    def get(self) -> QuantizedWeight:
        """The layer's weight as its own arrays (a slice: XLA fuses it into reference / dequantize paths)."""
        return self.stack[self.layer]

    bits = property(lambda self: self.stack.bits)
    group_size = property(lambda self: self.stack.group_size)
    k = property(lambda self: self.stack.k)
    n = property(lambda self: self.stack.n)
    dtype = property(lambda self: self.stack.dtype)
    shape = property(lambda self: self.stack.shape[1:])
    lead_shape = property(lambda self: self.stack.lead_shape[1:])
    ndim = property(lambda self: self.stack.ndim - 1)


jax.tree_util.register_dataclass(LayerSlice)


def unstacked(w):
    """A LayerSlice as its layer's own QuantizedWeight (reference and XLA paths); anything else unchanged."""
    return w.get() if isinstance(w, LayerSlice) else w


def kernel_operands(w: "QuantizedWeight | LayerSlice") -> tuple[list, Any, tuple[int, ...]]:
    """(planes, scales, layer index prefix) for a kernel's pallas_call: a LayerSlice hands over the stacked arrays
    and `(layer,)`, to be put in front of each weight BlockSpec's block index (with a None, squeezed, block dim)."""
    if isinstance(w, LayerSlice):
        return list(w.stack.planes), w.stack.scales, (w.layer,)
    return list(w.planes), w.scales, ()


def weight_spec(pl, block: tuple, index_map, prefix: tuple[int, ...]):
    """BlockSpec of one weight operand; with a layer prefix, one more leading (squeezed) dim fixed at the layer."""
    if not prefix:
        return pl.BlockSpec(block, index_map)
    return pl.BlockSpec((None,) * len(prefix) + tuple(block), lambda *ids: (*prefix, *index_map(*ids)))


def _check_args(shape: tuple[int, ...], bits: int, group_size: int) -> tuple[int, int]:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if len(shape) < 2:
        raise ValueError(f"q must have shape [..., K, N], got {shape}")
    k, n = shape[-2], shape[-1]
    if group_size <= 0 or k % group_size:
        raise ValueError(f"K={k} must be a positive multiple of group_size={group_size}")
    for _, r in PLANE_FORMATS[bits]:
        if group_size % r:
            raise ValueError(f"group_size={group_size} must be a multiple of {r} for {bits}-bit packing")
    return k, n


def _pack_plane(v: np.ndarray, width: int, r: int, group_size: int) -> np.ndarray:
    """v: integers [..., K, N] that fit in `width` bits (two's complement taken with a mask)."""
    *lead, k, n = v.shape
    if r == 1:
        return v.astype(np.int8)
    sub = group_size // r
    mask = (1 << width) - 1
    v = (v.astype(np.int32) & mask).reshape(*lead, k // group_size, r, sub, n)
    out = np.zeros((*lead, k // group_size, sub, n), np.int32)
    for s in range(r):
        out |= v[..., s, :, :] << (s * width)
    return out.reshape(*lead, k // r, n).astype(np.uint8)


def _unpack_plane(p: np.ndarray, width: int, r: int, group_size: int, signed: bool) -> np.ndarray:
    if r == 1:
        return p.astype(np.int32)
    *lead, kr, n = p.shape
    sub = group_size // r
    p = p.astype(np.int32).reshape(*lead, kr // sub, sub, n)
    mask = (1 << width) - 1
    fields = []
    for s in range(r):
        f = (p >> (s * width)) & mask
        if signed:
            f = np.where(f >= (1 << (width - 1)), f - (1 << width), f)
        fields.append(f)
    v = np.stack(fields, axis=-3)  # [..., groups, r, sub, n]
    return v.reshape(*lead, kr * r, n)


def pack(q: np.ndarray, scales: np.ndarray, bits: int, group_size: int) -> QuantizedWeight:
    """Pack signed integers q [..., K, N] and scales [..., K//G, N] into the kernel layout (exact, numpy)."""
    q = np.asarray(q)
    scales = np.asarray(scales)
    k, n = _check_args(q.shape, bits, group_size)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if q.size and (q.min() < lo or q.max() > hi):
        raise ValueError(f"{bits}-bit values must lie in [{lo}, {hi}], got [{q.min()}, {q.max()}]")
    want = q.shape[:-2] + (k // group_size, n)
    if scales.shape != want:
        raise ValueError(f"scales must have shape {want}, got {scales.shape}")
    if not np.issubdtype(scales.dtype, np.floating) and scales.dtype != jnp.bfloat16:
        raise ValueError(f"scales must be floating point, got {scales.dtype}")
    q32 = q.astype(np.int32)
    if bits == 8:
        planes = (q32.astype(np.int8),)
    elif bits == 4:
        planes = (_pack_plane(q32, 4, 2, group_size),)
    else:  # 6
        planes = (_pack_plane(q32 & 15, 4, 2, group_size), _pack_plane(q32 >> 4, 2, 4, group_size))
    return QuantizedWeight(planes=tuple(planes), scales=scales, bits=bits, group_size=group_size, k=k, n=n)


def unpack_ints(qw: QuantizedWeight) -> np.ndarray:
    """Inverse of pack: the signed integers q [..., K, N] as int8 (numpy)."""
    planes = [np.asarray(p) for p in qw.planes]
    g = qw.group_size
    if qw.bits == 8:
        q = planes[0].astype(np.int32)
    elif qw.bits == 4:
        q = _unpack_plane(planes[0], 4, 2, g, signed=True)
    elif qw.bits == 6:
        lo = _unpack_plane(planes[0], 4, 2, g, signed=False)
        hi = _unpack_plane(planes[1], 2, 4, g, signed=True)
        q = hi * 16 + lo
    else:
        raise ValueError(f"unsupported bits {qw.bits}")
    return q.astype(np.int8)


def _plane_values(p: jax.Array, width: int, r: int, group_size: int, signed: bool) -> jax.Array:
    """JAX unpack of one plane to int32 [..., K, N] in logical row order."""
    if r == 1:
        return p.astype(jnp.int32)
    *lead, kr, n = p.shape
    sub = group_size // r
    v = p.astype(jnp.int32).reshape(*lead, kr // sub, 1, sub, n)
    shifts = (jnp.arange(r, dtype=jnp.int32) * width).reshape(r, 1, 1)
    if signed:  # move the field to the top of the int32, then arithmetic shift down
        f = (v << (32 - width - shifts)) >> (32 - width)
    else:
        f = (v >> shifts) & ((1 << width) - 1)
    return f.reshape(*lead, kr * r, n)


def dequantize_ints(qw: QuantizedWeight) -> jax.Array:
    """The signed integers q [..., K, N] as int32 (pure JAX)."""
    g = qw.group_size
    if qw.bits == 8:
        return qw.planes[0].astype(jnp.int32)
    if qw.bits == 4:
        return _plane_values(qw.planes[0], 4, 2, g, signed=True)
    if qw.bits == 6:
        lo = _plane_values(qw.planes[0], 4, 2, g, signed=False)
        hi = _plane_values(qw.planes[1], 2, 4, g, signed=True)
        return hi * 16 + lo
    raise ValueError(f"unsupported bits {qw.bits}")


def dequantize(qw: QuantizedWeight) -> jax.Array:
    """W [..., K, N] float32 = q * scales[k // G] (pure-JAX reference)."""
    q = dequantize_ints(qw).astype(jnp.float32)
    s = jnp.asarray(qw.scales).astype(jnp.float32)
    s = jnp.repeat(s, qw.group_size, axis=-2)
    return q * s


def dequantize_columns(qw: QuantizedWeight, cols: jax.Array) -> jax.Array:
    """float32 [*cols.shape, K]: the columns `cols` of a 2-D W [K, N] (e.g. a quantized embedding stored
    [K=H, N=V], looked up by token id), dequantizing only the gathered columns."""
    if qw.ndim != 2:
        raise ValueError(f"dequantize_columns needs a 2-D weight [K, N], got {qw.shape}")
    cols = jnp.asarray(cols)
    flat = cols.reshape(-1)
    sel = dataclasses.replace(
        qw, planes=tuple(jnp.take(jnp.asarray(p), flat, axis=-1) for p in qw.planes),
        scales=jnp.take(jnp.asarray(qw.scales), flat, axis=-1), n=int(flat.shape[0]))
    return dequantize(sel).T.reshape(*cols.shape, qw.k)


def quantize_rtn(w: np.ndarray, bits: int, group_size: int, scale_dtype=np.float32,
                 rng: np.random.Generator | None = None) -> QuantizedWeight:
    """Round-to-nearest symmetric quantization of a float matrix [..., K, N] (tests and benchmarks).

    Scales take the sign of the larger-magnitude extreme of each group, as AutoRound's RTN does, so about
    half of them are negative."""
    w = np.asarray(w, np.float32)
    k, n = _check_args(w.shape, bits, group_size)
    wg = w.reshape(*w.shape[:-2], k // group_size, group_size, n)
    mx, mn = wg.max(axis=-2), wg.min(axis=-2)
    ext = np.where(np.abs(mx) >= np.abs(mn), mx, mn)
    qmax = (1 << (bits - 1))
    scale = ext / -qmax  # the extreme maps to -2^(b-1): uses the full signed range
    scale = np.where(scale == 0, 1.0, scale).astype(scale_dtype)
    s32 = np.asarray(scale, np.float32)
    q = np.clip(np.rint(wg / s32[..., None, :]), -qmax, qmax - 1).astype(np.int8)
    return pack(q.reshape(w.shape), scale, bits, group_size)


def pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n (kernel tile sizes)."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def is_pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def check_dense_operands(x_shape, w, kernel: str) -> None:
    """The checks every dense kernel shares: x [M, K] against a 2-D QuantizedWeight [K, N] of a supported width
    (TypeError / ValueError naming `kernel` and the problem)."""
    if not isinstance(w, (QuantizedWeight, LayerSlice)):
        raise TypeError(f"the {kernel} needs a QuantizedWeight, got {type(w).__name__}")
    if len(x_shape) != 2:
        raise ValueError(f"x must be [M, K] (flatten leading dims first), got shape {tuple(x_shape)}")
    if w.ndim != 2:
        raise ValueError(f"dense quant_matmul needs a 2-D weight [K, N], got {w.shape}")
    if x_shape[1] != w.k:
        raise ValueError(f"x has K={x_shape[1]} but the weight has K={w.k}")
    if w.bits not in PLANE_FORMATS:
        raise ValueError(f"unsupported bits {w.bits}")
