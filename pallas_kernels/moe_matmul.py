"""Routed-expert MLP over stacked group-quantized experts (grouped MoE), Pallas kernels + reference.

out[m] = sum_j weights[m, j] * (silu(x[m] @ gate_e) * (x[m] @ up_e)) @ down_e,   e = expert_ids[m, j],
with w_gate_up [E, H, 2I] (columns 0..I-1 gate, I..2I-1 up) and w_down [E, I, H]. The activation
h = silu(g) * u is rounded to x.dtype before the down projection (in the kernels and the reference alike).

Kernel scheme (Triton backend pallas_call, same group_dot body as quant_matmul):
1. XLA glue on [M*k] int vectors only (no [E]-sized work): sort the (token, slot) pairs by expert, cut
   the sorted list into tiles of BM rows that each hold ONE expert (a new tile at every expert change and
   every BM rows), and gather x into those padded rows.
2. gate/up kernel, grid (tile, I/BN): loads the tile's expert id, streams only that expert's gate and up
   column tiles, writes h = silu(g) * u. Tiles past the last used one skip all work (never read later).
3. down kernel, grid (tile, H/BN): h @ down_e in float32.
4. XLA: out[m] = sum_j weights[m, j] * y[row of pair (m, j)] (a gather, so padding rows are never read).
An expert's bytes are read once per tile of tokens routed to it, unused experts are never touched.

Decode path for few routed pairs (M*k <= MOE_GEMV_MAX_PAIRS, `path="gemv"`): no sort, no scatter, no tiles.
Every (token, slot) pair p = m*k + j is one GEMV over its own expert e = expert_ids.flat[p] (read in-kernel
from the [M*k] int32 ids), with quant_gemv.gemv_accumulate (the dense GEMV's inner loop, CUDA-core FMAs):
1. gate/up kernel, grid (pair, I/BN, split-K S): streams the gate and the up column tiles of w_gate_up[e] over
   its K range in one loop (both tiles' bytes in flight together). S = 1: h = silu(g) * u fused and written
   in x.dtype; S > 1: fp32 partials [S, P, 2, I] (gate, up).
2. down kernel, grid (pair, H/BN, split-K): h[p] @ w_down[e] in fp32. With MoEGemvConfig.fused_glue (off by
   default until a GPU A/B has measured it) its x-loader reads the S partials itself: for the [rows] slice of h
   it is about to multiply it loads the S gate and S up values, sums them (split 0 first) and applies
   silu(g) * u rounded to x.dtype, the reference's formula; the output tile is multiplied by the pair's
   routing weight and written token-major, y [M, splits * k, H].
3. XLA: out = y.sum(axis=1).astype(x.dtype), one reduce fusion (it can also fuse into the caller's residual
   add). fused_glue=False (the default, the measured path) keeps the XLA glue: XLA sums the S partials and
   applies silu(g) * u between the kernels, the down kernel writes unweighted [splits, P, H], and XLA
   contracts it with the weights (reduce over splits, dot_general over k, cast).
Combine choice: (a) weighted fp32 partials + one XLA reduction, over (b) pl.atomic_add into a zeroed fp32
[M, H] (atomics do run in interpret mode): (b) needs a zero fill before and a cast after, two ops against
one, and its fp32 sum order would change from run to run.
Cost of the fusion: every down program re-derives the activation of its K rows from the 2S partials, and in
the [rows, BN] register tile every thread holds one row, so each [rows] slice costs every warp 2S loads and
2S - 2 adds. SASS instructions per thread (= per warp; Triton 3.9, sm_90, compiled offline) of the down
kernel at H=2560, I=640, int4 g128 (one group per split, no loop): 488 unfused, 1512 fused at M=1 (S = 20,
auto), 1056 at M=2 (S = 10); 720 / 808 / 848 at S = 2 / 4 / 5.
Expected saving at M=1 (H200, 10 pairs, 22.5 us = gate/up 9.8 + down 5.8 + ~7 us of XLA glue): the
activation fusion between the kernels (loop_convert_fusion, 1.6 us; it is absent when S = 1) and the weighted
combine (reduce + dot: loop_reduce_fusion 3.1 and, probably, memcpy32_post 2.2, not yet attributed) become
one plain reduction over 50 x 2560 fp32 (~1.5-3 us): ~2-5 us less glue (the upper end if memcpy32_post
belongs to the combine), against a down kernel that issues 3x the instructions (S = 20: >= 5.8 us if
issue-bound; it was 5.8 us, memory / latency bound). Launches per call: 2 kernels + 1 XLA fusion, was 2 + 3.
To A/B on the GPU: fused_glue True / False, and a smaller splits_gate_up with fused_glue.
A repeated expert is read once per pair that selects it (at decode the top-k are distinct per token).

Fixed variant (`routed_experts_gemv_fixed`, `path="gemv_fixed"`), for batch-invariant steps
(pallas_kernels/fixed_order.py, docs/batch-invariance.md: a token's output must be bitwise the same whatever other
tokens share its call); the engine sends generated tokens through it at every M (flashnext_jax/token_kinds.py).
Each pair is already its own program, so what the decode path lets M choose is the tiling and the XLA glue: the
fixed variant takes both kernels' split-K and BN as for ONE token (pairs = k), whatever M, sums the gate/up split
partials in `fixed_order.pairwise_sum` before silu(g) * u, and combines in fixed pairwise trees: over the down
splits, then (times the routing weight, fp32) over the k slots, then the cast. XLA's reduce and dot may order such
sums by the shape; elementwise adds in a fixed tree give every token the expression of its 1-token call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import fixed_order
from pallas_kernels.kernel_switch import resolve_impl
from pallas_kernels.quant_gemv import GEMV_FIELDS, _splits_for, gemv_accumulate, gemv_call_options, gemv_layout
from pallas_kernels.quant_layout import LayerSlice, QuantizedWeight, dequantize, is_pow2, pow2_divisor, unstacked
from pallas_kernels.quant_matmul import _plane_slots, group_dot, pl_triton


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    bm: int = 16  # token rows per tile
    bn_gate_up: int = 128  # columns of gate (and of up) per program
    bn_down: int = 128
    num_warps: int = 4
    num_stages: int = 3


# routed_experts(path="auto") takes the GEMV path when M*k <= this (0: never). H200, 10-of-512 int4 experts
# (bench/results/quant_sweep_moe_paths.json): the per-pair GEMV beats the sorted tiles at every measured size up to
# 320 pairs (M = 4: 53 vs 114 us; M = 16: 166 vs 311; M = 32: 300 vs 502), although it re-reads an expert for every
# pair routed to it. Larger batches keep the tiles, which read each expert once (M = 64: 729 us, M = 512: 1077 us;
# the GEMV was not measured there).
MOE_GEMV_MAX_PAIRS = 320
MOE_PATHS = ("auto", "tiles", "gemv", "gemv_fixed")


@dataclasses.dataclass(frozen=True)
class MoEGemvConfig:
    bn_gate_up: int = 128  # columns of gate (and of up) per program
    splits_gate_up: int = 0  # split-K of the gate/up kernel over H / G groups; 0 = auto (>= target programs)
    bn_down: int = 128
    splits_down: int = 0  # split-K of the down kernel over I / G groups; 0 = auto
    rows: int = 16  # plane rows per chunk (see quant_matmul.GemvConfig)
    num_warps: int = 4
    num_stages: int = 1
    fields: str = "asm"
    unroll: int = 1
    sync_loads: bool = True
    target_programs: int = 528  # for the auto splits
    # True: no XLA op between the kernels, one after (module docstring). Off by default until measured: the
    # H200 numbers (22.5 us at M=1) are for False; True removes ~2-5 us of XLA glue but triples the down
    # kernel's instructions, so only a GPU A/B (bench/quant_sweep.py) can say which is faster.
    fused_glue: bool = False


# --------------------------------------------------------------------------------------------- reference

def _expert_weight(w, e) -> jax.Array:
    """float32 weights of expert(s) e from a QuantizedWeight or a plain [E, ...] array."""
    if isinstance(w, QuantizedWeight):
        return dequantize(w[e])
    return jnp.asarray(w)[e].astype(jnp.float32)


def _flat_experts(w_gate_up, w_down) -> tuple[QuantizedWeight, QuantizedWeight, int]:
    """(w_gate_up, w_down, expert id offset) for the kernels. LayerSlices of weights stacked over layers
    [L, E, K, N] become [L*E, K, N] (a reshape: no copy) with ids offset by layer * E, so the kernels read the
    layer's experts in place; QuantizedWeights pass through with offset 0."""
    if not isinstance(w_gate_up, LayerSlice) and not isinstance(w_down, LayerSlice):
        return w_gate_up, w_down, 0
    if not (isinstance(w_gate_up, LayerSlice) and isinstance(w_down, LayerSlice)) or w_gate_up.layer != w_down.layer:
        raise ValueError("w_gate_up and w_down must be slices of the same layer of their stacks")

    def flat(w: LayerSlice) -> QuantizedWeight:
        return dataclasses.replace(w.stack, planes=tuple(p.reshape(-1, *p.shape[2:]) for p in w.stack.planes),
                                   scales=w.stack.scales.reshape(-1, *w.stack.scales.shape[2:]))
    return flat(w_gate_up), flat(w_down), w_gate_up.layer * w_gate_up.shape[0]


def routed_experts_reference(x, expert_ids, expert_weights, w_gate_up, w_down) -> jax.Array:
    """Pure JAX: loop over the k selected slots, gathering each token's expert (quantized or plain weights).

    Touches (dequantizes) only the selected experts' weights: [M, H, 2I] per slot."""
    m, h = x.shape
    k = expert_ids.shape[1]
    inter = w_down.shape[-2]
    xf = x.astype(jnp.float32)
    out = jnp.zeros((m, h), jnp.float32)
    hp = jax.lax.Precision.HIGHEST
    for j in range(k):
        e = expert_ids[:, j]
        gu = jnp.einsum("mh,mhn->mn", xf, _expert_weight(w_gate_up, e), precision=hp)
        act = (jax.nn.silu(gu[:, :inter]) * gu[:, inter:]).astype(x.dtype).astype(jnp.float32)
        y = jnp.einsum("mi,mih->mh", act, _expert_weight(w_down, e), precision=hp)
        out = out + expert_weights[:, j].astype(jnp.float32)[:, None] * y
    return out.astype(x.dtype)


# --------------------------------------------------------------------------------------------- routing glue

def _tile_routing(expert_ids: jax.Array, bm: int, num_tiles: int):
    """Sorted-by-expert tiling of the M*k (token, slot) pairs.

    Returns (src_token [num_tiles*bm] (padding rows point at token 0), tile_expert [num_tiles] (-1 = unused
    tile), pos [M, k] = padded row of each pair)."""
    m, k = expert_ids.shape
    t = m * k
    flat = expert_ids.reshape(t).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)
    se = flat[order]
    idx = jnp.arange(t, dtype=jnp.int32)
    is_new = jnp.concatenate([jnp.ones((1,), bool), se[1:] != se[:-1]])
    run_start = jax.lax.cummax(jnp.where(is_new, idx, 0))
    rank = idx - run_start
    new_tile = is_new | (rank % bm == 0)
    tile_id = jnp.cumsum(new_tile.astype(jnp.int32)) - 1
    pos_sorted = tile_id * bm + rank % bm
    tile_expert = jnp.full((num_tiles,), -1, jnp.int32).at[tile_id].set(se)
    src_token = jnp.zeros((num_tiles * bm,), jnp.int32).at[pos_sorted].set(order // k)
    pos = jnp.zeros((t,), jnp.int32).at[order].set(pos_sorted).reshape(m, k)
    return src_token, tile_expert, pos


def num_tiles_for(m: int, k: int, num_experts: int, bm: int) -> int:
    """Upper bound on tiles: every expert run starts a tile, plus one per bm rows."""
    t = m * k
    return min(t, min(num_experts, t) + -(-t // bm))


# --------------------------------------------------------------------------------------------- kernels

def _gate_up_kernel(te_ref, x_ref, *refs, bits, group_size, n_planes, n_groups, inter, bn):
    plane_refs = refs[:n_planes]
    s_ref, o_ref = refs[n_planes], refs[n_planes + 1]
    e = te_ref[pl.program_id(0)]
    j = pl.program_id(1)
    cdt = x_ref.dtype

    @pl.when(e >= 0)
    def _():
        def load_x(c0, nc):
            return x_ref[:, pl.ds(c0, nc)]

        def make_loader(col0):
            def load_plane(pi, r0, nr):
                return plane_refs[pi][e, pl.ds(r0, nr), pl.ds(col0, bn)]
            return load_plane

        gate_loader = make_loader(j * bn)
        up_loader = make_loader(inter + j * bn)

        def body(g, carry):
            acc_g, acc_u = carry
            pg = group_dot(load_x, gate_loader, g, bits=bits, group_size=group_size, compute_dtype=cdt)
            pu = group_dot(load_x, up_loader, g, bits=bits, group_size=group_size, compute_dtype=cdt)
            sg = s_ref[e, pl.ds(g, 1), pl.ds(j * bn, bn)].astype(jnp.float32)
            su = s_ref[e, pl.ds(g, 1), pl.ds(inter + j * bn, bn)].astype(jnp.float32)
            return acc_g + pg * sg, acc_u + pu * su

        zero = jnp.zeros((x_ref.shape[0], bn), jnp.float32)
        acc_g, acc_u = jax.lax.fori_loop(0, n_groups, body, (zero, zero))
        o_ref[...] = (jax.nn.sigmoid(acc_g) * acc_g * acc_u).astype(o_ref.dtype)


def _down_kernel(te_ref, h_ref, *refs, bits, group_size, n_planes, n_groups, bn):
    plane_refs = refs[:n_planes]
    s_ref, o_ref = refs[n_planes], refs[n_planes + 1]
    e = te_ref[pl.program_id(0)]
    j = pl.program_id(1)
    cdt = h_ref.dtype

    @pl.when(e >= 0)
    def _():
        def load_x(c0, nc):
            return h_ref[:, pl.ds(c0, nc)]

        def load_plane(pi, r0, nr):
            return plane_refs[pi][e, pl.ds(r0, nr), pl.ds(j * bn, bn)]

        def body(g, acc):
            p = group_dot(load_x, load_plane, g, bits=bits, group_size=group_size, compute_dtype=cdt)
            sc = s_ref[e, pl.ds(g, 1), pl.ds(j * bn, bn)].astype(jnp.float32)
            return acc + p * sc

        acc = jax.lax.fori_loop(0, n_groups, body, jnp.zeros((h_ref.shape[0], bn), jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)


def _full_spec(a):
    nd = a.ndim
    return pl.BlockSpec(a.shape, lambda t, j: (0,) * nd)


def _check_moe_operands(x_shape, ids_shape, w_gate_up, w_down, kernel: str) -> tuple[int, int, int]:
    """The checks both MoE paths share: quantized stacked weights, x [M, H], ids [M, k], w_gate_up [E, H, 2I],
    w_down [E, I, H], I and H multiples of 16. Returns (E, H, I)."""
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(w, (QuantizedWeight, LayerSlice)):
            raise TypeError(f"the Pallas MoE kernel needs QuantizedWeight {name}, got {type(w).__name__}")
        if w.ndim != 3:
            raise ValueError(f"{name} must be stacked [E, K, N], got {w.shape}")
    if len(x_shape) != 2 or len(ids_shape) != 2 or ids_shape[0] != x_shape[0]:
        raise ValueError(f"x must be [M, H] and expert_ids [M, k]; got {tuple(x_shape)} and {tuple(ids_shape)}")
    e, h, two_i = w_gate_up.shape
    if x_shape[1] != h or two_i % 2:
        raise ValueError(f"w_gate_up {w_gate_up.shape} does not match x {tuple(x_shape)} (need [E, H, 2I])")
    inter = two_i // 2
    if w_down.shape != (e, inter, h):
        raise ValueError(f"w_down must be [E, I, H] = {(e, inter, h)}, got {w_down.shape}")
    if inter % 16 or h % 16:
        raise ValueError(f"{kernel} needs I and H multiples of 16, got I={inter}, H={h}")
    return e, h, inter


def check_moe_shapes(x_shape, ids_shape, w_gate_up, w_down) -> None:
    """Raises ValueError with the reason when the Pallas kernels cannot take these shapes."""
    _check_moe_operands(x_shape, ids_shape, w_gate_up, w_down, "kernel")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        for _, _, r, _, sub, _ in _plane_slots(w.bits, w.group_size):
            if sub < 16 or sub & (sub - 1):
                raise ValueError(f"{name}: kernel needs group_size/{r} a power of two >= 16, "
                                 f"got group_size={w.group_size} at {w.bits} bits")


def default_moe_config(m: int, k: int, num_experts: int) -> MoEConfig:
    """The tile config for m tokens of k experts each: where the experts get at least 32 routed rows on average
    (m * k / E; prefill chunks), 64-row tiles, so each expert's weights are read once per 64 rows instead of once
    per 16; the gate/up kernel in 64 columns, the down kernel in 128. H200, 512 experts: 8,192 tokens 5.73 ms
    against 10.04 at the default 16-row tiles, 2,048 tokens 2.08 against 2.96 (bench/results/moe_prefill.json,
    moe_prefill_tiles64.json: 32- and 128-row tiles were slower, 128 down columns beat 64 by 6%)."""
    if m * k >= 32 * num_experts:
        return MoEConfig(bm=64, bn_gate_up=64, bn_down=128)
    return MoEConfig()


def routed_experts_pallas(x, expert_ids, expert_weights, w_gate_up: QuantizedWeight, w_down: QuantizedWeight,
                          *, config: MoEConfig | None = None, interpret: bool = False) -> jax.Array:
    check_moe_shapes(x.shape, expert_ids.shape, w_gate_up, w_down)
    m, h = x.shape
    k = expert_ids.shape[1]
    e_count = w_gate_up.shape[0]
    cfg = config or default_moe_config(m, k, e_count)
    inter = w_down.shape[1]
    bm = cfg.bm
    n_tiles = num_tiles_for(m, k, e_count, bm)
    src_token, tile_expert, pos = _tile_routing(expert_ids, bm, n_tiles)
    w_gate_up, w_down, offset = _flat_experts(w_gate_up, w_down)
    if offset:
        tile_expert = jnp.where(tile_expert >= 0, tile_expert + offset, -1)
    xs = x[src_token]  # [n_tiles*bm, H]
    params = None
    if not interpret and pl_triton is not None:
        params = pl_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    bn1 = pow2_divisor(inter, cfg.bn_gate_up)
    gu_planes = list(w_gate_up.planes)
    act = pl.pallas_call(
        functools.partial(_gate_up_kernel, bits=w_gate_up.bits, group_size=w_gate_up.group_size,
                          n_planes=len(gu_planes), n_groups=h // w_gate_up.group_size, inter=inter, bn=bn1),
        grid=(n_tiles, inter // bn1),
        in_specs=[_full_spec(tile_expert), pl.BlockSpec((bm, h), lambda t, j: (t, 0))]
        + [_full_spec(p) for p in gu_planes] + [_full_spec(w_gate_up.scales)],
        out_specs=pl.BlockSpec((bm, bn1), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((n_tiles * bm, inter), x.dtype),
        interpret=interpret, compiler_params=params, name=f"moe_gate_up_w{w_gate_up.bits}",
    )(tile_expert, xs, *gu_planes, w_gate_up.scales)

    bn2 = pow2_divisor(h, cfg.bn_down)
    d_planes = list(w_down.planes)
    y = pl.pallas_call(
        functools.partial(_down_kernel, bits=w_down.bits, group_size=w_down.group_size,
                          n_planes=len(d_planes), n_groups=inter // w_down.group_size, bn=bn2),
        grid=(n_tiles, h // bn2),
        in_specs=[_full_spec(tile_expert), pl.BlockSpec((bm, inter), lambda t, j: (t, 0))]
        + [_full_spec(p) for p in d_planes] + [_full_spec(w_down.scales)],
        out_specs=pl.BlockSpec((bm, bn2), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((n_tiles * bm, h), jnp.float32),
        interpret=interpret, compiler_params=params, name=f"moe_down_w{w_down.bits}",
    )(tile_expert, act, *d_planes, w_down.scales)

    if fixed_order.enabled():
        # batch-invariant traces: the k products added in a fixed tree of elementwise adds, which XLA cannot
        # reorder or tile by the row count (as a dot or reduce, how the fp32 sum is split may follow M; the
        # H100 step probe saw the MoE of layer 0 round a row differently at 2 x 512 rows: docs/batch-invariance.md)
        weighted = expert_weights.astype(jnp.float32)[..., None] * y[pos]  # [M, k, H]
        return fixed_order.tree_sum(weighted, axis=1).astype(x.dtype)
    out = jnp.einsum("mk,mkh->mh", expert_weights.astype(jnp.float32), y[pos])
    return out.astype(x.dtype)


# --------------------------------------------------------------------------------------------- GEMV decode path

def _silu_mul(gate, up, dtype):
    """h = silu(g) * u rounded to dtype, the formula of routed_experts_reference (g * sigmoid(g), then * u)."""
    return (gate * jax.nn.sigmoid(gate) * up).astype(dtype)


def _moe_gemv_gate_up_kernel(ids_ref, x_ref, *refs, k, bits, group_size, n_planes, groups_per_split, rows,
                             inter, bn, use_asm, unroll, sync_loads, fused):
    """Program (pair p, column tile j, split s): the gate and up column tiles of expert ids[p] over split s.
    fused (one split): writes h = silu(g) * u [BN] in x.dtype; else the fp32 partials [2, BN] (gate, up)."""
    plane_refs = refs[:n_planes]
    s_ref, o_ref = refs[n_planes], refs[n_planes + 1]
    p = pl.program_id(0)
    j = pl.program_id(1)
    g0 = pl.program_id(2) * groups_per_split
    e = ids_ref[p]
    tok = p // k
    cols = (j * bn, inter + j * bn)  # tile 0: gate columns, tile 1: up columns

    def load_plane(ctx, ti, pi, r0, nr):
        return plane_refs[pi][e, pl.ds(r0, nr), pl.ds(cols[ti], bn)]

    def load_x(ctx, mi, c0, n):
        return x_ref[tok, pl.ds(c0, n)]

    def load_scale(ctx, ti, g):
        return s_ref[e, pl.ds(g, 1), pl.ds(cols[ti], bn)].astype(jnp.float32)

    zero = jnp.zeros((rows, bn), jnp.float32)
    accs = gemv_accumulate(((zero,), (zero,)), groups_per_split, lambda t: (g0 + t, None), load_x, load_plane,
                           load_scale, bits=bits, group_size=group_size, rows=rows, use_asm=use_asm,
                           unroll=unroll, sync_loads=sync_loads)
    gate = jnp.sum(accs[0][0], axis=0)
    up = jnp.sum(accs[1][0], axis=0)
    if fused:
        o_ref[...] = _silu_mul(gate, up, o_ref.dtype)
    else:
        o_ref[0, :] = gate
        o_ref[1, :] = up


def _down_act_loader(h_ref, p, act_splits: int, act_dtype):
    """load_x of the down kernel: rows [c0, c0 + n) of pair p's activation h.

    act_splits = 0: h_ref is h itself ([P, I], x.dtype). act_splits = S > 0: h_ref holds the gate/up kernel's
    fp32 partials [S, P, 2, I]; the loader sums the S splits of gate and of up (all 2S loads issued before the
    adds, left to right) and applies silu(g) * u rounded to act_dtype, i.e. the XLA fusion that used to run
    between the kernels, done on the fly for exactly the rows this program multiplies."""
    if not act_splits:
        return lambda ctx, mi, c0, n: h_ref[p, pl.ds(c0, n)]

    def load_x(ctx, mi, c0, n):
        parts = [[h_ref[s, p, t, pl.ds(c0, n)] for s in range(act_splits)] for t in (0, 1)]
        gate, up = (functools.reduce(jnp.add, ps) for ps in parts)
        return _silu_mul(gate, up, act_dtype)

    return load_x


def _moe_gemv_down_kernel(ids_ref, h_ref, *refs, bits, group_size, n_planes, groups_per_split, rows, bn,
                          use_asm, unroll, sync_loads, act_splits, act_dtype, weighted):
    """Program (pair p, column tile j, split s): the fp32 tile h[p, split s] @ w_down[ids[p]][split s, tile j]
    (h from _down_act_loader; output layout: _gemv_down). weighted: an extra [P] fp32 input after the scales,
    the routing weights, multiplies the tile, so that the combine after the kernel is a plain sum."""
    plane_refs = refs[:n_planes]
    s_ref, o_ref = refs[n_planes], refs[-1]
    p = pl.program_id(0)
    j = pl.program_id(1)
    g0 = pl.program_id(2) * groups_per_split
    e = ids_ref[p]

    def load_plane(ctx, ti, pi, r0, nr):
        return plane_refs[pi][e, pl.ds(r0, nr), pl.ds(j * bn, bn)]

    def load_scale(ctx, ti, g):
        return s_ref[e, pl.ds(g, 1), pl.ds(j * bn, bn)].astype(jnp.float32)

    load_x = _down_act_loader(h_ref, p, act_splits, act_dtype)
    zero = jnp.zeros((rows, bn), jnp.float32)
    accs = gemv_accumulate(((zero,),), groups_per_split, lambda t: (g0 + t, None), load_x, load_plane,
                           load_scale, bits=bits, group_size=group_size, rows=rows, use_asm=use_asm,
                           unroll=unroll, sync_loads=sync_loads)
    y = jnp.sum(accs[0][0], axis=0)
    if weighted:
        y = y * refs[n_planes + 1][p]
    o_ref[...] = y


# The fixed path's tiling rule (routed_experts_gemv_fixed), resolved for one token (pairs = k) at every M.
GEMV_FIXED_CONFIG = MoEGemvConfig()


def check_moe_gemv(x_shape, ids_shape, w_gate_up, w_down, cfg: MoEGemvConfig) -> tuple[int, int, int, int]:
    """Raises ValueError (TypeError for unquantized weights) with the reason when the GEMV decode path cannot
    take these shapes / this config; returns (bn_gate_up, splits_gate_up, bn_down, splits_down) resolved."""
    e, h, inter = _check_moe_operands(x_shape, ids_shape, w_gate_up, w_down, "the GEMV path")
    for w in (w_gate_up, w_down):
        gemv_layout(w.bits, w.group_size)  # raises for unsupported bits
    pairs = x_shape[0] * ids_shape[1]
    problems = []
    resolved = []
    for name, w, n, bn, splits in (("gate_up", w_gate_up, inter, cfg.bn_gate_up, cfg.splits_gate_up),
                                   ("down", w_down, h, cfg.bn_down, cfg.splits_down)):
        bn = pow2_divisor(n, bn)
        n_groups = w.k // w.group_size
        if bn < 16:
            problems.append(f"{name}: no power-of-two column tile >= 16 divides N={n}")
        splits = splits or _splits_for(n_groups, pairs * (n // bn), cfg.target_programs)
        if n_groups % splits:
            problems.append(f"{name}: splits={splits} must divide the {n_groups} groups")
        _, space, _ = gemv_layout(w.bits, w.group_size)
        if not is_pow2(cfg.rows) or space % cfg.rows:
            problems.append(f"{name}: rows={cfg.rows} must be a power of two dividing {space}")
        elif cfg.fields == "asm" and (cfg.rows * bn) % (128 * cfg.num_warps):
            problems.append(f"{name}: fields='asm' needs rows*bn={cfg.rows * bn} a multiple of "
                            f"{128 * cfg.num_warps}")
        if (n_groups // max(splits, 1)) % cfg.unroll:
            problems.append(f"{name}: unroll={cfg.unroll} must divide the groups per split")
        resolved += [bn, splits]
    if cfg.fields not in GEMV_FIELDS:
        problems.append(f"fields must be one of {GEMV_FIELDS}, got {cfg.fields!r}")
    if problems:
        raise ValueError(f"MoE GEMV config {cfg} does not fit x {tuple(x_shape)}, k={ids_shape[1]}: "
                         + "; ".join(problems))
    return tuple(resolved)


def _full_spec3(a):
    nd = a.ndim
    return pl.BlockSpec(a.shape, lambda p, j, s: (0,) * nd)


def _gemv_gate_up(x, ids, k: int, w: QuantizedWeight, bn: int, splits: int, opts: dict) -> jax.Array:
    """The gate/up kernel: h = silu(g) * u [P, I] in x.dtype when splits == 1, else fp32 partials
    [splits, P, 2, I] (gate, up)."""
    pairs, inter = ids.shape[0], w.n // 2
    fused = splits == 1
    if fused:
        out_shape = jax.ShapeDtypeStruct((pairs, inter), x.dtype)
        out_spec = pl.BlockSpec((None, bn), lambda p, j, s: (p, j))
    else:
        out_shape = jax.ShapeDtypeStruct((splits, pairs, 2, inter), jnp.float32)
        out_spec = pl.BlockSpec((None, None, 2, bn), lambda p, j, s: (s, p, 0, j))
    planes = list(w.planes)
    return pl.pallas_call(
        functools.partial(_moe_gemv_gate_up_kernel, k=k, bits=w.bits, group_size=w.group_size,
                          n_planes=len(planes), groups_per_split=(w.k // w.group_size) // splits,
                          rows=opts["rows"], inter=inter, bn=bn, fused=fused, **opts["kernel"]),
        grid=(pairs, inter // bn, splits),
        in_specs=[_full_spec3(a) for a in (ids, x, *planes, w.scales)],
        out_specs=out_spec, out_shape=out_shape, interpret=opts["interpret"], compiler_params=opts["params"],
        name=f"moe_gemv_gate_up_w{w.bits}_bn{bn}_s{splits}",
    )(ids, x, *planes, w.scales)


def _gemv_down(h, ids, weights, w: QuantizedWeight, bn: int, splits: int, act_dtype, opts: dict,
               k: int = 1) -> jax.Array:
    """The down kernel, fp32 partials of y[p] = h[p] @ w_down[ids[p]] over its K splits.

    h: the activation [P, I] or the gate/up kernel's fp32 partials [S, P, 2, I] (the kernel then sums them and
    applies silu(g) * u itself, see _down_act_loader). weights None: y as [splits, P, H]. weights ([P] fp32):
    y[p] * weights[p], token-major [M, splits * k, H] (pair p = m * k + j of split s at [m, s * k + j]), so the
    combine is one reduction over axis 1."""
    pairs, n = ids.shape[0], w.n
    act_splits = h.shape[0] if h.ndim == 4 else 0
    weighted = weights is not None
    if weighted:
        out_shape = (pairs // k, splits * k, n)

        def out_index(p, j, s):
            return p // k, s * k + p % k, j
    else:
        out_shape = (splits, pairs, n)

        def out_index(p, j, s):
            return s, p, j
    extra = [weights] if weighted else []
    planes = list(w.planes)
    name = f"moe_gemv_down_w{w.bits}_bn{bn}_s{splits}" + ("_fused" if weighted else "")
    return pl.pallas_call(
        functools.partial(_moe_gemv_down_kernel, bits=w.bits, group_size=w.group_size, n_planes=len(planes),
                          groups_per_split=(w.k // w.group_size) // splits, rows=opts["rows"], bn=bn,
                          act_splits=act_splits, act_dtype=act_dtype, weighted=weighted, **opts["kernel"]),
        grid=(pairs, n // bn, splits),
        in_specs=[_full_spec3(a) for a in (ids, h, *planes, w.scales, *extra)],
        out_specs=pl.BlockSpec((None, None, bn), out_index),
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        interpret=opts["interpret"], compiler_params=opts["params"], name=name,
    )(ids, h, *planes, w.scales, *extra)


def routed_experts_gemv(x, expert_ids, expert_weights, w_gate_up: QuantizedWeight, w_down: QuantizedWeight,
                        *, config: MoEGemvConfig | None = None, interpret: bool = False) -> jax.Array:
    """The decode path (see the module docstring): one GEMV per routed pair, no routing glue.

    config.fused_glue: gate/up kernel -> down kernel (split-K sum + silu(g) * u on its loads, routing
    weight on its output) -> one XLA sum over (down splits, k) + cast. False: the same kernels with the XLA
    activation fusion between them and the XLA weighted combine after (the default, measured on the H200)."""
    cfg = config or MoEGemvConfig()
    bn1, s1, bn2, s2 = check_moe_gemv(x.shape, expert_ids.shape, w_gate_up, w_down, cfg)
    m, h = x.shape
    k = expert_ids.shape[1]
    w_gate_up, w_down, offset = _flat_experts(w_gate_up, w_down)
    ids = expert_ids.reshape(m * k).astype(jnp.int32) + offset
    opts = gemv_call_options(cfg, interpret)
    gu = _gemv_gate_up(x, ids, k, w_gate_up, bn1, s1, opts)
    if cfg.fused_glue:
        wts = expert_weights.reshape(m * k).astype(jnp.float32)
        y = _gemv_down(gu, ids, wts, w_down, bn2, s2, x.dtype, opts, k=k)
        return y.sum(axis=1).astype(x.dtype)
    if s1 > 1:
        gsum = gu.sum(axis=0)
        gu = (jax.nn.silu(gsum[:, 0]) * gsum[:, 1]).astype(x.dtype)  # unchanged baseline glue
    y = _gemv_down(gu, ids, None, w_down, bn2, s2, x.dtype, opts)
    # A multiply + reduce, not an einsum: XLA made the einsum a generic fusion of 4.8 us per layer (H200, stop 10)
    weighted = y.reshape(s2, m, k, h) * expert_weights.astype(jnp.float32)[None, :, :, None]
    return weighted.sum(axis=(0, 2)).astype(x.dtype)


def fixed_tiling(hidden: int, k: int, w_gate_up, w_down) -> tuple[MoEGemvConfig, tuple[int, int, int, int]]:
    """The fixed path's config and its (bn, splits) of both kernels, resolved for one token of `hidden` features and
    k experts whatever M: GEMV_FIXED_CONFIG, for small groups with fewer plane rows per chunk, and with the
    byte-formula fields where the inline-PTX packing does not fit the tile (narrow experts, as default_gemv_config
    does); ValueError (TypeError) where nothing fits."""
    _check_moe_operands((1, hidden), (1, k), w_gate_up, w_down, "the GEMV path")
    rows = min(pow2_divisor(gemv_layout(w.bits, w.group_size)[1], GEMV_FIXED_CONFIG.rows) for w in (w_gate_up, w_down))
    cfg = dataclasses.replace(GEMV_FIXED_CONFIG, rows=rows)
    try:
        return cfg, check_moe_gemv((1, hidden), (1, k), w_gate_up, w_down, cfg)
    except ValueError:
        cfg = dataclasses.replace(cfg, fields="jnp")
        return cfg, check_moe_gemv((1, hidden), (1, k), w_gate_up, w_down, cfg)


def gemv_fixed_fits(hidden: int, k: int, w_gate_up, w_down) -> bool:
    """Whether `routed_experts_gemv_fixed` takes these experts for tokens of `hidden` features, k experts each."""
    try:
        fixed_tiling(hidden, k, w_gate_up, w_down)
    except (ValueError, TypeError):
        return False
    return True


def routed_experts_gemv_fixed(x, expert_ids, expert_weights, w_gate_up: QuantizedWeight | LayerSlice,
                              w_down: QuantizedWeight | LayerSlice, *, interpret: bool = False) -> jax.Array:
    """The decode path's batch-invariant variant (module docstring): any M, token m's output bitwise the 1-token
    call's on row m. The tiling is `fixed_tiling`'s, for one token; the glue (fused_glue=False) adds in
    fixed pairwise trees. ValueError for shapes the GEMV path cannot take."""
    _check_moe_operands(x.shape, expert_ids.shape, w_gate_up, w_down, "the GEMV path")
    m, h = x.shape
    k = expert_ids.shape[1]
    cfg, (bn1, s1, bn2, s2) = fixed_tiling(h, k, w_gate_up, w_down)  # one token's tiling, every M
    w_gate_up, w_down, offset = _flat_experts(w_gate_up, w_down)
    ids = expert_ids.reshape(m * k).astype(jnp.int32) + offset
    opts = gemv_call_options(cfg, interpret)
    gu = _gemv_gate_up(x, ids, k, w_gate_up, bn1, s1, opts)
    if s1 > 1:
        gsum = fixed_order.pairwise_sum(gu, axis=0)  # [P, 2, I]: (gate, up)
        gu = _silu_mul(gsum[:, 0], gsum[:, 1], x.dtype)
    y = fixed_order.pairwise_sum(_gemv_down(gu, ids, None, w_down, bn2, s2, x.dtype, opts), axis=0)  # [P, H]
    weighted = y.reshape(m, k, h) * expert_weights.astype(jnp.float32)[..., None]
    return fixed_order.pairwise_sum(weighted, axis=1).astype(x.dtype)


def routed_experts(x, expert_ids, expert_weights, w_gate_up, w_down, *, impl: str | None = None,
                   config: MoEConfig | MoEGemvConfig | None = None, path: str = "auto") -> jax.Array:
    """Routed expert MLP, [M, H] in x.dtype. Plain (unquantized) [E, ...] weights take the reference path.

    impl: None (FLASHNEXT_KERNELS, default 'auto'), 'auto', 'pallas', 'interpret' or 'reference'.
    path (kernel impls only): 'auto' (the GEMV decode path when M*k <= MOE_GEMV_MAX_PAIRS, else the sorted
    tiles), 'tiles', 'gemv' or 'gemv_fixed' (routed_experts_gemv_fixed, the batch-invariant decode path for any M;
    a fixed tiling, so no config); config is a MoEConfig (tiles) or a MoEGemvConfig (gemv)."""
    if path not in MOE_PATHS:
        raise ValueError(f"path must be one of {MOE_PATHS}, got {path!r}")
    if path == "gemv_fixed" and config is not None:
        raise ValueError("path='gemv_fixed' runs a fixed tiling (GEMV_FIXED_CONFIG for one token): no config")
    mode = resolve_impl(impl)
    kinds = (QuantizedWeight, LayerSlice)
    quantized = isinstance(w_gate_up, kinds) and isinstance(w_down, kinds)
    if mode == "reference" or not quantized:
        return routed_experts_reference(x, expert_ids, expert_weights, unstacked(w_gate_up), unstacked(w_down))
    if path == "gemv_fixed":
        return routed_experts_gemv_fixed(x, expert_ids, expert_weights, w_gate_up, w_down,
                                         interpret=(mode == "interpret"))
    if path == "auto" and fixed_order.enabled() and config is None:
        # batch-invariant traces: one path and one tiling for every M (the GEMV path and the tile sizes each round
        # a row differently; pallas_kernels/fixed_order.py). A MoEConfig makes "auto" below take the tiles.
        config = MoEConfig()
    if path == "auto":
        small = x.shape[0] * expert_ids.shape[1] <= MOE_GEMV_MAX_PAIRS
        path = "gemv" if small and not isinstance(config, MoEConfig) else "tiles"
        if path == "gemv":  # shapes the GEMV path cannot tile (e.g. the small demo model) take the tiles path
            try:
                check_moe_gemv(x.shape, expert_ids.shape, w_gate_up, w_down, config or MoEGemvConfig())
            except ValueError:
                path = "tiles"
        if path == "tiles":
            try:
                check_moe_shapes(x.shape, expert_ids.shape, w_gate_up, w_down)
            except ValueError:  # neither kernel takes these shapes (e.g. 16-wide groups): the reference does
                return routed_experts(x, expert_ids, expert_weights, w_gate_up, w_down, impl="reference")
    if path == "gemv":
        return routed_experts_gemv(x, expert_ids, expert_weights, w_gate_up, w_down,
                                   config=config if isinstance(config, MoEGemvConfig) else None,
                                   interpret=(mode == "interpret"))
    return routed_experts_pallas(x, expert_ids, expert_weights, w_gate_up, w_down,
                                 config=config if isinstance(config, MoEConfig) else None,
                                 interpret=(mode == "interpret"))
