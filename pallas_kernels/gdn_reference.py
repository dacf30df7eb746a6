"""Pure-JAX gated delta rule (Gated DeltaNet): recurrent form, chunked WY form, slot-indexed wrappers.

Conventions follow flash-linear-attention (FLA): q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv];
Hv a multiple of Hk, k/q head i serves v heads i*(Hv/Hk) .. (i+1)*(Hv/Hk)-1. g is the log decay (<= 0).
Per token, with an fp32 state S [Hv, Dk, Dv]:
    S = S * exp(g_t);  S += k_t outer (beta_t * (v_t - S^T k_t));  o_t = S^T (scale * q_t)
Optional L2 norm of q and k (x * rsqrt(sum x^2 + 1e-6)) before scaling. All math in fp32; o is returned in
v.dtype.

The slot-indexed forms use the state layout of gdn_layout, shared with the Pallas kernels. These functions
define the kernels' contracts; gdn_kernels runs one or the other behind the kernel switch.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.gdn_layout import CHUNK, L2_EPS, flat_state, slot_rows, varlen_chunk_layout

__all__ = [
    "l2norm",
    "recurrent_gated_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_varlen",
    "recurrent_gated_delta_rule_slots",
]


def l2norm(x, eps=L2_EPS):
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prep_qk(q, k, hv, scale, use_qk_l2norm):
    """fp32 q (scaled) and k, heads repeated to hv: [B, T, Hv, Dk]."""
    q = q.astype(jnp.float32)
    k = k.astype(jnp.float32)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    r = hv // q.shape[2]
    if r != 1:
        q = jnp.repeat(q, r, axis=2)
        k = jnp.repeat(k, r, axis=2)
    return q, k


def _check(q, k, v, g, beta):
    B, T, Hk, Dk = q.shape
    Hv = v.shape[2]
    assert k.shape == q.shape, (k.shape, q.shape)
    assert v.shape[:2] == (B, T) and Hv % Hk == 0, (v.shape, q.shape)
    assert g.shape == (B, T, Hv) and beta.shape == (B, T, Hv), (g.shape, beta.shape)
    return B, T, Hk, Dk, Hv, v.shape[3]


# ----------------------------------------------------------------------------------------------------------
# recurrent form
# ----------------------------------------------------------------------------------------------------------
def recurrent_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state=None, output_final_state=True,
                               use_qk_l2norm=False, output_all_states=False):
    """Token-by-token recurrence (lax.scan over T). Returns (o [B,T,Hv,Dv], final [B,Hv,Dk,Dv] or None)
    and, with output_all_states, (o, all_states [B, T, Hv, Dk, Dv]) instead: the state after each token."""
    B, T, Hk, Dk, Hv, Dv = _check(q, k, v, g, beta)
    qf, kf = _prep_qk(q, k, Hv, scale, use_qk_l2norm)
    vf, gf, bf = v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)
    S0 = (jnp.zeros((B, Hv, Dk, Dv), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))

    def step(S, x):
        qt, kt, vt, gt, bt = x
        S = S * jnp.exp(gt)[..., None, None]
        kv = jnp.einsum("bhk,bhkv->bhv", kt, S, precision=lax.Precision.HIGHEST)
        u = bt[..., None] * (vt - kv)
        S = S + kt[..., :, None] * u[..., None, :]
        o = jnp.einsum("bhk,bhkv->bhv", qt, S, precision=lax.Precision.HIGHEST)
        return S, ((o, S) if output_all_states else o)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (qf, kf, vf, gf, bf))
    S, ys = lax.scan(step, S0, xs)
    if output_all_states:
        o, states = ys
        return jnp.moveaxis(o, 0, 1).astype(v.dtype), jnp.moveaxis(states, 0, 1)
    o = jnp.moveaxis(ys, 0, 1).astype(v.dtype)
    return o, (S if output_final_state else None)


# ----------------------------------------------------------------------------------------------------------
# chunked WY form
# ----------------------------------------------------------------------------------------------------------
def _wy_prepare(qc, kc, vc, gc_raw, bc):
    """Per-chunk parallel part. Inputs [..., C, Hv, D] / [..., C, Hv] (fp32, q scaled, k repeated).

    Returns head-major tensors [..., Hv, C, *]: gcum, w = T(beta e^gcum k), u = T(beta v),
    Aqk = mask_incl(q k^T e^(gcum_i - gcum_j))  with T = (I + strict_lower(beta_i k_i.k_j e^(gcum_i-gcum_j)))^-1."""
    hp = lax.Precision.HIGHEST
    qh = jnp.swapaxes(qc, -3, -2)  # [..., Hv, C, Dk]
    kh = jnp.swapaxes(kc, -3, -2)
    vh = jnp.swapaxes(vc, -3, -2)
    gh = jnp.swapaxes(gc_raw, -2, -1)  # [..., Hv, C]
    bh = jnp.swapaxes(bc, -2, -1)
    C = gh.shape[-1]
    gcum = jnp.cumsum(gh, axis=-1)
    i = jnp.arange(C)
    strict = i[:, None] > i[None, :]
    incl = i[:, None] >= i[None, :]
    diff = gcum[..., :, None] - gcum[..., None, :]
    decay = jnp.where(incl, jnp.exp(jnp.where(incl, diff, 0.0)), 0.0)
    kk = jnp.einsum("...ik,...jk->...ij", kh, kh, precision=hp)
    A = jnp.where(strict, kk * decay * bh[..., :, None], 0.0)
    eye = jnp.eye(C, dtype=jnp.float32)
    rhs = jnp.concatenate([kh * (bh * jnp.exp(gcum))[..., None], vh * bh[..., None]], axis=-1)
    sol = lax.linalg.triangular_solve(A + eye, rhs, left_side=True, lower=True, unit_diagonal=True)
    Dk = kh.shape[-1]
    w, u = sol[..., :Dk], sol[..., Dk:]
    Aqk = jnp.einsum("...ik,...jk->...ij", qh, kh, precision=hp) * decay
    return qh, kh, gcum, w, u, Aqk


def _chunk_step(S, qh, kh, gcum, w, u, Aqk):
    """One chunk of the inter-chunk recurrence. S [..., Hv, Dk, Dv]; others head-major [..., Hv, C, *]."""
    hp = lax.Precision.HIGHEST
    vnew = u - jnp.einsum("...ck,...kv->...cv", w, S, precision=hp)
    o = (jnp.einsum("...ck,...kv->...cv", qh * jnp.exp(gcum)[..., None], S, precision=hp)
         + jnp.einsum("...ij,...jv->...iv", Aqk, vnew, precision=hp))
    glast = gcum[..., -1]
    kdec = kh * jnp.exp(glast[..., None] - gcum)[..., None]
    S = S * jnp.exp(glast)[..., None, None] + jnp.einsum("...ck,...cv->...kv", kdec, vnew, precision=hp)
    return S, o


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state=None, output_final_state=True,
                           use_qk_l2norm=False, chunk_size=CHUNK):
    """Chunked (WY) gated delta rule for a batch of equal-length (or right-padded) sequences.

    q, k [B,T,Hk,Dk]; v [B,T,Hv,Dv]; g, beta [B,T,Hv]; initial_state [B,Hv,Dk,Dv] fp32 or None (zeros).
    Returns (o [B,T,Hv,Dv] in v.dtype, final_state [B,Hv,Dk,Dv] fp32 or None). Right padding with
    g = beta = 0 (and any k) leaves the state unchanged."""
    B, T, Hk, Dk, Hv, Dv = _check(q, k, v, g, beta)
    C = chunk_size
    qf, kf = _prep_qk(q, k, Hv, scale, use_qk_l2norm)
    vf, gf, bf = v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)
    Tp = -(-T // C) * C
    if Tp != T:
        pad = lambda a: jnp.pad(a, [(0, 0), (0, Tp - T)] + [(0, 0)] * (a.ndim - 2))
        qf, kf, vf, gf, bf = map(pad, (qf, kf, vf, gf, bf))
    n = Tp // C
    split = lambda a: a.reshape((B, n, C) + a.shape[2:])
    qh, kh, gcum, w, u, Aqk = _wy_prepare(*map(split, (qf, kf, vf, gf, bf)))  # [B, n, Hv, C, *]
    S0 = (jnp.zeros((B, Hv, Dk, Dv), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))

    def body(S, xs):
        return _chunk_step(S, *xs)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (qh, kh, gcum, w, u, Aqk))
    S, o = lax.scan(body, S0, xs)  # o [n, B, Hv, C, Dv]
    o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(B, Tp, Hv, Dv)[:, :T]
    return o.astype(v.dtype), (S if output_final_state else None)


# ----------------------------------------------------------------------------------------------------------
# slot-indexed forms (state layout: gdn_layout)
# ----------------------------------------------------------------------------------------------------------
def chunk_gated_delta_rule_varlen(q, k, v, g, beta, *, cu_seqlens, state, slots, scale, read_col=None,
                                  has_initial_state=None, use_qk_l2norm=False, chunk_size=CHUNK, layer=None):
    """Varlen chunked prefill with slot-indexed states.

    q, k [1,T,Hk,Dk]; v [1,T,Hv,Dv]; g, beta [1,T,Hv] hold N sequences packed back to back,
    cu_seqlens [N+1] int32 (cu[0] = 0, cu[N] <= T; tokens past cu[N] get o = 0).
    state [num_slots, K1, Hv, Dk, Dv] (or [num_slots, Hv, Dk, Dv]) fp32; slots [N] int32 (< 0: padding
    sequence, neither read nor written); read_col [N] (default 0): checkpoint column of the initial state;
    has_initial_state [N] bool (default True): False starts from zeros without reading the slot.
    The final state of sequence n goes to column 0 of slot slots[n]; other slots/columns are untouched.
    layer (static int): state is the store's [num_slots, K1, L, Hv, Dk, Dv] leaf and only layer `layer` is read
    and written (flat_state). Returns (o [1,T,Hv,Dv] in v.dtype, new state array)."""
    _, T, Hk, Dk, Hv, Dv = _check(q, k, v, g, beta)
    C = chunk_size
    N = cu_seqlens.shape[0] - 1
    flat, k1, stride, offset, unflat = flat_state(state, layer)
    slots, rrow, wrow = slot_rows(slots, read_col, N, k1, stride, offset)
    hinit = jnp.ones((N,), bool) if has_initial_state is None else has_initial_state.astype(bool)
    lay = varlen_chunk_layout(cu_seqlens, T, C)
    NC = lay["NC"]
    qf, kf = _prep_qk(q, k, Hv, scale, use_qk_l2norm)
    vf, gf, bf = v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)
    pos = jnp.arange(C, dtype=jnp.int32)
    tok = lay["chunk_tok0"][:, None] + pos[None, :]  # [NC, C]
    m = pos[None, :] < lay["chunk_len"][:, None]
    tok = jnp.where(m, tok, 0)

    def gather(a):
        x = a[0][tok]  # [NC, C, ...]
        return jnp.where(m.reshape(m.shape + (1,) * (x.ndim - 2)), x, 0.0)

    qh, kh, gcum, w, u, Aqk = _wy_prepare(*map(gather, (qf, kf, vf, gf, bf)))  # [NC, Hv, C, *]
    seq = jnp.minimum(lay["chunk_seq"], N - 1)
    c_slot = jnp.where(lay["chunk_seq"] < N, slots[seq], -1)
    c_rrow, c_wrow, c_init = rrow[seq], wrow[seq], hinit[seq]

    def body(carry, xs):
        S, st = carry
        first, last, sl, rr, wr, ini, *ch = xs
        rd = jnp.where((sl >= 0) & ini, jnp.maximum(rr, 0), -1)
        S0 = jnp.where(rd >= 0, lax.dynamic_index_in_dim(st, jnp.maximum(rd, 0), 0, keepdims=False), 0.0)
        S = jnp.where(first, S0, S)
        S, o = _chunk_step(S, *ch)
        do_write = last & (sl >= 0)
        wr_c = jnp.maximum(wr, 0)
        old = lax.dynamic_index_in_dim(st, wr_c, 0, keepdims=False)
        st = lax.dynamic_update_index_in_dim(st, jnp.where(do_write, S, old), wr_c, 0)
        return (S, st), o

    S_init = jnp.zeros((Hv, Dk, Dv), jnp.float32)
    xs = (lay["chunk_first"], lay["chunk_last"], c_slot, c_rrow, c_wrow, c_init, qh, kh, gcum, w, u, Aqk)
    (_, flat), o = lax.scan(body, (S_init, flat.astype(jnp.float32)), xs)  # o [NC, Hv, C, Dv]
    o = jnp.swapaxes(o, 1, 2).reshape(NC * C, Hv, Dv)
    t_valid = jnp.arange(T) < cu_seqlens[-1]
    o = jnp.where(t_valid[:, None, None], o[jnp.where(t_valid, lay["tok_pos"], 0)], 0.0)
    return o[None].astype(v.dtype), unflat(flat)


def recurrent_gated_delta_rule_slots(q, k, v, g, beta, *, state, slots, scale, read_col=None,
                                     use_qk_l2norm=False, layer=None, write_cols=None):
    """Decode / MTP verify of T tokens per row (T static, 1 <= T <= K1) with checkpointed slot states.

    q, k [B,T,Hk,Dk]; v [B,T,Hv,Dv]; g, beta [B,T,Hv]; state [num_slots, K1, Hv, Dk, Dv] fp32 (4-D = K1 1,
    then T must be 1); slots [B] int32 (< 0: padding row: not read, not written, o = 0); read_col [B]
    (default 0): checkpoint column holding the row's current state (after MTP: accepted - 1).
    Writes the state after token t to column t of the row's slot, or with write_cols [B, T] int32 to column
    write_cols[b, t] (not at all where < 0; then T may exceed K1: a window of tokens of which only some end at a
    checkpoint). layer: as in chunk_gated_delta_rule_varlen (the store's all-layer leaf, addressed in place).
    Returns (o [B,T,Hv,Dv], new state)."""
    B, T, Hk, Dk, Hv, Dv = _check(q, k, v, g, beta)
    flat, k1, stride, offset, unflat = flat_state(state, layer)
    if write_cols is None:
        assert T <= k1, f"{T} tokens need {T} checkpoint columns, state has {k1}"
        write_cols = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    slots, rrow, wrow = slot_rows(slots, read_col, B, k1, stride, offset)
    valid = slots >= 0
    S0 = jnp.where(valid[:, None, None, None], flat[jnp.where(valid, rrow, 0)], 0.0)
    o, states = recurrent_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=S0,
                                           use_qk_l2norm=use_qk_l2norm, output_all_states=True)
    o = jnp.where(valid[:, None, None, None], o, 0).astype(v.dtype)
    rows = wrow[:, None] + write_cols * stride  # [B, T]
    rows = jnp.where(valid[:, None] & (write_cols >= 0), rows, flat.shape[0])  # out of range -> dropped
    flat = flat.at[rows.reshape(-1)].set(states.reshape((B * T,) + states.shape[2:]), mode="drop")
    return o, unflat(flat)
