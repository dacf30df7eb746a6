"""The hyper-connection read at decode sizes: two Pallas kernels and one small XLA fusion instead of ~9 kernels.

Why: every decoder layer reads the S = 4 residual streams twice (before attention and before the MoE), and at one
token each read was a chain of small kernels (stream norm reduce, norm, split-K GEMV down, its sum, SiLU, GEMV up,
its sum + sigmoid + stream mean, the block-inject dot): 12.9 us per read on the H200, 97 reads per decode step
(bench/results/hyper_read.json, stop 10), for 6.9 MB of weights.

Math per token (flashnext_jax/hyper.py::hyper_read_reference is the reference; x [S*H] = S streams of H, w the
S*H-wide zero-centred norm weight, r_s = rsqrt(mean(x_s^2) + eps)):
    normed[s, h] = x[s, h] * r_s * (1 + w[s, h])
    down  = normed @ Wd = sum_s r_s * ((x_s * (1 + w_s)) @ Wd[s-th K block])        Wd [S*H, R] quantized
    mix   = silu(down / S);  up = sigmoid(mix @ Wu)                                    Wu [R, S*H] quantized
    u[h]  = mean_s up[s, h] * normed[s, h];  gains = 2 * sigmoid(normed @ Wb^T / S)    Wb [S, S*H] plain
* Kernel 1 (`hyper_down_*`), grid (R / BN, P): split p covers K rows of ONE stream, so r_s factors out of its
  partial sum: part[p, m, :] = sum_{k in p} x[m, k] (1 + w[k]) Wd[k, :] (the GEMV inner loop of quant_gemv.py
  with the norm weight applied on the activation loads). The programs of column tile 0 also write the split's
  sum of squares ssq[p, m] and its block-inject sums inj[p, m, :] (against Wb).
* XLA (one small fusion): r_s from the ssq sums, mix = silu(sum_p r_s(p) part[p] / S) and the gains.
* Kernel 2 (`hyper_up_*`), grid (H / BH,): program j owns hidden columns [j*BH, (j+1)*BH) of all S streams, i.e.
  S column tiles of Wu sharing the activation vector mix (the GEMV loop with S tiles); its epilogue applies the
  sigmoid, the norm (x, w, r_s) and the mean over streams and writes u [M, H] in x.dtype.
A first version built mix and r_s inside kernel 2 (every program re-reducing the partials and x): 40 us per read,
its cross-thread reductions serialised the program (H200, stop 10).
Everything is fp32 inside; the reference rounds normed, down, mix and up to bf16 on the way, so the two differ
by bf16 rounding (tests/test_hyper_read.py compares both with the float32 reference).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.quant_gemv import GEMV_MAX_M, GemvConfig, gemv_accumulate, gemv_call_options, gemv_layout
from pallas_kernels.quant_layout import QuantizedWeight, is_pow2, pow2_divisor


@dataclasses.dataclass(frozen=True)
class HyperReadConfig:
    bn_down: int = 64  # kernel 1: columns of Wd (of R) per program
    splits_per_stream: int = 0  # kernel 1: K splits per stream (dividing the groups of a stream); 0 = one per group
    bh: int = 16  # kernel 2: hidden columns per program (times S column tiles of Wu)
    rows: int = 16  # plane rows per chunk of the GEMV loop (both kernels)
    warps_down: int = 4
    warps_up: int = 2


def default_hyper_config(sh: int, n_streams: int, wd: QuantizedWeight, wu: QuantizedWeight) -> HyperReadConfig:
    """The defaults, shrunk to fit small shapes (tests, the demo model): powers of two dividing what they tile."""
    h, r = sh // max(n_streams, 1), wd.n
    cfg = HyperReadConfig()
    bn_down, bh = pow2_divisor(r, cfg.bn_down), pow2_divisor(h, cfg.bh)
    rows = min(cfg.rows, gemv_layout(wd.bits, wd.group_size)[1], gemv_layout(wu.bits, wu.group_size)[1])

    def warps(bn, cap):
        w = cap
        while w > 1 and (rows * bn) % (128 * w):
            w //= 2
        return w

    return HyperReadConfig(bn_down=bn_down, splits_per_stream=max(h // wd.group_size, 1), bh=bh, rows=rows,
                           warps_down=warps(bn_down, cfg.warps_down), warps_up=warps(bh, cfg.warps_up))


def check_hyper_read(x_shape, n_streams: int, wd, wu, wb, cfg: HyperReadConfig | None = None) -> None:
    """ValueError naming the problem when the fused kernels cannot take these operands (the caller falls back)."""
    problems = []
    if not (isinstance(wd, QuantizedWeight) and isinstance(wu, QuantizedWeight)):
        raise ValueError("the fused hyper read needs quantized input_mix_weight_down / _up")
    m, sh = x_shape
    cfg = cfg or default_hyper_config(sh, n_streams, wd, wu)
    if not 1 <= m <= GEMV_MAX_M:
        problems.append(f"1 <= M <= {GEMV_MAX_M} tokens, got {m}")
    if not is_pow2(n_streams) or sh % n_streams:
        problems.append(f"the stream count must be a power of two dividing {sh}, got {n_streams}")
    h = sh // n_streams
    r = wd.n
    if wd.shape != (sh, r) or wu.shape != (r, sh):
        problems.append(f"Wd must be [{sh}, R] and Wu [R, {sh}], got {wd.shape} and {wu.shape}")
    if wb is not None and tuple(wb.shape) != (n_streams, sh):
        problems.append(f"block_inject must be [{n_streams}, {sh}], got {tuple(wb.shape)}")
    pps = cfg.splits_per_stream
    if h % wd.group_size or pps < 1 or (h // wd.group_size) % pps:
        problems.append(f"splits_per_stream={pps} must divide the {h // max(wd.group_size, 1)} groups of a stream")
    if r % cfg.bn_down or h % cfg.bh or not (is_pow2(cfg.bn_down) and is_pow2(cfg.bh)):
        problems.append(f"bn_down={cfg.bn_down} must divide R={r} and bh={cfg.bh} divide H={h} (powers of two)")
    for w, bn, warps in ((wd, cfg.bn_down, cfg.warps_down), (wu, cfg.bh, cfg.warps_up)):
        _, space, _ = gemv_layout(w.bits, w.group_size)
        if space % cfg.rows or (cfg.rows * bn) % (128 * warps):
            problems.append(f"rows={cfg.rows} must divide {space} and rows*bn={cfg.rows * bn} be a multiple of "
                            f"128*warps={128 * warps} ({w.bits}-bit g{w.group_size})")
    if r % wu.group_size:
        problems.append(f"R={r} must be a multiple of Wu's group {wu.group_size}")
    if problems:
        raise ValueError("fused hyper read: " + "; ".join(problems))


def _down_kernel(x_ref, w_ref, *refs, n_planes, bits, group_size, m, groups_per_split, rows, use_asm, unroll,
                 sync_loads, has_inject, chunk):
    plane_refs, s_ref = refs[:n_planes], refs[n_planes]
    wb_ref = refs[n_planes + 1] if has_inject else None
    part_ref, ssq_ref = refs[n_planes + 1 + has_inject : n_planes + 3 + has_inject]
    inj_ref = refs[n_planes + 3 + has_inject] if has_inject else None
    j, p = pl.program_id(0), pl.program_id(1)
    g0 = p * groups_per_split
    bn = part_ref.shape[-1]

    def load_x(ctx, mi, c0, n):  # x * (1 + w): the norm without its per-stream factor r_s
        return x_ref[mi, pl.ds(c0, n)].astype(jnp.float32) * (1.0 + w_ref[pl.ds(c0, n)].astype(jnp.float32))

    zero = jnp.zeros((rows, bn), jnp.float32)
    accs = gemv_accumulate(
        ((zero,) * m,), groups_per_split, lambda t: (g0 + t, None), load_x,
        lambda ctx, ti, pi, r0, nr: plane_refs[pi][pl.ds(r0, nr), :],
        lambda ctx, ti, g: s_ref[g, :].astype(jnp.float32)[None, :],
        bits=bits, group_size=group_size, rows=rows, use_asm=use_asm, unroll=unroll, sync_loads=sync_loads)
    for mi in range(m):
        part_ref[mi, :] = jnp.sum(accs[0][mi], axis=0)

    @pl.when(j == 0)
    def _():  # the split's statistics, once per split: sum of x^2 and the block-inject sums
        k0 = g0 * group_size
        for mi in range(m):
            ssq = inj = None
            for c in range(groups_per_split * group_size // chunk):
                xv = x_ref[mi, pl.ds(k0 + c * chunk, chunk)].astype(jnp.float32)
                v = jnp.sum(xv * xv)
                ssq = v if ssq is None else ssq + v
                if has_inject:
                    xw = xv * (1.0 + w_ref[pl.ds(k0 + c * chunk, chunk)].astype(jnp.float32))
                    wb = wb_ref[:, pl.ds(k0 + c * chunk, chunk)].astype(jnp.float32)
                    v = jnp.sum(wb * xw[None, :], axis=1)
                    inj = v if inj is None else inj + v
            ssq_ref[mi, :] = jnp.broadcast_to(ssq, (2,))
            if has_inject:
                inj_ref[mi, :] = inj


def _up_kernel(x_ref, w_ref, mix_ref, rstd_ref, *refs, n_planes, n_streams, bits, group_size, m, n_groups, rows,
               use_asm, unroll, sync_loads):
    plane_refs = refs[: n_streams * n_planes]
    scale_refs = refs[n_streams * n_planes : n_streams * (n_planes + 1)]
    u_ref = refs[n_streams * (n_planes + 1)]
    j = pl.program_id(0)
    h = x_ref.shape[1] // n_streams
    bh = u_ref.shape[-1]

    zero = jnp.zeros((rows, bh), jnp.float32)
    accs = gemv_accumulate(
        tuple((zero,) * m for _ in range(n_streams)), n_groups, lambda t: (t, None),
        lambda ctx, mi, c0, n: mix_ref[mi, pl.ds(c0, n)],
        lambda ctx, ti, pi, r0, nr: plane_refs[ti * n_planes + pi][pl.ds(r0, nr), :],
        lambda ctx, ti, g: scale_refs[ti][g, :].astype(jnp.float32)[None, :],
        bits=bits, group_size=group_size, rows=rows, use_asm=use_asm, unroll=unroll, sync_loads=sync_loads)
    for mi in range(m):
        u = None
        for s in range(n_streams):
            col = s * h + j * bh
            normed = (x_ref[mi, pl.ds(col, bh)].astype(jnp.float32) * rstd_ref[mi, s]
                      * (1.0 + w_ref[pl.ds(col, bh)].astype(jnp.float32)))
            v = jax.nn.sigmoid(jnp.sum(accs[s][mi], axis=0)) * normed
            u = v if u is None else u + v
        u_ref[mi, :] = (u / n_streams).astype(u_ref.dtype)


def hyper_read_fused(x: jax.Array, norm_weight: jax.Array, wd: QuantizedWeight, wu: QuantizedWeight,
                     wb: jax.Array | None, *, n_streams: int, eps: float, config: HyperReadConfig | None = None,
                     interpret: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """x [M, S*H] -> (u [M, H], gains [M, S] or None when wb is None), both in x.dtype; see the module docstring.

    norm_weight [S*H] (zero-centred), wd [S*H, R] and wu [R, S*H] QuantizedWeight, wb [S, S*H] plain or None."""
    cfg = config or default_hyper_config(x.shape[1], n_streams, wd, wu)
    check_hyper_read(x.shape, n_streams, wd, wu, wb, cfg)
    m, sh = x.shape
    h, r = sh // n_streams, wd.n
    has_inject = wb is not None
    pps = cfg.splits_per_stream
    splits = n_streams * pps
    groups_per_split = sh // wd.group_size // splits

    # Kernel 1: partial down projections per K split, and each split's statistics.
    opts = gemv_call_options(GemvConfig(bn=cfg.bn_down, rows=cfg.rows, num_warps=cfg.warps_down), interpret)
    in_specs = [pl.BlockSpec((m, sh), lambda j, p: (0, 0)), pl.BlockSpec((sh,), lambda j, p: (0,))]
    in_specs += [pl.BlockSpec((pp.shape[0], cfg.bn_down), lambda j, p: (0, j)) for pp in wd.planes]
    in_specs += [pl.BlockSpec((wd.scales.shape[0], cfg.bn_down), lambda j, p: (0, j))]
    args = [x, norm_weight, *wd.planes, wd.scales]
    out_shape = [jax.ShapeDtypeStruct((splits, m, r), jnp.float32), jax.ShapeDtypeStruct((splits, m, 2), jnp.float32)]
    out_specs = [pl.BlockSpec((None, m, cfg.bn_down), lambda j, p: (p, 0, j)),
                 pl.BlockSpec((None, m, 2), lambda j, p: (p, 0, 0))]
    if has_inject:
        in_specs.append(pl.BlockSpec((n_streams, sh), lambda j, p: (0, 0)))
        args.append(wb)
        out_shape.append(jax.ShapeDtypeStruct((splits, m, n_streams), jnp.float32))
        out_specs.append(pl.BlockSpec((None, m, n_streams), lambda j, p: (p, 0, 0)))
    kernel = functools.partial(
        _down_kernel, n_planes=len(wd.planes), bits=wd.bits, group_size=wd.group_size, m=m,
        groups_per_split=groups_per_split, rows=opts["rows"], use_asm=opts["kernel"]["use_asm"],
        unroll=opts["kernel"]["unroll"], sync_loads=opts["kernel"]["sync_loads"], has_inject=has_inject,
        chunk=pow2_divisor(groups_per_split * wd.group_size, 64))
    outs = pl.pallas_call(
        kernel, grid=(r // cfg.bn_down, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, compiler_params=opts["params"],
        name=f"hyper_down_w{wd.bits}g{wd.group_size}_m{m}_bn{cfg.bn_down}_s{splits}")(*args)

    # XLA: the stream norm factors, mix and the gains (one small fusion).
    ssq = outs[1][:, :, 0].reshape(n_streams, pps, m).sum(axis=1)  # [S, M]
    rstd = jax.lax.rsqrt(ssq / h + eps).T  # [M, S]
    per_split = jnp.repeat(rstd.T, pps, axis=0)[:, :, None]  # [P, M, 1]
    mix = jax.nn.silu(jnp.sum(outs[0] * per_split, axis=0) / n_streams)  # [M, R] fp32
    gains = None
    if has_inject:
        gains = (2.0 * jax.nn.sigmoid(jnp.sum(outs[2] * per_split, axis=0) / n_streams)).astype(x.dtype)

    # Kernel 2: the up projection of all S streams per hidden tile, sigmoid, norm, mean over streams.
    opts = gemv_call_options(GemvConfig(bn=cfg.bh, rows=cfg.rows, num_warps=cfg.warps_up), interpret)
    nb = h // cfg.bh
    in_specs = [pl.BlockSpec((m, sh), lambda j: (0, 0)), pl.BlockSpec((sh,), lambda j: (0,)),
                pl.BlockSpec((m, r), lambda j: (0, 0)), pl.BlockSpec((m, n_streams), lambda j: (0, 0))]
    args = [x, norm_weight, mix, rstd]
    for s in range(n_streams):  # stream s's columns of Wu: column block s * nb + j
        in_specs += [pl.BlockSpec((pp.shape[0], cfg.bh), functools.partial(lambda s, j: (0, s * nb + j), s))
                     for pp in wu.planes]
        args += list(wu.planes)
    for s in range(n_streams):
        in_specs.append(pl.BlockSpec((wu.scales.shape[0], cfg.bh), functools.partial(lambda s, j: (0, s * nb + j), s)))
        args.append(wu.scales)
    kernel = functools.partial(
        _up_kernel, n_planes=len(wu.planes), n_streams=n_streams, bits=wu.bits, group_size=wu.group_size, m=m,
        n_groups=r // wu.group_size, rows=opts["rows"], use_asm=opts["kernel"]["use_asm"],
        unroll=opts["kernel"]["unroll"], sync_loads=opts["kernel"]["sync_loads"])
    u = pl.pallas_call(
        kernel, grid=(nb,), in_specs=in_specs, out_specs=pl.BlockSpec((m, cfg.bh), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((m, h), x.dtype), interpret=interpret, compiler_params=opts["params"],
        name=f"hyper_up_w{wu.bits}g{wu.group_size}_m{m}_bh{cfg.bh}")(*args)
    return u, gains
