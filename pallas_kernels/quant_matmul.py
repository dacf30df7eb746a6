"""y = x @ dequant(W) for int4 / int6 / int8 group-quantized weights (W{4,6,8}A16), Pallas kernel + reference.

Backend choice: `pl.pallas_call` through the Triton backend (the only pallas_call lowering on CUDA in jax
0.11.2). The kernel streams the packed planes of quant_layout (no repacking, no widening) one quantization
group at a time: for each group and slot it loads [G/r, BN] packed bytes, extracts the fields with integer
shifts, runs a [BM, G/r] x [G/r, BN] tensor-core dot with the matching contiguous activation slice, and
scales the [BM, BN] group partial by the group's scale row (the scale is applied after the dot, so the
dequantization cost per byte does not grow with M). Mosaic GPU (plgpu.kernel) would give TMA and wgmma,
but the Triton path works with the layout above in interpret mode and on the H200 without any per-shape
host machinery; the measured numbers are in docs/kernels-quant-matmul.md and bench/results/quant_matmul.json.

One kernel body, two tilings: decode (M <= 64: BM = 16..64, split-K over the grid, each program owns a
contiguous run of groups, fp32 partials summed by XLA) and prefill (M > 64: BM = 128 tiles of M, full K).

Dispatch (`quant_matmul` with impl 'pallas'/'interpret', `dispatch_path`), from the H200 runs in
bench/results/quant_matmul.json and bench/results/quant_sweep.json (device time per call):
* M <= GEMV_AUTO_MAX_M (2): the CUDA-core GEMV kernel below (lm_head int8 0.81 of the copy bandwidth at M = 1,
  int4 8192x28672 0.54, int6 in_proj_qkv 0.37: 1.4-2.4x faster than the tensor-core kernel);
* M <= DECODE_MAX_M (32): the Pallas tensor-core decode kernel with the weights as the dot's LEFT operand
  (DenseConfig.weights_left, default since stop 9: y^T = q^T x^T, so Triton feeds the dequantized weights to
  wgmma from registers instead of through shared memory; int6 builds one whole 6-bit field per weight). At
  M = 4..16 on the H200: lm_head int8 0.64-0.65 of the copy bandwidth (weights on the right: 0.51), int4
  8192x28672 0.27, int6 12-25 MB 0.14-0.22 (was 0.09-0.16). It is bound by the dequantization instructions
  (int6: ~9.6 SASS instructions per weight in the loop, mostly byte permutes into the mma operand layout),
  not by HBM;
* M > DECODE_MAX_M: XLA dequantization to bf16 + XLA's bf16 dot (`dequant_dot_xla`), which reaches
  0.58-0.82 of the bf16 dot's FLOP/s at M = 512, where this Triton kernel (small-K tensor-core steps, one
  scale multiply per group) reaches only 0.02-0.12. The kernel's prefill tiling stays available
  (path='kernel') and tested.

Batch-invariant traces (`fixed_order.enabled()`) skip that dispatch: every M takes the tensor-core kernel in one
configuration (`invariant_config`), since the GEMV kernel, this kernel and XLA's dot each round a row differently.
`path="gemv_fixed"` is the GEMV kernel's batch-invariant variant (quant_gemv.quant_matmul_gemv_fixed: any M, each
row as the 1-row call rounds it), for the engine's generated tokens (flashnext_jax/token_kinds.py).

The GEMV kernel used for M <= 2 lives in quant_gemv.py (its design and instruction counts are described there).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import fixed_order
from pallas_kernels.kernel_switch import resolve_impl
from pallas_kernels.quant_gemv import (GEMV_MAX_M, GemvConfig, check_gemv_config, check_gemv_shape,  # noqa: F401
                                       default_gemv_config, quant_matmul_gemv, quant_matmul_gemv_fixed)
from pallas_kernels.quant_layout import (PLANE_FORMATS, LayerSlice, QuantizedWeight, check_dense_operands, dequantize,
                                         kernel_operands, pow2_divisor, unstacked, weight_spec)

try:  # the Triton compiler params; absent or unused in interpret mode
    from jax.experimental.pallas import triton as pl_triton
except Exception:  # pragma: no cover
    pl_triton = None


@dataclasses.dataclass(frozen=True)
class DenseConfig:
    bm: int  # rows of x per program (>= 16: tensor-core dot)
    bn: int  # output columns per program
    splits: int  # split-K factor (programs along K); 1 = no partials
    groups_per_iter: int  # quantization groups unrolled per loop iteration
    num_warps: int = 4
    num_stages: int = 3
    # Weights as the dot's LEFT operand (y^T = q^T x^T; tokens are the wgmma N dimension). On Hopper Triton
    # then feeds the dequantized weights to wgmma straight from registers (m64n16k16, A in registers, x^T
    # from shared memory); with the weights on the right they must go register -> shared memory -> mma.sync
    # operand (checked offline: Triton 3.9 for sm_90 emits wgmma with a register A operand and 18 shared
    # loads per loop body instead of mma.sync fed by 86). Wants bn a multiple of 64 (one warp group's rows of
    # wgmma); any bn computes the same result.
    weights_left: bool = False


# --------------------------------------------------------------------------------------------- reference

def quant_matmul_reference(x: jax.Array, w) -> jax.Array:
    """x [M, K] @ dequant(w) [K, N] in float32, result in x.dtype. `w` may also be a plain array [K, N]."""
    wf = dequantize(w) if isinstance(w, QuantizedWeight) else jnp.asarray(w).astype(jnp.float32)
    y = jnp.dot(x.astype(jnp.float32), wf, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)


# --------------------------------------------------------------------------------------------- kernel body

def _plane_slots(bits: int, group_size: int):
    """[(plane index, width, slots r, signed, rows per slot, multiplier)] for one bit width."""
    out = []
    for pi, (width, r) in enumerate(PLANE_FORMATS[bits]):
        signed = not (bits == 6 and pi == 0)  # the int6 low plane holds unsigned nibbles
        mult = 16.0 if (bits == 6 and pi == 1) else 1.0
        out.append((pi, width, r, signed, group_size // r, mult))
    return out


# Offset-binary dequantization ("magic number"): a b-bit field u in [0, 2^b) OR-ed into the bf16 bit pattern
# 0x4300 (= 128.0, 7 mantissa bits) is exactly the bf16 number 128 + u, so no int->float conversion
# instruction is needed (I2F runs at 16/clk/SM on Hopper: at int4 that alone would cap the kernel near 60%
# of the copy bandwidth). The constant offset is removed after the dot: x @ (c + q) - c * sum(x).
_BF16_128 = 0x4300


def _magic_fields(raw, width, r, signed):
    """Fields of a packed uint8 tile as bf16 (128 + u) plus the offset c with value = (128 + u) - c."""
    v = raw.astype(jnp.int16)
    half = 1 << (width - 1)
    if signed:  # two's complement field -> offset binary: u = q + 2^(w-1) = field ^ 2^(w-1)
        flip = 0
        for s in range(r):
            flip |= half << (width * s)
        v = v ^ flip
    offset = 128.0 + (half if signed else 0)
    mask = (1 << width) - 1
    fields = []
    for s in range(r):
        f = ((v >> (width * s)) & mask) | _BF16_128
        fields.append(jax.lax.bitcast_convert_type(f.astype(jnp.int16), jnp.bfloat16))
    return fields, offset


def _exact_fields(raw, width, r, signed, compute_dtype):
    if r == 1:
        return [raw.astype(compute_dtype)]
    v = raw.astype(jnp.int32)
    fields = []
    for s in range(r):
        if signed:
            f = (v << (32 - width * (s + 1))) >> (32 - width)
        else:
            f = (v >> (width * s)) & ((1 << width) - 1)
        fields.append(f.astype(compute_dtype))
    return fields


def _int6_fields_left(load_plane, g, group_size):
    """The four [G/4, BN] tiles of whole 6-bit weights of group g as exact bf16 integers q, in the order
    (rows [0, G/4), [G/2, 3G/4), [G/4, G/2), [3G/4, G)): each combines a nibble of the 4-bit plane with the
    matching 2-bit field (quant_layout: low-plane byte row j holds rows j and G/2 + j, high-plane byte row j
    rows j, G/4 + j, G/2 + j, 3G/4 + j), so a weight costs one field, not two dots."""
    q4 = group_size // 4
    lo_a = load_plane(0, g * (group_size // 2), q4).astype(jnp.int16)  # rows j and G/2 + j
    lo_b = load_plane(0, g * (group_size // 2) + q4, q4).astype(jnp.int16)  # rows G/4 + j and 3G/4 + j
    hi = load_plane(1, g * q4, q4).astype(jnp.int16) ^ 0xAA  # 2-bit h -> h + 2 in every field
    tiles = []
    for lo, shift_lo in ((lo_a, 0), (lo_a, 4), (lo_b, 0), (lo_b, 4)):
        a = (0 if lo is lo_a else 1) + (2 if shift_lo else 0)  # high-plane field of these rows
        h = (hi << (4 - 2 * a)) if a < 2 else (hi >> (2 * a - 4))
        u = ((lo >> shift_lo) & 0xF) | (h & 0x30) | _BF16_128  # bf16 128 + (q + 32)
        tiles.append(jax.lax.bitcast_convert_type(u, jnp.bfloat16) - jnp.asarray(160.0, jnp.bfloat16))
    return tiles, (0, 2 * q4, q4, 3 * q4)


def group_dot(load_x, load_plane, g, *, bits: int, group_size: int, compute_dtype, weights_left: bool = False):
    """Unscaled x[:, group g] @ q[group g, tile] as float32 [BM, BN], or its transpose [BN, BM] when
    weights_left (q^T @ x^T: the weights are the tensor-core dot's left operand, see DenseConfig).

    load_x(col0, ncols) -> [BM, ncols] activations; load_plane(pi, row0, nrows) -> [nrows, BN] packed bytes."""
    total = None
    magic = compute_dtype == jnp.bfloat16
    if weights_left and magic and bits == 6:
        tiles, rows = _int6_fields_left(load_plane, g, group_size)
        for f, r0 in zip(tiles, rows):
            xs = load_x(g * group_size + r0, group_size // 4)
            d = jnp.dot(f.T, xs.T, preferred_element_type=jnp.float32)
            total = d if total is None else total + d
        return total
    for pi, width, r, signed, sub, mult in _plane_slots(bits, group_size):
        raw = load_plane(pi, g * sub, sub)
        if magic and r > 1:
            fields, offset = _magic_fields(raw, width, r, signed)
        else:
            fields, offset = _exact_fields(raw, width, r, signed, compute_dtype), 0.0
        part = None
        for s, f in enumerate(fields):
            xs = load_x(g * group_size + s * sub, sub)
            if weights_left:  # remove the offset from the weights: (128 + u) - c is an exact small bf16
                # integer, one packed bf16x2 subtraction per two weights and no reduction of x per slot
                if offset:
                    f = f - jnp.asarray(offset, f.dtype)
                d = jnp.dot(f.T, xs.T, preferred_element_type=jnp.float32)
            else:
                d = jnp.dot(xs, f, preferred_element_type=jnp.float32)
                if offset:
                    d = d - offset * jnp.sum(xs.astype(jnp.float32), axis=1, keepdims=True)
            part = d if part is None else part + d
        if mult != 1.0:
            part = part * mult
        total = part if total is None else total + part
    return total


def _dense_kernel(x_ref, *refs, bits, group_size, n_planes, groups_per_split, groups_per_iter, bn,
                  weights_left, m, interpret):
    plane_refs = refs[:n_planes]
    s_ref, o_ref = refs[n_planes], refs[n_planes + 1]
    split = pl.program_id(1)
    g0 = split * groups_per_split
    cdt = x_ref.dtype
    bm = x_ref.shape[0]
    # x is not padded to a multiple of BM (a pad and a slice would be two more XLA kernels per call): rows past
    # M are masked on load and store on the GPU (interpret mode pads blocks itself and clips the writes)
    row_ok = None
    if m % bm and not interpret:
        row_ok = (pl.program_id(2) * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)) < m

    def load_x(c0, nc):
        if row_ok is None:
            return x_ref[:, pl.ds(c0, nc)]
        return pl_triton.load(x_ref.at[:, pl.ds(c0, nc)], mask=jnp.broadcast_to(row_ok, (bm, nc)), other=0.0)

    def load_plane(pi, r0, nr):
        return plane_refs[pi][pl.ds(r0, nr), :]

    def body(i, acc):
        for u in range(groups_per_iter):
            g = g0 + i * groups_per_iter + u
            part = group_dot(load_x, load_plane, g, bits=bits, group_size=group_size, compute_dtype=cdt,
                             weights_left=weights_left)
            scale = s_ref[pl.ds(g, 1), :].astype(jnp.float32)
            acc = acc + part * (scale.T if weights_left else scale)
        return acc

    shape = (bn, bm) if weights_left else (bm, bn)
    acc = jax.lax.fori_loop(0, groups_per_split // groups_per_iter, body, jnp.zeros(shape, jnp.float32))
    y = (acc.T if weights_left else acc).astype(o_ref.dtype)
    if row_ok is None:
        o_ref[...] = y
    else:
        pl_triton.store(o_ref, y, mask=jnp.broadcast_to(row_ok, (bm, bn)))


# --------------------------------------------------------------------------------------------- shapes, configs

def check_kernel_shape(x_shape, w: QuantizedWeight) -> None:
    """Raises ValueError with the reason when the Pallas kernel cannot take these shapes."""
    check_dense_operands(x_shape, w, "Pallas kernel")
    for _, _, r, _, sub, _ in _plane_slots(w.bits, w.group_size):
        if sub < 16 or sub & (sub - 1):
            raise ValueError(
                f"kernel needs group_size/{r} to be a power of two >= 16 for {w.bits}-bit weights "
                f"(tensor-core dot tiles), got group_size={w.group_size}")
    if w.n % 16:
        raise ValueError(f"kernel needs N to be a multiple of 16, got N={w.n}")


def _bm_for(m: int) -> int:
    if m <= 16:
        return 16
    if m <= 32:
        return 32
    if m <= 64:
        return 64
    return 128


def default_config(m: int, k: int, n: int, bits: int, group_size: int) -> DenseConfig:
    """Heuristic config (tuned on the H200, see bench/results/quant_matmul.json)."""
    bm = _bm_for(m)
    n_groups = k // group_size
    if bm >= 128:  # prefill: compute tiles, no split
        bn = pow2_divisor(n, 128)
        return DenseConfig(bm=bm, bn=bn, splits=1, groups_per_iter=1, num_warps=8, num_stages=3)
    # Weights as the left operand (wgmma from registers): on the H200 (bench/results/quant_sweep_small_m.json)
    # 1.1x faster than weights on the right for int4 / int6 at M = 4, 16, with BN 64 for int4; int8 wants no
    # software pipelining (num_stages 1: lm_head 233 us vs 291 us on the right, 430 us with 3 stages).
    bn = pow2_divisor(n, 64 if bits == 4 else 128)
    stages = 1 if bits == 8 else 3
    # Enough programs to keep every SM streaming: aim for >= ~4 per SM (132 SMs on the H200), counted at
    # BN 128 (the measured int4 config runs BN 64 with BN 128's split: twice the programs).
    tiles = -(-m // bm) * (n // bn) * bn // 128
    splits = 1
    for s in range(1, n_groups + 1):
        if n_groups % s == 0:
            splits = s
            if tiles * s >= 528:
                break
    gps = n_groups // splits
    gpi = 2 if gps % 2 == 0 else 1
    return DenseConfig(bm=bm, bn=bn, splits=splits, groups_per_iter=gpi, num_warps=4, num_stages=stages,
                       weights_left=True)


def invariant_config(m: int, k: int, n: int, bits: int, group_size: int, prompt_tokens: bool = False) -> DenseConfig:
    """The batch-invariant configuration (pallas_kernels/fixed_order.py): a row's result must not depend on M.

    What sets a row's rounding is the order of its additions: the split of the K groups (fp32 partials summed by
    XLA) and the operand order of the tensor-core dot. So the split depends on K and N only, never on M, and the
    weights are always the dot's left operand; only BM follows M (16 or 64), which leaves each row's arithmetic
    alone (bench/results/quant_invariance_*.json: every weights-left configuration gives the same bits at every M
    from 1 to 8192; weights-right BM 128 does not). Split 4 keeps decode within ~1.0-1.2x of the auto dispatch
    on the H100 (M <= 32), at 2.5-3x its time for prefill-sized M, where auto takes XLA's dot.

    prompt_tokens: the kernel computes prompt tokens only (token kinds, flashnext_jax/token_kinds.py: generated
    tokens take the fixed GEMV), whose steps are prefill chunks: no split (on the H100 at M = 8192, BM 64: 0.85 vs
    1.17 ms for int4 2560x4096, 0.33 vs 0.48 for int8 2560x1280; split 4 is 10-30% faster only at M <= 256,
    bench/results/quant_invariance_splits_h100.json). Still one split for every M, so still invariant."""
    n_groups = k // group_size
    splits = 1 if prompt_tokens else 4 if n_groups % 4 == 0 else 2 if n_groups % 2 == 0 else 1
    return DenseConfig(bm=16 if m <= 16 else 64, bn=pow2_divisor(n, 64 if bits == 4 else 128), splits=splits,
                       groups_per_iter=1, num_warps=4, num_stages=1 if bits == 8 else 3, weights_left=True)


# --------------------------------------------------------------------------------------------- entry points

def quant_matmul_pallas(x: jax.Array, w: QuantizedWeight | LayerSlice, *, config: DenseConfig | None = None,
                        interpret: bool = False) -> jax.Array:
    """y [M, N] = x @ dequant(w) with the tensor-core kernel; a LayerSlice is read in place from its stack."""
    check_kernel_shape(x.shape, w)
    m, k = x.shape
    n = w.n
    g = w.group_size
    n_groups = k // g
    cfg = config or default_config(m, k, n, w.bits, g)
    if n % cfg.bn or n_groups % cfg.splits or (n_groups // cfg.splits) % cfg.groups_per_iter:
        raise ValueError(f"config {cfg} does not tile N={n}, groups={n_groups}")
    bm = cfg.bm
    planes, scales, layer = kernel_operands(w)
    split_out = cfg.splits > 1
    grid = (n // cfg.bn, cfg.splits, -(-m // bm))
    in_specs = [pl.BlockSpec((bm, k), lambda j, s, i: (i, 0))]
    in_specs += [weight_spec(pl, (p.shape[-2], cfg.bn), lambda j, s, i: (0, j), layer) for p in planes]
    in_specs += [weight_spec(pl, (n_groups, cfg.bn), lambda j, s, i: (0, j), layer)]
    if split_out:
        out_shape = jax.ShapeDtypeStruct((cfg.splits, m, n), jnp.float32)
        out_spec = pl.BlockSpec((None, bm, cfg.bn), lambda j, s, i: (s, i, j))
    else:
        out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
        out_spec = pl.BlockSpec((bm, cfg.bn), lambda j, s, i: (i, j))
    kernel = functools.partial(
        _dense_kernel, bits=w.bits, group_size=g, n_planes=len(planes),
        groups_per_split=n_groups // cfg.splits, groups_per_iter=cfg.groups_per_iter, bn=cfg.bn,
        weights_left=cfg.weights_left, m=m, interpret=interpret)
    params = None
    if not interpret and pl_triton is not None:
        params = pl_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    y = pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_spec, out_shape=out_shape,
        interpret=interpret, compiler_params=params,
        name=f"quant_matmul_w{w.bits}g{g}_bm{bm}_bn{cfg.bn}_s{cfg.splits}{'_wl' if cfg.weights_left else ''}",
    )(x, *planes, scales)
    if split_out:
        # batch-invariant traces add the split partials as a fixed tree of elementwise adds: as an XLA reduce,
        # fused into what reads it, its order can follow the program's row count (the H100 step probe saw the QSA
        # indexer's INT8 projection round a row differently at 2 x 512 rows: docs/batch-invariance.md)
        y = fixed_order.tree_sum(y, axis=0).astype(x.dtype)  # XLA's sum when the mode is off
    return y


# --------------------------------------------------------------------------------------------- dispatch

DECODE_MAX_M = 32  # above this, dequant + XLA dot is faster than the kernel (see the module docstring)
# path="auto" takes the GEMV kernel up to this M: on the H200 it beats the tensor-core kernel at M = 1 and 2 on
# every benchmarked shape (int4 8192x28672: 52.5 vs 119 us; lm_head int8: 186 vs 296 us at M = 1) and loses
# from M = 4 (int4 8192x28672 138 us: each extra token re-does the per-weight multiply-adds on CUDA cores).
GEMV_AUTO_MAX_M = 2
PATHS = ("auto", "kernel", "dequant_dot", "gemv", "gemv_fixed", "prompt_fixed")


def dequant_dot_xla(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """Prefill path: dequantize to bf16 with XLA (the product q * scale rounded to bf16), then XLA's dot
    with fp32 accumulation. Measured on the H200 as the bench's `xla_dequant_us` column."""
    from pallas_kernels.quant_layout import dequantize_ints
    w = unstacked(w)  # a slice of the stack: fused into the dequantize
    q = dequantize_ints(w).astype(jnp.bfloat16)
    s = jnp.repeat(jnp.asarray(w.scales).astype(jnp.bfloat16), w.group_size, axis=-2)
    return jnp.dot(x.astype(jnp.bfloat16), q * s, preferred_element_type=jnp.float32).astype(x.dtype)


def quant_matmul(x: jax.Array, w, *, impl: str | None = None, config: DenseConfig | GemvConfig | None = None,
                 path: str = "auto") -> jax.Array:
    """y [M, N] = x [M, K] @ dequant(w) [K, N], accumulated in float32, returned in x.dtype.

    impl: None (FLASHNEXT_KERNELS, default 'auto'), 'auto', 'pallas', 'interpret' or 'reference'.
    path (kernel impls only): 'auto' (kernel for M <= DECODE_MAX_M and shapes it can tile, else
    dequant_dot_xla), 'kernel' (raises ValueError for shapes it cannot take), 'dequant_dot', 'gemv' (the
    CUDA-core GEMV kernel for M <= GEMV_MAX_M; raises ValueError for shapes it cannot take; config is then a
    GemvConfig) or 'gemv_fixed' (the GEMV kernel's batch-invariant variant for any M, quant_matmul_gemv_fixed:
    its configuration is fixed, so it takes no config; ValueError for shapes it cannot take) or 'prompt_fixed'
    (as 'auto', but a batch-invariant trace takes the prompt-token configuration, invariant_config(prompt_tokens=
    True): the tensor-core kernel's share of a step with token kinds). A plain
    (unquantized) array w always takes the reference path."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if path == "gemv_fixed" and config is not None:
        raise ValueError("path='gemv_fixed' runs a fixed configuration (quant_gemv.fixed_gemv_config): no config")
    mode = resolve_impl(impl)
    if mode == "reference" or not isinstance(w, (QuantizedWeight, LayerSlice)):
        return quant_matmul_reference(x, unstacked(w))
    if path == "gemv_fixed":
        return quant_matmul_gemv_fixed(x, w, interpret=(mode == "interpret"))
    prompt_tokens = path == "prompt_fixed"
    path = "auto" if prompt_tokens else path
    if path == "auto" and fixed_order.enabled() and config is None:
        try:
            check_kernel_shape(x.shape, w)
        except ValueError:  # a shape the kernel cannot tile: every row count takes XLA's path
            return dequant_dot_xla(x, w)
        cfg = invariant_config(x.shape[0], w.k, w.n, w.bits, w.group_size, prompt_tokens)
        return quant_matmul_pallas(x, w, config=cfg, interpret=(mode == "interpret"))
    if path == "gemv":
        return quant_matmul_gemv(x, w, config=config, interpret=(mode == "interpret"))
    if path == "dequant_dot" or (path == "auto" and x.shape[0] > DECODE_MAX_M):
        return dequant_dot_xla(x, w)
    interpret = mode == "interpret"
    if path == "auto":
        chosen = dispatch_path(x.shape, w)
        if chosen == "gemv":
            return quant_matmul_gemv(x, w, config=config if isinstance(config, GemvConfig) else None,
                                     interpret=interpret)
        if chosen == "dequant_dot":
            return dequant_dot_xla(x, w)
        config = config if isinstance(config, DenseConfig) else None
    return quant_matmul_pallas(x, w, config=config, interpret=interpret)


def dispatch_path(x_shape, w: QuantizedWeight) -> str:
    """What quant_matmul(path="auto") runs for x [M, K] @ w on the kernel impls: "gemv", "kernel" or
    "dequant_dot" (M > DECODE_MAX_M, or a shape neither kernel can take)."""
    m = x_shape[0]
    if m <= GEMV_AUTO_MAX_M:
        try:
            check_gemv_shape(x_shape, w)
            k, n = w.k, w.n
            check_gemv_config(default_gemv_config(m, k, n, w.bits, w.group_size), m, k, n, w.bits, w.group_size)
            return "gemv"
        except ValueError:
            pass
    if m > DECODE_MAX_M:
        return "dequant_dot"
    try:
        check_kernel_shape(x_shape, w)
    except ValueError:  # a shape the kernel cannot tile (e.g. N % 16): XLA's path still works
        return "dequant_dot"
    return "kernel"
