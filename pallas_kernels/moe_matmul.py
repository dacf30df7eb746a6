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
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.quant_layout import QuantizedWeight, dequantize, resolve_impl
from pallas_kernels.quant_matmul import _plane_slots, _pow2_divisor, group_dot, pl_triton


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    bm: int = 16  # token rows per tile
    bn_gate_up: int = 128  # columns of gate (and of up) per program
    bn_down: int = 128
    num_warps: int = 4
    num_stages: int = 3


# --------------------------------------------------------------------------------------------- reference

def _expert_weight(w, e) -> jax.Array:
    """float32 weights of expert(s) e from a QuantizedWeight or a plain [E, ...] array."""
    if isinstance(w, QuantizedWeight):
        return dequantize(w[e])
    return jnp.asarray(w)[e].astype(jnp.float32)


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


def check_moe_shapes(x_shape, ids_shape, w_gate_up, w_down) -> None:
    """Raises ValueError with the reason when the Pallas kernels cannot take these shapes."""
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(w, QuantizedWeight):
            raise TypeError(f"the Pallas MoE kernel needs QuantizedWeight {name}, got {type(w).__name__}")
        if w.ndim != 3:
            raise ValueError(f"{name} must be stacked [E, K, N], got {w.shape}")
        for _, _, r, _, sub, _ in _plane_slots(w.bits, w.group_size):
            if sub < 16 or sub & (sub - 1):
                raise ValueError(f"{name}: kernel needs group_size/{r} a power of two >= 16, "
                                 f"got group_size={w.group_size} at {w.bits} bits")
    if len(x_shape) != 2 or len(ids_shape) != 2 or ids_shape[0] != x_shape[0]:
        raise ValueError(f"x must be [M, H] and expert_ids [M, k]; got {tuple(x_shape)} and {tuple(ids_shape)}")
    e, h, two_i = w_gate_up.shape
    if x_shape[1] != h or two_i % 2:
        raise ValueError(f"w_gate_up {w_gate_up.shape} does not match x {tuple(x_shape)} (need [E, H, 2I])")
    inter = two_i // 2
    if w_down.shape != (e, inter, h):
        raise ValueError(f"w_down must be [E, I, H] = {(e, inter, h)}, got {w_down.shape}")
    if inter % 16 or h % 16:
        raise ValueError(f"kernel needs I and H multiples of 16, got I={inter}, H={h}")


def routed_experts_pallas(x, expert_ids, expert_weights, w_gate_up: QuantizedWeight, w_down: QuantizedWeight,
                          *, config: MoEConfig | None = None, interpret: bool = False) -> jax.Array:
    check_moe_shapes(x.shape, expert_ids.shape, w_gate_up, w_down)
    cfg = config or MoEConfig()
    m, h = x.shape
    k = expert_ids.shape[1]
    e_count = w_gate_up.shape[0]
    inter = w_down.shape[1]
    bm = cfg.bm
    n_tiles = num_tiles_for(m, k, e_count, bm)
    src_token, tile_expert, pos = _tile_routing(expert_ids, bm, n_tiles)
    xs = x[src_token]  # [n_tiles*bm, H]
    params = None
    if not interpret and pl_triton is not None:
        params = pl_triton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    bn1 = _pow2_divisor(inter, cfg.bn_gate_up)
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

    bn2 = _pow2_divisor(h, cfg.bn_down)
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

    out = jnp.einsum("mk,mkh->mh", expert_weights.astype(jnp.float32), y[pos])
    return out.astype(x.dtype)


def routed_experts(x, expert_ids, expert_weights, w_gate_up, w_down, *, impl: str | None = None,
                   config: MoEConfig | None = None) -> jax.Array:
    """Routed expert MLP, [M, H] in x.dtype. Plain (unquantized) [E, ...] weights take the reference path.

    impl: None (FLASHNEXT_KERNELS, default 'auto'), 'auto', 'pallas', 'interpret' or 'reference'."""
    mode = resolve_impl(impl)
    quantized = isinstance(w_gate_up, QuantizedWeight) and isinstance(w_down, QuantizedWeight)
    if mode == "reference" or not quantized:
        return routed_experts_reference(x, expert_ids, expert_weights, w_gate_up, w_down)
    return routed_experts_pallas(x, expert_ids, expert_weights, w_gate_up, w_down, config=config,
                                 interpret=(mode == "interpret"))
