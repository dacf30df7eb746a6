"""Causal depthwise conv1d (kernel W = 4) + SiLU with slot-indexed conv state (GDN's qkv conv).

y_t[c] = silu( sum_{i<W} w[c, i] * x_{t-W+1+i}[c] ), inputs before a sequence's start come from its conv state
(the last W-1 inputs, oldest first). weight [C, W] (torch's conv1d weight [C, 1, W] squeezed), no bias.

Conv state layout matches the recurrent state: [num_slots, K1, W-1, C] (3-D [num_slots, W-1, C] = K1 1), column
read_col[n] is read; prefill writes the final window to column 0; decode of T tokens writes the window after token
t to column t; slot < 0 rows/sequences are never read or written (their outputs are 0).

`causal_conv1d_varlen` (prefill) is plain XLA (one gather + fused multiply-add, memory bound: no kernel needed);
`causal_conv1d_update` (decode / MTP verify) has a Pallas kernel (grid (B, C / BC)) that reads the window by slot,
writes every checkpoint column in place and never touches padding rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:
    from jax.experimental.pallas import triton as pltriton
except Exception:  # pragma: no cover
    pltriton = None


def _flat(state):
    if state.ndim == 3:
        return state, 1, (lambda s: s)
    shape = state.shape
    return state.reshape((shape[0] * shape[1],) + shape[2:]), shape[1], (lambda s: s.reshape(shape))


def causal_conv1d_varlen(x, weight, *, cu_seqlens, conv_state, slots, read_col=None, has_initial_state=None,
                         activation="silu", impl=None):
    """x [T, C] packed sequences (cu_seqlens [N+1]); returns (y [T, C] in x.dtype, new conv_state).
    Tokens past cu_seqlens[-1] get y = 0. (XLA on every backend; `impl` accepted for symmetry.)"""
    del impl
    T, Cch = x.shape
    W = weight.shape[1]
    flat, k1, unflat = _flat(conv_state)
    N = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    slots = slots.astype(jnp.int32)
    rc = jnp.zeros((N,), jnp.int32) if read_col is None else read_col.astype(jnp.int32)
    hinit = jnp.ones((N,), bool) if has_initial_state is None else has_initial_state.astype(bool)
    use_init = (slots >= 0) & hinit
    init = jnp.where(use_init[:, None, None], flat[jnp.where(use_init, slots * k1 + rc, 0)], 0).astype(jnp.float32)
    t = jnp.arange(T, dtype=jnp.int32)
    n = jnp.clip(jnp.searchsorted(cu, t, side="right").astype(jnp.int32) - 1, 0, N - 1)
    p = t - cu[n]
    xf = x.astype(jnp.float32)
    wf = weight.astype(jnp.float32)
    y = jnp.zeros((T, Cch), jnp.float32)
    for i in range(W):
        src = p - (W - 1) + i  # local position of tap i
        from_x = xf[jnp.clip(cu[n] + src, 0, T - 1)]
        from_s = init[n, jnp.clip(W - 1 + src, 0, W - 2)]
        y = y + wf[:, i] * jnp.where((src >= 0)[:, None], from_x, from_s)
    if activation == "silu":
        y = jax.nn.silu(y)
    y = jnp.where((t < cu[-1])[:, None], y, 0).astype(x.dtype)
    lens = cu[1:] - cu[:-1]
    j = jnp.arange(W - 1, dtype=jnp.int32)
    pos = lens[:, None] - (W - 1) + j[None, :]  # [N, W-1]
    fx = xf[jnp.clip(cu[:-1, None] + pos, 0, T - 1)]
    fs = init[jnp.arange(N)[:, None], jnp.clip(W - 1 + pos, 0, W - 2)]
    final = jnp.where((pos >= 0)[..., None], fx, fs).astype(flat.dtype)
    rows = jnp.where((slots >= 0) & (lens > 0), slots * k1, flat.shape[0])
    flat = flat.at[rows].set(final, mode="drop")
    return y, unflat(flat)


def causal_conv1d_update_reference(x, weight, *, conv_state, slots, read_col=None, activation="silu"):
    B, T, Cch = x.shape
    W = weight.shape[1]
    flat, k1, unflat = _flat(conv_state)
    assert T <= k1
    slots = slots.astype(jnp.int32)
    rc = jnp.zeros((B,), jnp.int32) if read_col is None else read_col.astype(jnp.int32)
    valid = slots >= 0
    win = jnp.where(valid[:, None, None], flat[jnp.where(valid, slots * k1 + rc, 0)], 0).astype(jnp.float32)
    wf = weight.astype(jnp.float32)
    ys, wins = [], []
    for t in range(T):
        full = jnp.concatenate([win, x[:, t, None].astype(jnp.float32)], axis=1)  # [B, W, C]
        y = jnp.einsum("bic,ci->bc", full, wf)
        ys.append(jax.nn.silu(y) if activation == "silu" else y)
        win = full[:, 1:]
        wins.append(win)
    y = jnp.where(valid[:, None, None], jnp.stack(ys, 1), 0).astype(x.dtype)
    rows = jnp.where(valid[:, None], slots[:, None] * k1 + jnp.arange(T)[None, :], flat.shape[0])
    flat = flat.at[rows.reshape(-1)].set(jnp.stack(wins, 1).reshape(B * T, W - 1, Cch).astype(flat.dtype),
                                         mode="drop")
    return y, unflat(flat)


def _update_kernel(meta_ref, x_ref, w_ref, s_in_ref, y_ref, s_ref, *, T, W, BC, silu):
    del s_in_ref
    b = pl.program_id(0)
    j = pl.program_id(1)
    slot = meta_ref[b, 0]
    rrow = jnp.maximum(meta_ref[b, 1], 0)
    wrow = meta_ref[b, 2]
    valid = slot >= 0
    cols = pl.ds(j * BC, BC)
    win = [s_ref[rrow, i, cols].astype(jnp.float32) for i in range(W - 1)]
    wts = [w_ref[i, cols].astype(jnp.float32) for i in range(W)]
    for t in range(T):
        win = win + [x_ref[b, t, cols].astype(jnp.float32)]
        y = wts[0] * win[0]
        for i in range(1, W):
            y = y + wts[i] * win[i]
        if silu:
            y = y * jax.nn.sigmoid(y)
        y_ref[b, t, cols] = jnp.where(valid, y, 0.0).astype(y_ref.dtype)
        win = win[1:]

        @pl.when(valid)
        def _(win=win, t=t):
            for i in range(W - 1):
                s_ref[wrow + t, i, cols] = win[i].astype(s_ref.dtype)


@functools.partial(jax.jit, static_argnames=("activation", "interpret", "block_c"), donate_argnames=("conv_state",))
def causal_conv1d_update_pallas(x, weight, *, conv_state, slots, read_col=None, activation="silu", interpret=False,
                                block_c=None):
    B, T, Cch = x.shape
    W = weight.shape[1]
    flat, k1, unflat = _flat(conv_state)
    assert T <= k1
    slots = slots.astype(jnp.int32)
    rc = jnp.zeros((B,), jnp.int32) if read_col is None else read_col.astype(jnp.int32)
    meta = jnp.stack([slots, slots * k1 + rc, slots * k1, slots], axis=1)
    BC = block_c or min(Cch, 1024)
    kw = {}
    if not interpret and pltriton is not None:
        kw["compiler_params"] = pltriton.CompilerParams(num_warps=4, num_stages=1)
    y, new = pl.pallas_call(
        functools.partial(_update_kernel, T=T, W=W, BC=BC, silu=(activation == "silu")),
        grid=(B, Cch // BC),
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(flat.shape, flat.dtype)),
        input_output_aliases={3: 1},
        interpret=interpret,
        **kw,
    )(meta, x, weight.T, flat)
    return y, unflat(new)


def causal_conv1d_update(x, weight, *, conv_state, slots, read_col=None, activation="silu", impl=None):
    """Decode / MTP verify: x [B, T, C] (T <= K1), returns (y [B, T, C], new conv_state); see module doc."""
    from pallas_kernels.kernel_switch import resolve_impl
    mode = resolve_impl(impl)
    if mode == "reference":
        return causal_conv1d_update_reference(x, weight, conv_state=conv_state, slots=slots, read_col=read_col,
                                              activation=activation)
    return causal_conv1d_update_pallas(x, weight, conv_state=conv_state, slots=slots, read_col=read_col,
                                       activation=activation, interpret=(mode == "interpret"))
