"""Pallas (Triton backend) recurrent gated delta rule for decode / MTP verify with slot-indexed checkpoints.

State layout (see gdn_layout and docs/kernels-gdn.md): state [num_slots, K1, Hv, Dk, Dv] fp32 viewed flat as
[num_slots*K1, Hv, Dk, Dv]; a row reads column read_col[b] of slot slots[b] and writes the state after its
token t to column t of the same slot (or to column write_cols[b, t], none where it is < 0), in place
(input_output_aliases). Rows with slot < 0 are padding: their state blocks are never stored (o = 0).

Grid (B, Hv, Dv / BV): each program keeps one [Dk, BV] fp32 state block in registers for all T tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gdn_layout import L2_EPS, flat_state, slot_rows

try:  # Triton-backend compiler params (GPU); unused in interpret mode
    from jax.experimental.pallas import triton as pltriton
except Exception:  # pragma: no cover
    pltriton = None


def _decode_kernel(meta_ref, wcol_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s_in_ref, o_ref, s_out_ref, *, T, ratio,
                   BV, scale, l2, col_stride, looped):
    """looped: the tokens in a loop of meta[b, 3] iterations (per row, read at run time) instead of unrolled, so
    the code of a token is one loop body whatever T is (batch-invariant callers; see the wrapper)."""
    del s_in_ref  # aliased with s_out_ref
    b = pl.program_id(0)
    h = pl.program_id(1)
    j = pl.program_id(2)
    hk = h // ratio
    slot = meta_ref[b, 0]
    rrow = meta_ref[b, 1]
    wrow = meta_ref[b, 2]
    valid = slot >= 0
    cols = pl.ds(j * BV, BV)

    def token(t, S):
        q = q_ref[b, t, hk, :].astype(jnp.float32)
        k = k_ref[b, t, hk, :].astype(jnp.float32)
        v = v_ref[b, t, h, cols].astype(jnp.float32)
        g = g_ref[b, t, h].astype(jnp.float32)
        beta = b_ref[b, t, h].astype(jnp.float32)
        # Every reduction of the token reads only S and the raw q, k, so they are independent of each other (one
        # level of cross-thread reductions instead of four in a chain: the kernel is latency-bound at decode):
        #   S' = e^g S + k u^T,  u = beta (v - e^g S^T k),  o = S'^T q = e^g S^T q + u (k . q)
        # with the l2 norms applied to the reduced values rather than to q and k first.
        rk = jax.lax.rsqrt(jnp.sum(k * k) + L2_EPS) if l2 else 1.0
        rq = (jax.lax.rsqrt(jnp.sum(q * q) + L2_EPS) if l2 else 1.0) * scale
        kq = jnp.sum(k * q) * (rk * rq)
        decay = jnp.exp(g)
        sk = jnp.sum(k[:, None] * S, axis=0) * (rk * decay)  # (e^g S)^T k, normalised k
        sq = jnp.sum(q[:, None] * S, axis=0) * (rq * decay)  # (e^g S)^T q, normalised and scaled q
        u = beta * (v - sk)
        S = S * decay + (k * rk)[:, None] * u[None, :]
        o = sq + u * kq
        o_ref[b, t, h, cols] = jnp.where(valid, o, 0.0).astype(o_ref.dtype)
        col = wcol_ref[b, t]

        @pl.when(valid & (col >= 0))
        def _store():
            s_out_ref[wrow + col * col_stride, h, :, cols] = S

        return S

    S = s_out_ref[jnp.maximum(rrow, 0), h, :, cols].astype(jnp.float32)  # [Dk, BV]
    if looped:
        jax.lax.fori_loop(0, jnp.minimum(meta_ref[b, 3], T), token, S)
    else:
        for t in range(T):
            S = token(t, S)
    return None


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "interpret", "block_v", "num_warps",
                                             "layer"),
                   donate_argnames=("state",))
def recurrent_gated_delta_rule_slots_pallas(q, k, v, g, beta, *, state, slots, scale, read_col=None,
                                            use_qk_l2norm=False, interpret=False, block_v=None, num_warps=None,
                                            layer=None, write_cols=None, lengths=None):
    """Same contract as gdn_reference.recurrent_gated_delta_rule_slots; state is donated and updated in place.
    block_v / num_warps (default: by B, tuned for speed) set how a program's reductions are laid out, so a
    batch-invariant caller fixes them (a row's bits then do not depend on B). lengths [B] (optional): row b runs
    only its first lengths[b] tokens, in a loop (outputs past them unspecified): a long window of mostly identity
    tokens (gdn._in_store_absolute, up to 127) then costs neither the unrolled kernel's compile time (minutes per
    layer) nor its run time, and a decode token runs the same loop body as a window's tokens."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    flat, k1, stride, offset, unflat = flat_state(state, layer)
    if write_cols is None:
        assert T <= k1, f"{T} tokens need {T} checkpoint columns, state has {k1}"
        write_cols = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    assert flat.dtype == jnp.float32
    slots, rrow, wrow = slot_rows(slots, read_col, B, k1, stride, offset)
    looped = lengths is not None
    n_run = lengths.astype(jnp.int32) if looped else jnp.zeros_like(slots)
    meta = jnp.stack([slots, rrow, wrow, n_run], axis=1)  # [B, 4]
    # tuned on the H200 (bench/results/gdn.json): small batches want many small programs
    BV = min(Dv, block_v or (16 if B * Hv < 16 * 48 else 64))
    nw = num_warps or (2 if BV <= 16 else 4)
    kernel = functools.partial(_decode_kernel, T=T, ratio=Hv // Hk, BV=BV, scale=float(scale),
                               l2=bool(use_qk_l2norm), col_stride=stride, looped=looped)
    kw = {}
    if not interpret and pltriton is not None:
        kw["compiler_params"] = pltriton.CompilerParams(num_warps=nw, num_stages=1)
    o, new_flat = pl.pallas_call(
        kernel,
        grid=(B, Hv, Dv // BV),
        out_shape=(jax.ShapeDtypeStruct((B, T, Hv, Dv), v.dtype),
                   jax.ShapeDtypeStruct(flat.shape, flat.dtype)),
        input_output_aliases={7: 1},
        interpret=interpret,
        **kw,
    )(meta, write_cols.astype(jnp.int32), q, k, v, g, beta, flat)
    return o, unflat(new_flat)
