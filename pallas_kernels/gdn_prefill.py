"""Pallas (Triton backend) chunked gated delta rule prefill: varlen, slot-indexed initial/final states.

Two kernels over a chunk-aligned layout of the packed sequences (each sequence starts on a 64-token chunk):

  K1 `_wy_kernel`, grid (aligned chunks, Hv), fully parallel: per chunk and v head, from the packed q/k/v/g/beta
     (masked loads, optional L2 norm): gcum = chunk-local cumsum(g); A = strict_lower(beta_i k_i.k_j e^(gc_i-gc_j))
     in four 16-row sub-blocks; T = (I + A)^-1 by forward substitution on the 16x16 diagonal blocks + block
     merges; w = T (beta e^gc k), u = T (beta v); Aqk = incl_lower(q_i.k_j e^(gc_i-gc_j)). Written head-major.
  K2 `_state_kernel`, grid (sequences, Hv, Dv/BV), sequential over the chunks of one sequence with the
     [Dk, BV] fp32 state block in registers: v' = u - w S; o = (q e^gc) S + Aqk v';
     S = e^gc_last S + (k e^(gc_last-gc))^T v'. Reads the initial state by slot and writes the final state by
     slot into the aliased state array (in place).

Dot operands are cast to `dot_dtype` (bf16 on GPU like FLA; fp32 for the interpret-mode tests).

`variant=` (static): "wide" (default) runs K1 as `_wy_wide_kernel` on whole 64-row tiles, "base" the 16-row
`_wy_kernel` above (kept for A/B timing); see docs/kernels-gdn.md for the measurements.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gdn_layout import CHUNK, L2_EPS, flat_state, slot_rows, varlen_chunk_layout

try:
    from jax.experimental.pallas import triton as pltriton
except Exception:  # pragma: no cover
    pltriton = None

C = CHUNK
SUB = 16


def _mload(ref, mask, interpret):
    if interpret or pltriton is None:
        x = ref[...]
        return jnp.where(mask, x, jnp.zeros_like(x))
    return pltriton.load(ref, mask=mask, other=0.0)


def _mstore(ref, val, mask, interpret):
    if interpret or pltriton is None:
        ref[...] = jnp.where(mask, val, ref[...])
    else:
        pltriton.store(ref, val, mask=mask)


def _dot(a, b, dt):
    return jnp.dot(a.astype(dt), b.astype(dt), preferred_element_type=jnp.float32)


def _l2(x):
    return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_EPS)


# ----------------------------------------------------------------------------------------------------------
# K1: per-chunk WY preparation
# ----------------------------------------------------------------------------------------------------------
def _chunk_program(cmeta_ref, ratio):
    """K1's program: (chunk c, value head h, its key head, first token of the chunk, valid rows in the chunk)."""
    c, h = pl.program_id(0), pl.program_id(1)
    return c, h, h // ratio, cmeta_ref[c, 0], cmeta_ref[c, 1]


def _wy_kernel(cmeta_ref, q_ref, k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, a_ref, gc_ref, *, ratio, scale, l2,
               dt, interpret):
    c, h, hk, tok0, clen = _chunk_program(cmeta_ref, ratio)
    Dk, Dv = q_ref.shape[-1], v_ref.shape[-1]
    r16 = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
    c16 = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
    strict = r16 > c16
    incl = r16 >= c16
    eye = jnp.where(r16 == c16, 1.0, 0.0).astype(jnp.float32)
    ar = lax.broadcasted_iota(jnp.int32, (SUB,), 0)

    qs, ks, vs, gs, bs = [], [], [], [], []
    off = jnp.float32(0.0)
    for i in range(C // SUB):
        rows = pl.ds(tok0 + i * SUB, SUB)
        m1 = (i * SUB + ar) < clen
        mk = jnp.broadcast_to(m1[:, None], (SUB, Dk))
        mv = jnp.broadcast_to(m1[:, None], (SUB, Dv))
        q = _mload(q_ref.at[rows, hk, :], mk, interpret).astype(jnp.float32)
        k = _mload(k_ref.at[rows, hk, :], mk, interpret).astype(jnp.float32)
        v = _mload(v_ref.at[rows, h, :], mv, interpret).astype(jnp.float32)
        g = _mload(g_ref.at[rows, h], m1, interpret).astype(jnp.float32)
        b = _mload(b_ref.at[rows, h], m1, interpret).astype(jnp.float32)
        if l2:
            q, k = _l2(q), _l2(k)
        q = q * scale
        gc = jnp.sum(jnp.where(incl, g[None, :], 0.0), axis=1) + off
        off = off + jnp.sum(g)
        gc_ref[h, pl.ds(c * C + i * SUB, SUB)] = gc
        qs.append(q), ks.append(k), vs.append(v), gs.append(gc), bs.append(b)

    nb = C // SUB
    A = {}
    for i in range(nb):
        for j in range(i + 1):
            kk = _dot(ks[i], ks[j].T, dt)
            diff = gs[i][:, None] - gs[j][None, :]
            if i == j:
                dec = jnp.where(strict, jnp.exp(jnp.where(strict, diff, 0.0)), 0.0)
            else:
                dec = jnp.exp(diff)
            A[i, j] = kk * dec * bs[i][:, None]
            qk = _dot(qs[i], ks[j].T, dt)
            if i == j:
                aq = qk * jnp.where(incl, jnp.exp(jnp.where(incl, diff, 0.0)), 0.0)
            else:
                aq = qk * dec
            a_ref[h, pl.ds(c * C + i * SUB, SUB), pl.ds(j * SUB, SUB)] = aq.astype(a_ref.dtype)
        for j in range(i + 1, nb):
            a_ref[h, pl.ds(c * C + i * SUB, SUB), pl.ds(j * SUB, SUB)] = jnp.zeros((SUB, SUB), a_ref.dtype)

    # (I + A_ii)^-1 by forward substitution on Y = X - I (rows extracted with masked sums)
    X = {}
    for i in range(nb):
        Y = -A[i, i]
        for r in range(2, SUB):
            a = jnp.sum(jnp.where(r16 == r, -A[i, i], 0.0), axis=0)  # row r of -A
            a = a + jnp.sum(a[:, None] * Y, axis=0)
            Y = jnp.where(r16 == r, a[None, :], Y)
        X[i, i] = Y + eye
    f32 = jnp.float32
    for d in range(1, nb):  # block merges, by distance from the diagonal
        for i in range(d, nb):
            j = i - d
            acc = None
            for m in range(j, i):
                t = _dot(A[i, m], X[m, j], f32)
                acc = t if acc is None else acc + t
            X[i, j] = -_dot(X[i, i], acc, f32)

    kb = [ks[j] * (bs[j] * jnp.exp(gs[j]))[:, None] for j in range(nb)]
    vb = [vs[j] * bs[j][:, None] for j in range(nb)]
    for i in range(nb):
        w = None
        u = None
        for j in range(i + 1):
            tw = _dot(X[i, j], kb[j], dt)
            tu = _dot(X[i, j], vb[j], dt)
            w = tw if w is None else w + tw
            u = tu if u is None else u + tu
        w_ref[h, pl.ds(c * C + i * SUB, SUB), :] = w.astype(w_ref.dtype)
        u_ref[h, pl.ds(c * C + i * SUB, SUB), :] = u.astype(u_ref.dtype)


def _wy_wide_kernel(cmeta_ref, q_ref, k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, a_ref, gc_ref, *, ratio, scale,
                    l2, dt, interpret):
    """K1 on whole 64-row tiles (variant "wide"), same outputs as `_wy_kernel`.

    The 16-row kernel issues ~60 tiny dots whose mma layouts are converted to dot-operand layouts one by one
    (offline sm_90 build: 122 convert_layouts, 271 barriers, 255 registers + 280 B of spills, mma.sync). Here
    every matrix is one 64x64 (or 64x128) register tile and block structure is written as masks, since Triton
    cannot slice a register tensor (offline: 33 barriers, 7 spill stores, wgmma):
      * k k^T and q k^T are one dot each (the upper triangle is computed and masked away);
      * (I + A)^-1 by block doubling (see below): 10 fp32 64x64 dots; exact block forward substitution, so no
        series whose terms grow and cancel;
      * w = X (beta e^gc k), u = X (beta v) as one 64x64 @ 64x128 dot each; beta e^gc k is formed in bf16 right
        away (keeping the fp32 k alive until here spilled).
    H200, T = 16K: 0.855 ms vs 0.987 ms for `_wy_kernel` (bench/results/gdn_probe.json)."""
    c, h, hk, tok0, clen = _chunk_program(cmeta_ref, ratio)
    Dk, Dv = q_ref.shape[-1], v_ref.shape[-1]
    f32 = jnp.float32
    rows = pl.ds(tok0, C)
    ar = lax.broadcasted_iota(jnp.int32, (C,), 0)
    m1 = ar < clen
    mk = jnp.broadcast_to(m1[:, None], (C, Dk))
    r = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    cc = lax.broadcasted_iota(jnp.int32, (C, C), 1)

    q = _mload(q_ref.at[rows, hk, :], mk, interpret).astype(f32)
    k = _mload(k_ref.at[rows, hk, :], mk, interpret).astype(f32)
    g = _mload(g_ref.at[rows, h], m1, interpret).astype(f32)
    b = _mload(b_ref.at[rows, h], m1, interpret).astype(f32)
    if l2:
        q, k = _l2(q), _l2(k)
    gc = jnp.cumsum(g)  # chunk-local inclusive cumsum
    gc_ref[h, pl.ds(c * C, C)] = gc
    diff = gc[:, None] - gc[None, :]
    incl = r >= cc
    strict = r > cc
    kd = k.astype(dt)
    kb = (k * (b * jnp.exp(gc))[:, None]).astype(dt)  # fp32 k dies here (it spilled when kept to the w dot)
    qk = _dot(q * scale, kd.T, dt)
    a_ref[h, pl.ds(c * C, C), :] = jnp.where(incl, qk * jnp.exp(jnp.where(incl, diff, 0.0)), 0.0).astype(
        a_ref.dtype)
    kk = _dot(kd, kd.T, dt)
    A = jnp.where(strict, kk * jnp.exp(jnp.where(strict, diff, 0.0)) * b[:, None], 0.0)

    # (I + A)^-1 by block doubling: X inverts the block-diagonal part of I + A with blocks of size s; the
    # next size adds the lower-left quarter L of each 2s block, (I + X L) has (X L)^2 = 0, hence
    # X <- (I - X L) X. Size 1 -> 2 needs no dot (X = I).
    X = jnp.where(r == cc, 1.0, 0.0) - jnp.where((r // 2) == (cc // 2), A, 0.0)
    s = 2
    while s < C:
        L = jnp.where(((r // (2 * s)) == (cc // (2 * s))) & ((r // s) != (cc // s)), A, 0.0)
        X = X - _dot(_dot(X, L, f32), X, f32)
        s *= 2

    w_ref[h, pl.ds(c * C, C), :] = _dot(X, kb, dt).astype(w_ref.dtype)
    v = _mload(v_ref.at[rows, h, :], jnp.broadcast_to(m1[:, None], (C, Dv)), interpret).astype(f32)
    u_ref[h, pl.ds(c * C, C), :] = _dot(X, v * b[:, None], dt).astype(u_ref.dtype)


# ----------------------------------------------------------------------------------------------------------
# K2: sequential inter-chunk state recurrence + outputs
# ----------------------------------------------------------------------------------------------------------
def _state_kernel(smeta_ref, q_ref, k_ref, w_ref, u_ref, a_ref, gc_ref, s_in_ref, o_ref, s_ref, *, ratio, scale,
                  l2, BV, dt, interpret):
    del s_in_ref  # aliased with s_ref
    n = pl.program_id(0)
    h = pl.program_id(1)
    jv = pl.program_id(2)
    hk = h // ratio
    ch0 = smeta_ref[n, 0]
    nch = smeta_ref[n, 1]
    tok0 = smeta_ref[n, 2]
    slen = smeta_ref[n, 3]
    slot = smeta_ref[n, 4]
    rrow = smeta_ref[n, 5]
    wrow = smeta_ref[n, 6]
    hinit = smeta_ref[n, 7]
    Dk = q_ref.shape[-1]
    cols = pl.ds(jv * BV, BV)
    S0 = s_ref[jnp.maximum(rrow, 0), h, :, cols].astype(jnp.float32)
    S = jnp.where((slot >= 0) & (hinit > 0), S0, 0.0)
    ar = lax.broadcasted_iota(jnp.int32, (C,), 0)

    def body(ci, S):
        c = ch0 + ci
        t0 = tok0 + ci * C
        m1 = ar < (slen - ci * C)
        mk = jnp.broadcast_to(m1[:, None], (C, Dk))
        gc = gc_ref[h, pl.ds(c * C, C)]
        glast = gc_ref[h, c * C + C - 1]
        q = _mload(q_ref.at[pl.ds(t0, C), hk, :], mk, interpret).astype(jnp.float32)
        k = _mload(k_ref.at[pl.ds(t0, C), hk, :], mk, interpret).astype(jnp.float32)
        if l2:
            q, k = _l2(q), _l2(k)
        q = q * (scale * jnp.exp(gc))[:, None]
        k = k * jnp.exp(glast - gc)[:, None]
        w = w_ref[h, pl.ds(c * C, C), :]
        u = u_ref[h, pl.ds(c * C, C), cols].astype(jnp.float32)
        a = a_ref[h, pl.ds(c * C, C), :]
        vnew = u - _dot(w, S, dt)
        o = _dot(q, S, dt) + _dot(a, vnew, dt)
        _mstore(o_ref.at[pl.ds(t0, C), h, cols], o.astype(o_ref.dtype),
                jnp.broadcast_to(m1[:, None], (C, BV)), interpret)
        return S * jnp.exp(glast) + _dot(k.T, vnew, dt)

    S = lax.fori_loop(0, nch, body, S)

    @pl.when((slot >= 0) & (slen > 0))
    def _():
        s_ref[wrow, h, :, cols] = S


# ----------------------------------------------------------------------------------------------------------
# wrappers
# ----------------------------------------------------------------------------------------------------------
VARIANTS = ("wide", "base")  # K1 variants, the default first


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "interpret", "block_v", "num_warps",
                                             "num_stages", "dot_dtype", "wy_warps",
                                             "stop_after_wy", "layer", "variant"),
                   donate_argnames=("state",))
def chunk_gated_delta_rule_varlen_pallas(q, k, v, g, beta, *, cu_seqlens, state, slots, scale, read_col=None,
                                         has_initial_state=None, use_qk_l2norm=False, interpret=False,
                                         block_v=None, num_warps=None, num_stages=None, dot_dtype=None,
                                         wy_warps=None, stop_after_wy=False, layer=None, variant="wide"):
    """Same contract as gdn_reference.chunk_gated_delta_rule_varlen (o past cu_seqlens[-1] is unspecified);
    the state array is donated and updated in place. Sequences must use distinct slots.

    `variant` (static) picks K1, both computing the same thing: "wide" = 64-row `_wy_wide_kernel` (default: on
    the H200 at T = 16K, bench/results/gdn_probe.json, K1 0.855 ms vs 0.987 ms, the whole prefill 1.84 vs
    1.97 ms), "base" = 16-row `_wy_kernel`. (A leaner K2 with a third of the instructions per chunk step was
    measured not faster, 1.04 vs 0.98 ms, and removed: the chunk step is bound by its dependent dots.)"""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r} not in {VARIANTS}")
    _, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    N = cu_seqlens.shape[0] - 1
    flat, k1, stride, offset, unflat = flat_state(state, layer)
    assert flat.dtype == jnp.float32
    dt = jnp.dtype(dot_dtype) if dot_dtype is not None else (jnp.float32 if interpret else jnp.bfloat16)
    inter_dt = dt
    lay = varlen_chunk_layout(cu_seqlens, T, C)
    NC = lay["NC"]
    cu = cu_seqlens.astype(jnp.int32)
    lens = cu[1:] - cu[:-1]
    nch = (lens + C - 1) // C
    ch0 = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nch).astype(jnp.int32)])[:-1]
    slots, rrow, wrow = slot_rows(slots, read_col, N, k1, stride, offset)
    hinit = jnp.ones((N,), jnp.int32) if has_initial_state is None else has_initial_state.astype(jnp.int32)
    smeta = jnp.stack([ch0, nch, cu[:-1], lens, slots, rrow, wrow, hinit], axis=1)
    cmeta = jnp.stack([lay["chunk_tok0"], lay["chunk_len"]], axis=1)

    x = [a[0] for a in (q, k, v, g, beta)]  # packed [T, ...]
    Tx = T
    if interpret:  # interpret-mode slices clamp instead of masking: give every chunk 64 readable rows
        x = [jnp.pad(a, [(0, C)] + [(0, 0)] * (a.ndim - 1)) for a in x]
        Tx = T + C
    qx, kx, vx, gx, bx = x
    ratio = Hv // Hk
    kw1, kw2 = {}, {}
    if not interpret and pltriton is not None:
        kw1["compiler_params"] = pltriton.CompilerParams(num_warps=wy_warps or 4, num_stages=1)
        kw2["compiler_params"] = pltriton.CompilerParams(num_warps=num_warps or 4, num_stages=num_stages or 2)

    w, u, A, gc = pl.pallas_call(
        functools.partial(_wy_wide_kernel if variant == "wide" else _wy_kernel, ratio=ratio, scale=float(scale),
                          l2=bool(use_qk_l2norm), dt=dt, interpret=interpret),
        grid=(NC, Hv),
        out_shape=(jax.ShapeDtypeStruct((Hv, NC * C, Dk), inter_dt),
                   jax.ShapeDtypeStruct((Hv, NC * C, Dv), inter_dt),
                   jax.ShapeDtypeStruct((Hv, NC * C, C), inter_dt),
                   jax.ShapeDtypeStruct((Hv, NC * C), jnp.float32)),
        interpret=interpret,
        **kw1,
    )(cmeta, qx, kx, vx, gx, bx)
    if stop_after_wy:  # benchmarking aid: K1 alone
        return (w, u, A, gc), state

    BV = block_v or min(Dv, 32)
    o, new_flat = pl.pallas_call(
        functools.partial(_state_kernel, ratio=ratio, scale=float(scale), l2=bool(use_qk_l2norm), BV=BV, dt=dt,
                          interpret=interpret),
        grid=(N, Hv, Dv // BV),
        out_shape=(jax.ShapeDtypeStruct((Tx, Hv, Dv), v.dtype),
                   jax.ShapeDtypeStruct(flat.shape, flat.dtype)),
        input_output_aliases={7: 1},
        interpret=interpret,
        **kw2,
    )(smeta, qx, kx, w, u, A, gc, flat)
    return o[None, :T], unflat(new_flat)


def chunk_gated_delta_rule_pallas(q, k, v, g, beta, *, scale, initial_state=None, output_final_state=True,
                                  use_qk_l2norm=False, interpret=False, **tune):
    """Batch form (B equal-length sequences) on top of the varlen kernel; same contract as
    gdn_reference.chunk_gated_delta_rule."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    pack = lambda a: a.reshape((1, B * T) + a.shape[2:])
    cu = jnp.arange(B + 1, dtype=jnp.int32) * T
    if initial_state is None:
        state = jnp.zeros((B, Hv, Dk, Dv), jnp.float32)
        hinit = jnp.zeros((B,), bool)
    else:
        state = jnp.array(initial_state, jnp.float32, copy=True)
        hinit = None
    o, st = chunk_gated_delta_rule_varlen_pallas(
        pack(q), pack(k), pack(v), pack(g), pack(beta), cu_seqlens=cu, state=state,
        slots=jnp.arange(B, dtype=jnp.int32), scale=scale, has_initial_state=hinit, use_qk_l2norm=use_qk_l2norm,
        interpret=interpret, **tune)
    return o.reshape(B, T, Hv, Dv), (st if output_final_state else None)
