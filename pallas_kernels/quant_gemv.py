"""CUDA-core GEMV for y = x @ dequant(W) at decode sizes (M <= GEMV_MAX_M; quant_matmul's auto path uses it for
M <= 2), and its inner loop `gemv_accumulate`, shared with the MoE decode kernels (moe_matmul.py).

Why (H200 sweep bench/quant_sweep.py, results in docs/kernels-quant-matmul.md): the tensor-core kernel of
quant_matmul.py is bound by moving dequantized values into the mma operand layout; at M <= 2 there is nothing for
the tensor cores to amortise, so plain FMAs on register tiles are faster. No tensor cores here.
* Grid (N / BN column tiles, split-K). A program walks its groups ("steps"); per step it loads the group's
  packed bytes as [R, BN] uint8 tiles (R = `rows` plane rows per chunk, coalesced along N), turns every field
  into an fp32 number with the offset-binary trick and accumulates ELEMENTWISE:
      T[m] = -C[m] + sum_{chunk, slot} f * x[m, k]     (f = offset + q, [R, BN], one FMA per field and token)
      acc[m] += T[m] * s[g, :]                          (one FMA per [R, BN] element per group and token)
  and reduces acc over its R rows once, at the end of the program (no per-group cross-thread reduction).
  C[m] = sum over the group's chunks and slots of offset * x (an [R, 1] column, per row not per element),
  so the offset costs nothing per weight: it is the addend of the first FMA.
* Fields (`fields="asm"`: inline PTX on 4 packed bytes = one 32-bit register, `elementwise_inline_asm` with
  pack=4, so every column keeps its own element and nothing is interleaved; `fields="jnp"`: the same bit
  formulas per byte, left to LLVM; interpret mode always runs the jnp formulas, which are bit-identical, and
  tests/test_quant_matmul.py runs the PTX text through a small interpreter against them):
    int4: t = w << 12, w << 4, w >> 4, w >> 12 puts byte i's low nibble at bits 12..15 and its high nibble at
          16..19; lo = (t & 0xF000) ^ 0x45008000 = 2048 + (nibble ^ 8) = 2056 + q (fp32 exponent 2^11),
          hi = (t & 0xF0000) ^ 0x43080000 = 136 + q: 4 SHF + 8 LOP3 per 8 weights = 1.5 int ops / weight.
    int8: w ^= 0x80808080 (offset binary), f_i = prmt(w, 0x47000000, 0x76i4) = bytes [00, u_i, 00, 47]
          = 32768 + u_i = 32896 + q: 1 XOR + 4 PRMT per 4 weights = 1.25 int ops / weight.
    int6: P ^= 0xAAAAAAAA (2-bit h -> h + 2), four 6-bit words C_s = (low nibble plane field) | (h field << 4)
          (A & 0x0F0F0F0F | (P << 4) & 0x30303030, ...: 14 ops), f = prmt(C_s, 0x43000000, 0x7i54) = bytes
          [00, 00, C_s byte i, 43] = 128 + u6 = 160 + q: 30 int ops per 16 weights = 1.9 int ops / weight.
  The magic exponents keep the offset small next to |q| (T's fp32 rounding is ~offset * 2^-24 * |x| per
  FMA): measured relative error (fp32 x and y) ~5e-6 (int4), ~4e-7 (int6), ~3e-5 (int8).
  jax 0.11.2 quirks handled here: elementwise_inline_asm lowers only ONE result (two fp32 fields travel as one
  i64, split by a truncation and a one-instruction register-pair pick), and uint result avals become MLIR
  ui32/ui64, which Triton's verifier rejects (results are i32/i64).
* Cost per weight at M = 1, estimate: R = 16 rows per chunk gives every [R, BN] element 8 fields per int4 /
  int8 g128 group (4 per int6 g64 group), so FP32 = 1 FMA + 1/8 (scale) [+ 1/8 int6] and integer = 1.25 - 1.9
  (+ ~0.1 scale conversions); x loads and C are per row, amortized over BN. Measured (this kernel lowered on
  the CPU and compiled for sm_90 by Triton 3.9 + ptxas, SASS of the loop body, instructions per weight,
  BN 128, R 16, 4 warps): int4 3.1 (1.2 FP + 1.8 int), int6 3.9 (1.3 + 2.3), int8 3.0 (1.2 + 1.6); M = 2:
  int4 4.5; M = 3 (R 8): 6.3; M = 4 (R 8): 7.8 at 253 registers. fields="jnp" (LLVM's per-byte code): int4
  4.5, int6 7.8, int8 4.9. Budget: 132 SMs x 128 lanes x 1.98 GHz = 3.3e13 lane-ops/s, integer ops at most
  half of it. At 75% of a 4.29 TB/s copy = 3.2 TB/s the kernel must turn out 6.4e12 int4 (4.3e12 int6,
  3.2e12 int8) weights/s: 5.2 (int4), 7.8 (int6), 10.4 (int8) lane-ops per weight, integer <= 2.6 (int4),
  3.9 (int6). So M = 1 fits at every width, M = 2 at int4 only just, M = 4 at int4 does not (~0.6).
* Latency: nothing pipelines these loads (Triton's pipeliner only takes loads feeding a dot), and ptxas sinks
  each load to its first use, which leaves one 16-byte load per thread in flight. `sync_loads` puts a CTA
  barrier after each iteration's loads: ptxas cannot move them below it, so all chunks of the step (8 KB per
  program at int4 g128, BN 128; `unroll=2`: two steps) are in flight together, at no instruction cost (the
  barrier merges with the one Triton already emits for the scale's layout conversion). `prefetch=True`
  (carry the next step's bytes through the loop) is available but costs ~1.5 instructions per weight: the
  loop-carried uint8 tensor is split into bytes and re-packed for the asm. Default grid: >= 528 programs (1056
  for matrices of >= 16M weights, see default_gemv_config).
* Split-K: fp32 partials [splits, M, N] summed by XLA; splits = 1 writes y in x.dtype directly.

Fixed variant (`quant_matmul_gemv_fixed`), for batch-invariant steps (pallas_kernels/fixed_order.py,
docs/batch-invariance.md: a token's result must be bitwise the same whatever other rows share its matmul). The
engine sends generated tokens through it at every M and prompt tokens through the tensor-core kernel, so a
token's rounding follows its kind, never the step's shape. What the fast entry point lets M choose is fixed:
the config is M = 1's (`fixed_gemv_config`: rows 16, its split-K and BN), tokens run in tiles of TM = 1 (M = 1)
or 2 rows (x zero-padded), TM being one more grid axis, and the split partials are added in a fixed pairwise tree
(`fixed_order.pairwise_sum`; XLA's reduce may order them by the shape). TM does not touch a token's arithmetic:
`gemv_accumulate` keeps one chain of FMAs per token, so row i of any M equals the 1-row call on x[i:i+1].
The token tile is grid axis 0, the fastest in CUDA's launch order: the programs that read one weight tile (one
per TM rows) are launched back to back, so all but the first should find it in L2 (not yet measured on a GPU).
The fast entry point runs the same pallas_call with its M rows as one token tile.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import fixed_order
from pallas_kernels.quant_layout import (LayerSlice, QuantizedWeight, check_dense_operands, is_pow2, kernel_operands,
                                         pow2_divisor, weight_spec)

try:  # the Triton compiler params and inline asm; absent or unused in interpret mode
    from jax.experimental.pallas import triton as pl_triton
except Exception:  # pragma: no cover
    pl_triton = None


GEMV_MAX_M = 8  # the GEMV kernel keeps 2 [rows, BN] fp32 tiles per token in registers: small M only
GEMV_FIELDS = ("asm", "jnp")


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    bn: int = 128  # output columns per program (power of two dividing N)
    splits: int = 1  # split-K programs (must divide the number of groups); 1 = y written in x.dtype
    rows: int = 16  # plane rows per chunk (power of two dividing the rows of one slot of one group)
    num_warps: int = 4
    num_stages: int = 1  # no dot in the loop: explicit register prefetch instead of Triton's pipeliner
    fields: str = "asm"  # "asm": inline PTX on 4 packed bytes; "jnp": the same formulas per byte (LLVM)
    unroll: int = 1  # steps (groups) per loop iteration, all their loads issued before their math
    sync_loads: bool = True  # CTA barrier after each iteration's loads, so that they are all in flight at once
    prefetch: bool = False  # carry the next step's bytes through the loop (costs byte repacking, see docstring)


# Offsets of the fp32 fields (f = offset + q) per slot; see the module docstring for the bit formulas.
_OFF4_LO, _OFF4_HI, _OFF8, _OFF6 = 2056.0, 136.0, 32896.0, 160.0


def gemv_layout(bits: int, group_size: int):
    """How one group is read by the GEMV path.

    Returns (loads, space, slots): `loads` = [(plane, row offset inside the group's rows of that plane, rows of
    that plane per group)] = the raw tiles of one chunk (every one [rows, BN], read at
    g * rows_per_group + offset + chunk * rows); `space` = rows per group of each load (the dimension cut into
    chunks); `slots` = [(column offset of the slot's x slice inside the group, field offset)] in the order the
    field extractor returns the fields."""
    g = group_size
    if bits == 8:
        return [(0, 0, g)], g, [(0, _OFF8)]
    if bits == 4:
        return [(0, 0, g // 2)], g // 2, [(0, _OFF4_LO), (g // 2, _OFF4_HI)]
    if bits == 6:  # A = low-nibble rows of slots 0/2, B = rows of slots 1/3, P = the 2-bit plane
        q = g // 4
        return [(0, 0, g // 2), (0, q, g // 2), (1, 0, q)], q, [(s * q, _OFF6) for s in range(4)]
    raise ValueError(f"unsupported bits {bits}")


# Inline PTX, one call per pair of fields: jax 0.11.2's Pallas lowering of elementwise_inline_asm takes a single
# result, so two fp32 bit patterns travel as one u64 per element (mov.b64 {lo, hi}; splitting it again is a
# register-pair pick). pack=4: $0..$3 are the outputs of the 4 bytes of one 32-bit input register.
def _asm_pack2(prologue: list[str], lo: list[str], hi: list[str], regs: str) -> str:
    """lo[i] / hi[i]: PTX computing the two fields of byte i into registers a / b."""
    lines = ["{", f".reg .b32 a, b, {regs};"] + prologue
    for i in range(4):
        lines += [lo[i], hi[i], f"mov.b64 ${i}, {{a, b}};"]
    return "\n".join(lines + ["}"])


_ASM4 = _asm_pack2(
    ["shl.b32 t0, $4, 12;", "shl.b32 t1, $4, 4;", "shr.u32 t2, $4, 4;", "shr.u32 t3, $4, 12;"],
    [f"lop3.b32 a, t{i}, 0x0000F000, 0x45008000, 0x6A;" for i in range(4)],
    [f"lop3.b32 b, t{i}, 0x000F0000, 0x43080000, 0x6A;" for i in range(4)], "t<4>")

_ASM8 = "\n".join(["{", ".reg .b32 w;", "xor.b32 w, $4, 0x80808080;"]
                  + [f"prmt.b32 ${i}, w, 0x47000000, 0x76{i}4;" for i in range(4)] + ["}"])

# int6, args $4 = A (low nibbles of slots 0/2), $5 = B (slots 1/3), $6 = P (2-bit fields); call 0 makes the
# fields of slots 0 and 1, call 1 those of slots 2 and 3.
_ASM6 = (
    _asm_pack2(["xor.b32 p, $6, 0xAAAAAAAA;",
                "shl.b32 q, p, 4;", "and.b32 q, q, 0x30303030;", "lop3.b32 c0, $4, 0x0F0F0F0F, q, 0xEA;",
                "shl.b32 q, p, 2;", "and.b32 q, q, 0x30303030;", "lop3.b32 c1, $5, 0x0F0F0F0F, q, 0xEA;"],
               [f"prmt.b32 a, c0, 0x43000000, 0x7{i}54;" for i in range(4)],
               [f"prmt.b32 b, c1, 0x43000000, 0x7{i}54;" for i in range(4)], "p, q, c0, c1"),
    _asm_pack2(["xor.b32 p, $6, 0xAAAAAAAA;",
                "shr.u32 t, $4, 4;", "and.b32 q, p, 0x30303030;", "lop3.b32 c0, t, 0x0F0F0F0F, q, 0xEA;",
                "shr.u32 t, $5, 4;", "shr.u32 q, p, 2;", "and.b32 q, q, 0x30303030;",
                "lop3.b32 c1, t, 0x0F0F0F0F, q, 0xEA;"],
               [f"prmt.b32 a, c0, 0x43000000, 0x7{i}54;" for i in range(4)],
               [f"prmt.b32 b, c1, 0x43000000, 0x7{i}54;" for i in range(4)], "p, q, t, c0, c1"),
)


def _fields_asm(bits: int, raws):
    # Signed result dtypes on purpose: the lowering turns uint avals into MLIR ui32/ui64, which Triton's
    # verifier rejects (its integers are signless); i32/i64 carry the same bits.
    shape = raws[0].shape
    calls = {4: (_ASM4,), 8: (_ASM8,), 6: _ASM6}[bits]
    out = []
    for asm in calls:
        wide = bits != 8
        constraints = ",".join(["=l" if wide else "=r"] * 4 + ["r"] * len(raws))
        [v] = pl_triton.elementwise_inline_asm(
            asm, args=list(raws), constraints=constraints, pack=4,
            result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.int64 if wide else jnp.int32)])
        if wide:  # low half: a truncation; high half: a register-pair pick (jnp's 64-bit >> 32 needs x64)
            [hi] = pl_triton.elementwise_inline_asm(
                "{\n.reg .b32 lo;\nmov.b64 {lo, $0}, $1;\n}", args=[v], constraints="=r,l", pack=1,
                result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.int32)])
            out += [v.astype(jnp.int32), hi]
        else:
            out.append(v)
    return out


def _fields_jnp(bits: int, raws):
    """Bit-identical per-byte version of the PTX (uint32 patterns of the fp32 fields)."""
    u = [jax.lax.bitcast_convert_type(r, jnp.uint8).astype(jnp.uint32) if r.dtype == jnp.int8
         else r.astype(jnp.uint32) for r in raws]
    if bits == 4:
        t = u[0] << 12
        return [(t & 0xF000) ^ 0x45008000, (t & 0xF0000) ^ 0x43080000]
    if bits == 8:
        return [((u[0] ^ 0x80) << 8) | 0x47000000]
    a, b, p = u
    p = p ^ 0xAA
    cs = [(a & 0xF) | ((p << 4) & 0x30), (b & 0xF) | ((p << 2) & 0x30),
          (a >> 4) | (p & 0x30), (b >> 4) | ((p >> 2) & 0x30)]
    return [(c << 16) | 0x43000000 for c in cs]


def gemv_fields(bits: int, raws, use_asm: bool):
    """fp32 fields (offset + q) [rows, BN] of one chunk's raw tiles, in gemv_layout's slot order."""
    pats = _fields_asm(bits, raws) if use_asm else _fields_jnp(bits, raws)
    return [jax.lax.bitcast_convert_type(f, jnp.float32) for f in pats]


def gemv_accumulate(accs, n_steps, step, load_x, load_plane, load_scale, *, bits: int, group_size: int,
                    rows: int, use_asm: bool, unroll: int = 1, prefetch: bool = False,
                    sync_loads: bool = False):
    """The GEMV inner loop shared by the dense and the MoE kernels (see the module docstring).

    accs: tuple over column tiles of tuples over tokens of fp32 [rows, BN] accumulators (unreduced over rows).
    step(t) -> (g, ctx): the group index (plane rows, x columns) and loader context of step t (traced).
    load_plane(ctx, tile, plane, row0, nrows) -> [nrows, BN] packed bytes; load_x(ctx, m, col0, n) -> [n]
    activations of token m (any float dtype); load_scale(ctx, tile, g) -> [1, BN] float32 (a 2-D load: the
    row layout of the tiles, no layout conversion; any extra per-column factor may be folded in). All tiles
    share x. unroll: steps per loop iteration (all loads first; 1 when it
    does not divide n_steps); prefetch: carry the next step's raw bytes through the loop instead; sync_loads:
    a CTA barrier after each iteration's loads (GPU only). Returns the updated accs."""
    loads, space, slots = gemv_layout(bits, group_size)
    if space % rows:
        raise ValueError(f"rows={rows} must divide the {space} rows of one slot of a group")
    nchunks = space // rows
    n_tiles, n_tok = len(accs), len(accs[0])
    f32 = jnp.float32

    def fetch(t):
        g, ctx = step(t)
        return tuple(tuple(tuple(load_plane(ctx, ti, pi, g * prow + roff + c * rows, rows)
                                 for pi, roff, prow in loads)
                           for c in range(nchunks))
                     for ti in range(n_tiles))

    def compute(t, raws, accs):
        g, ctx = step(t)
        xs = [[[load_x(ctx, m, g * group_size + xoff + c * rows, rows).astype(f32) for xoff, _ in slots]
               for c in range(nchunks)] for m in range(n_tok)]
        negc = []
        for m in range(n_tok):
            cm = None
            for c in range(nchunks):
                for (_, off), xv in zip(slots, xs[m][c]):
                    cm = off * xv if cm is None else cm + off * xv
            negc.append((-cm)[:, None])
        new = []
        for ti in range(n_tiles):
            tt = list(negc)
            for c in range(nchunks):
                fs = gemv_fields(bits, raws[ti][c], use_asm)
                for m in range(n_tok):
                    for f, xv in zip(fs, xs[m][c]):
                        tt[m] = tt[m] + f * xv[:, None]
            sc = load_scale(ctx, ti, g)
            new.append(tuple(accs[ti][m] + tt[m] * sc for m in range(n_tok)))
        return tuple(new)

    if prefetch and n_steps > 1:
        def body(t, carry):
            accs, raws = carry
            nxt = fetch(jnp.minimum(t + 1, n_steps - 1))
            return compute(t, raws, accs), nxt

        accs, _ = jax.lax.fori_loop(0, n_steps, body, (accs, fetch(0)))
        return accs
    unroll = unroll if n_steps % unroll == 0 else 1

    def body(i, accs):
        ts = [i * unroll + u for u in range(unroll)]
        raws = [fetch(t) for t in ts]  # every load of the iteration first
        if sync_loads:  # a CTA barrier: ptxas cannot sink the loads below it to their first use
            pl_triton.debug_barrier()
        for t, r in zip(ts, raws):
            accs = compute(t, r, accs)
        return accs

    return jax.lax.fori_loop(0, n_steps // unroll, body, accs)


def _gemv_kernel(x_ref, *refs, bits, group_size, n_planes, m, groups_per_split, rows, use_asm, unroll,
                 prefetch, sync_loads):
    plane_refs = refs[:n_planes]
    s_ref, o_ref = refs[n_planes], refs[n_planes + 1]
    bn = o_ref.shape[-1]
    g0 = pl.program_id(2) * groups_per_split  # grid (token tile, column tile, split)

    def load_plane(ctx, ti, pi, r0, nr):
        return plane_refs[pi][pl.ds(r0, nr), :]

    def load_x(ctx, mi, c0, n):
        return x_ref[mi, pl.ds(c0, n)]

    def load_scale(ctx, ti, g):
        return s_ref[g, :].astype(jnp.float32)[None, :]

    zero = jnp.zeros((rows, bn), jnp.float32)
    accs = gemv_accumulate(((zero,) * m,), groups_per_split, lambda t: (g0 + t, None), load_x, load_plane,
                           load_scale, bits=bits, group_size=group_size, rows=rows, use_asm=use_asm,
                           unroll=unroll, prefetch=prefetch, sync_loads=sync_loads)
    for mi in range(m):
        o_ref[mi, :] = jnp.sum(accs[0][mi], axis=0).astype(o_ref.dtype)


def check_gemv_shape(x_shape, w: QuantizedWeight, max_m: int | None = GEMV_MAX_M) -> None:
    """Raises ValueError with the reason when the GEMV kernel cannot take these shapes (any config); max_m None:
    any M >= 1 (the fixed variant's token tiles)."""
    check_dense_operands(x_shape, w, "GEMV kernel")
    if x_shape[0] < 1 or (max_m is not None and x_shape[0] > max_m):
        bound = "" if max_m is None else f" <= {max_m}"
        raise ValueError(f"the GEMV kernel takes 1 <= M{bound} rows of x, got M={x_shape[0]}")
    if w.n % 16:
        raise ValueError(f"the GEMV kernel needs N to be a multiple of 16, got N={w.n}")


def check_gemv_config(cfg: GemvConfig, m: int, k: int, n: int, bits: int, group_size: int) -> None:
    _, space, _ = gemv_layout(bits, group_size)
    n_groups = k // group_size
    problems = []
    if not is_pow2(cfg.bn) or cfg.bn < 16 or n % cfg.bn:
        problems.append(f"bn={cfg.bn} must be a power of two >= 16 dividing N={n}")
    if cfg.splits < 1 or n_groups % cfg.splits:
        problems.append(f"splits={cfg.splits} must divide the {n_groups} groups")
    if not is_pow2(cfg.rows) or space % cfg.rows:
        problems.append(f"rows={cfg.rows} must be a power of two dividing {space} (rows of one slot of a group)")
    if cfg.unroll < 1 or (n_groups // max(cfg.splits, 1)) % cfg.unroll:
        problems.append(f"unroll={cfg.unroll} must divide the {n_groups // max(cfg.splits, 1)} groups per split")
    if cfg.fields not in GEMV_FIELDS:
        problems.append(f"fields must be one of {GEMV_FIELDS}, got {cfg.fields!r}")
    if cfg.fields == "asm" and (cfg.rows * cfg.bn) % (4 * 32 * cfg.num_warps):
        problems.append(f"fields='asm' packs 4 bytes per thread: rows*bn={cfg.rows * cfg.bn} must be a "
                        f"multiple of 4 * 32 * num_warps={128 * cfg.num_warps}")
    if problems:
        raise ValueError(f"GEMV config {cfg} does not fit M={m}, K={k}, N={n}, {bits}-bit g{group_size}: "
                         + "; ".join(problems))


def _splits_for(n_groups: int, tiles: int, target_programs: int) -> int:
    for s in range(1, n_groups + 1):
        if n_groups % s == 0 and tiles * s >= target_programs:
            return s
    return n_groups


def default_gemv_config(m: int, k: int, n: int, bits: int, group_size: int,
                        target_programs: int | None = None) -> GemvConfig:
    """Heuristic: BN 128 (or the largest power of two dividing N), 16 rows per chunk (8 for M > 2: two fp32
    [rows, BN] tiles per token live in registers), split-K until >= target_programs programs: 8 per SM for
    matrices of >= 16M weights, 4 per SM below (H200 sweep, bench/results/quant_sweep.json: int4 8192x28672
    52.5 us at 8/SM vs 59.6 at 4/SM; int6 2560x10240 12.7 vs 14.0; int6 6144x2560 11.4 vs 10.8)."""
    _, space, _ = gemv_layout(bits, group_size)
    if target_programs is None:
        target_programs = 1056 if k * n >= (1 << 24) else 528
    bn = pow2_divisor(n, 128)
    rows = pow2_divisor(space, 16 if m <= 2 else 8)
    warps = 4
    while (rows * bn) % (128 * warps) and rows * 2 <= space and is_pow2(rows * 2):
        rows *= 2
    fields = "asm" if (rows * bn) % (128 * warps) == 0 else "jnp"
    splits = _splits_for(k // group_size, n // bn, target_programs)
    return GemvConfig(bn=bn, splits=splits, rows=rows, num_warps=warps, fields=fields)


def gemv_call_options(cfg, interpret: bool) -> dict:
    """pallas_call compiler params + the kernel options every GEMV kernel takes from its config (GemvConfig or
    moe_matmul.MoEGemvConfig), with the GPU-only features (inline PTX, load barrier) off in the interpreter."""
    params = None
    if not interpret and pl_triton is not None:
        params = pl_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return {"params": params, "interpret": interpret, "rows": cfg.rows,
            "kernel": {"use_asm": cfg.fields == "asm" and not interpret, "unroll": cfg.unroll,
                       "sync_loads": cfg.sync_loads and not interpret}}


def fixed_gemv_config(k: int, n: int, bits: int, group_size: int) -> GemvConfig:
    """The config of `quant_matmul_gemv_fixed` at every M: the fast mode's config for one token (rows 16, its
    split-K and BN), so that a generated token alone runs the fast mode's kernel. It depends on K, N and the format
    only: a token's additions (split boundaries, rows per chunk, BN) must not follow M."""
    return default_gemv_config(1, k, n, bits, group_size)


def _gemv_pallas_call(x, w: QuantizedWeight | LayerSlice, cfg: GemvConfig, tm: int, interpret: bool,
                      name: str) -> jax.Array:
    """The GEMV kernel over the grid (token tile of tm rows of x, column tile, split): y [M, N] in x.dtype when
    cfg.splits == 1, else the fp32 partials [splits, M, N]. M must be a multiple of tm."""
    m, k = x.shape
    n, g = w.n, w.group_size
    n_groups = k // g
    planes, scales, layer = kernel_operands(w)
    grid = (m // tm, n // cfg.bn, cfg.splits)
    in_specs = [pl.BlockSpec((tm, k), lambda i, j, s: (i, 0))]
    in_specs += [weight_spec(pl, (p.shape[-2], cfg.bn), lambda i, j, s: (0, j), layer) for p in planes]
    in_specs += [weight_spec(pl, (n_groups, cfg.bn), lambda i, j, s: (0, j), layer)]
    if cfg.splits > 1:
        out_shape = jax.ShapeDtypeStruct((cfg.splits, m, n), jnp.float32)
        out_spec = pl.BlockSpec((None, tm, cfg.bn), lambda i, j, s: (s, i, j))
    else:
        out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
        out_spec = pl.BlockSpec((tm, cfg.bn), lambda i, j, s: (i, j))
    opts = gemv_call_options(cfg, interpret)
    kernel = functools.partial(
        _gemv_kernel, bits=w.bits, group_size=g, n_planes=len(planes), m=tm,
        groups_per_split=n_groups // cfg.splits, rows=opts["rows"], prefetch=cfg.prefetch, **opts["kernel"])
    return pl.pallas_call(
        kernel, grid=grid, in_specs=in_specs, out_specs=out_spec, out_shape=out_shape,
        interpret=interpret, compiler_params=opts["params"],
        name=f"{name}_w{w.bits}g{g}_m{tm}_bn{cfg.bn}_s{cfg.splits}_r{cfg.rows}_u{cfg.unroll}_{cfg.fields}",
    )(x, *planes, scales)


def quant_matmul_gemv(x: jax.Array, w: QuantizedWeight | LayerSlice, *, config: GemvConfig | None = None,
                      interpret: bool = False) -> jax.Array:
    """y [M, N] = x @ dequant(w) with the CUDA-core GEMV kernel (M <= GEMV_MAX_M; all M rows in one token tile);
    ValueError otherwise. A LayerSlice is read in place from its stacked arrays."""
    check_gemv_shape(x.shape, w)
    m, k = x.shape
    cfg = config or default_gemv_config(m, k, w.n, w.bits, w.group_size)
    check_gemv_config(cfg, m, k, w.n, w.bits, w.group_size)
    y = _gemv_pallas_call(x, w, cfg, m, interpret, "quant_gemv")
    if cfg.splits > 1:
        y = y.sum(axis=0).astype(x.dtype)
    return y


def checked_fixed_config(x_shape, w: QuantizedWeight | LayerSlice) -> GemvConfig:
    """`fixed_gemv_config` for x [M, K] @ w, checked for the kernel and its 2-row token tiles; ValueError with the
    reason where the fixed variant cannot take the shapes."""
    check_gemv_shape(x_shape, w, max_m=None)
    cfg = fixed_gemv_config(w.k, w.n, w.bits, w.group_size)
    check_gemv_config(cfg, 2, w.k, w.n, w.bits, w.group_size)
    return cfg


def gemv_fixed_fits(w: QuantizedWeight | LayerSlice) -> bool:
    """Whether `quant_matmul_gemv_fixed` takes this weight (callers keep another invariant path for the rest)."""
    try:
        checked_fixed_config((1, w.k), w)
    except ValueError:
        return False
    return True


def quant_matmul_gemv_fixed(x: jax.Array, w: QuantizedWeight | LayerSlice, *, interpret: bool = False) -> jax.Array:
    """y [M, N] = x @ dequant(w) for any M >= 1, each row bitwise what the 1-row call on it gives (the fixed
    variant, module docstring): `fixed_gemv_config`, token tiles of TM = 1 (M = 1) or 2 rows, split partials in
    `fixed_order.pairwise_sum`. ValueError for shapes the GEMV kernel cannot take. A LayerSlice is read in place."""
    cfg = checked_fixed_config(x.shape, w)
    m = x.shape[0]
    tm = 1 if m == 1 else 2
    rows = -(-m // tm) * tm
    xp = x if rows == m else jnp.pad(x, ((0, rows - m), (0, 0)))
    y = _gemv_pallas_call(xp, w, cfg, tm, interpret, "quant_gemv_fixed")[..., :m, :]
    if cfg.splits > 1:
        y = fixed_order.pairwise_sum(y, axis=0).astype(x.dtype)
    return y
