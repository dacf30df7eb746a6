"""Gated DeltaNet (linear_attention layers): causal conv + SiLU, then the gated delta rule with an fp32 state.

Per token, with q and k L2-normalised and q scaled by Dk^-0.5 (state S [Hv, Dk, Dv]):
    S <- S * exp(g);  S <- S + k (beta (v - S^T k))^T;  o = S^T q
Padding tokens are made exact no-ops (g = 0, beta = 0), so a right-padded batch leaves each row's state as if only
its valid tokens had been seen.

Which delta rule runs (decided once per `gdn_forward` call, at trace time, by the same switch as the quantized
matmuls: FLASHNEXT_KERNELS=auto|pallas|interpret|reference, see pallas_kernels/kernel_switch.py):
  * "reference" (auto off GPU), and "pallas" with float32 activations: the pure-JAX rules of this module
    (`delta_rule_absolute`: the chunked form on whole chunks at absolute positions, the recurrence elsewhere, for
    the engine's checkpoint columns and any batch-invariant forward; `delta_rule_chunked` / `delta_rule_recurrent`
    (T <= 4) for training and with batch invariance off). The GPU kernels feed bf16 operands to the tensor
    cores, so fp32 runs stay on this exact path: the fp32 parity tests against transformers (1e-5) depend on its
    op order. Do not reorder these ops.
  * "pallas" (auto on GPU) with bf16/fp16 activations, and "interpret" (the kernels interpreted on CPU, for tests):
    the Pallas kernels of pallas_kernels/ (docs/kernels-gdn.md) in their FLA conventions: q, k per key head (the
    kernel maps key head i to value heads i*rep ..), L2 norm and Dk^-0.5 scale inside the kernel. Prefill = the
    chunked kernel (`chunk_gated_delta_rule`); T <= 4 without checkpoints = the slot decode kernel
    (`recurrent_gated_delta_rule_slots`) on a fresh [B, T, Hv, Dk, Dv] state array whose column 0 holds the
    starting state (slots = arange(B)); checkpoint columns = the engine's store path below on a fresh one-layer
    leaf (`delta_rule_kernels`).
  * the engine (`RealRunner.step`) on the kernel path passes a `StoreRecState` instead of a state: the kernels read
    and write the store's all-layer leaf by (slot, column, layer) in place (`delta_rule_in_store`).
The causal conv is XLA on every path (a memory-bound multiply-add; the Pallas decode conv is not used yet).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import fixed_order, gdn_kernels
from pallas_kernels.kernel_switch import resolve_impl

from .config import ModelConfig
from .layers import gated_rms_norm, linear, linear_group

CHUNK = 64
# Chunk of the reference chunked form when differentiated (flashnext_jax.training sets it while tracing a loss):
# the backward of 64-wide batched triangular solves is ~170x slower on CPU than at 32 (6.8 s vs 0.04 s per
# [16, 128, 6, 16] call), the forward result is the same up to rounding.
TRAINING_CHUNK: int | None = None


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(fixed_order.tree_sum(x * x, -1, keepdims=True) + eps)


def _delta_step(s, inputs):
    """One token of the gated delta rule: (state, (q, k, v, g, beta)) -> (state, (out, state))."""
    qt, kt, vt, gt, bt = inputs
    s = s * jnp.exp(gt)[..., None, None]
    kv_mem = jnp.einsum("bhkv,bhk->bhv", s, kt, precision="highest")
    delta = (vt - kv_mem) * bt[..., None]
    s = s + kt[..., :, None] * delta[..., None, :]
    return s, (jnp.einsum("bhkv,bhk->bhv", s, qt, precision="highest"), s)


def delta_rule_recurrent(q, k, v, g, beta, state):
    """Sequential form. q, k [B, T, H, Dk]; v [B, T, H, Dv]; g, beta [B, T, H]; state [B, H, Dk, Dv]; all fp32."""

    def step(s, inputs):
        s, (out, _) = _delta_step(s, inputs)
        return s, out  # keep only the outputs: no per-token states in memory

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), state


def delta_rule_recurrent_states(q, k, v, g, beta, state):
    """`delta_rule_recurrent` that also returns the state after every token: (out, states [B, T, H, Dk, Dv])."""
    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    _, (out, states) = jax.lax.scan(_delta_step, state, xs)
    return jnp.moveaxis(out, 0, 1), jnp.moveaxis(states, 0, 1)


def _gather_tokens(a, idx):
    """a [B, T, ...] -> a[b, idx[b, i]] for idx [B, N] (clipped to the row)."""
    idx = jnp.clip(idx, 0, a.shape[1] - 1)
    return jnp.take_along_axis(a, idx.reshape(*idx.shape, *([1] * (a.ndim - 2))), axis=1)


def _shift_rows(a, offset):
    """a [B, T, ...] with row b moved left by offset[b]: a[b, offset[b] + i] (past the end: the last token)."""
    return _gather_tokens(a, offset[:, None] + jnp.arange(a.shape[1])[None, :])


def absolute_chunk_split(start, n_valid, chunk: int = CHUNK):
    """How `delta_rule_absolute`'s rule splits each row's tokens (absolute positions start .. start + n_valid - 1):
    (head, body, rest) [B]: `head` tokens before the first whole absolute chunk (recurrent), `body` tokens in whole
    chunks (chunked), the recurrent rest from row offset `rest` = head + body. No whole chunk: 0, 0, 0."""
    up = -(-start // chunk) * chunk  # the first chunk boundary at or after start
    body = jnp.maximum((start + n_valid) // chunk * chunk - up, 0)  # up to the last boundary at or before the end
    head = jnp.where(body > 0, up - start, 0)
    return head, body, head + body


def delta_rule_absolute(q, k, v, g, beta, state, start, n_valid, ends=None, chunk: int = CHUNK):
    """The delta rule over each row's n_valid tokens at absolute positions start .. start + n_valid - 1, computed
    so that a token's result does not depend on how its prompt was cut into steps or what else the step holds.

    The chunked form and the recurrence round differently, so which one a token goes through must depend on the
    token alone: the chunked form runs exactly the whole absolute chunks [c*chunk, (c+1)*chunk) that lie inside the
    row's tokens, in the same chunks whatever the step's shape (the row is shifted so they start at offset 0); every
    other token (a ragged head before the first whole chunk, the tail after the last, a decode step's tokens) goes
    through the recurrence. A prompt cut into steps at multiples of `chunk` (the scheduler's prefill alignment)
    then gives the same states and outputs as in one step.

    Returns (out [B, T, H, Dv], states [B, K1, H, Dk, Dv]): the state after ends[:, c] tokens of the row (the
    engine's checkpoint columns; default ends = n_valid[:, None]: the final state). A column that falls inside the
    chunked part, short of its end (only a prefill step ending on the grid with K1 > 1, whose earlier columns the
    engine never reads), holds the state at the end of the chunked part. Padding tokens must be identities
    (g = beta = 0).
    """
    b, t = g.shape[:2]
    head, body, rest = absolute_chunk_split(start, n_valid, chunk)
    pos = jnp.arange(t)[None, :]
    keep = lambda a, m: jnp.where(m.reshape(*m.shape, *([1] * (a.ndim - 2))), a, 0.0)  # noqa: E731

    # 1.-2. only a step of at least one chunk can hold a whole chunk; below that head = rest = 0 and every token is
    # the recurrent rest (3.)
    w_head = min(t, chunk - 1)
    s = state
    if t >= chunk:
        # 1. the head, recurrent (tokens 0 .. head - 1; only rows with whole chunks have one)
        in_head = pos[:, :w_head] < head[:, None]
        out_head, s = delta_rule_recurrent(q[:, :w_head], k[:, :w_head], v[:, :w_head], keep(g[:, :w_head], in_head),
                                           keep(beta[:, :w_head], in_head), state)
        # 2. the whole chunks, chunked, shifted so that they start at offset 0
        in_body = pos < body[:, None]
        sh = [_shift_rows(a, head) for a in (q, k, v, g, beta)]
        out_body, s = delta_rule_chunked(sh[0], sh[1], sh[2], keep(sh[3], in_body), keep(sh[4], in_body), s, chunk)
        out_body = _gather_tokens(out_body, pos - head[:, None])  # back: shifted token i is token head + i
    # 3. the rest, recurrent, with the state after each token (fewer than 2 * chunk tokens: see above)
    w_rest = min(t, 2 * chunk - 1)
    in_rest = pos[:, :w_rest] < (n_valid - rest)[:, None]
    sh = [_shift_rows(a, rest)[:, :w_rest] if t >= chunk else a for a in (q, k, v, g, beta)]  # else rest = 0
    out_rest, states = delta_rule_recurrent_states(sh[0], sh[1], sh[2], keep(sh[3], in_rest), keep(sh[4], in_rest), s)
    ends = n_valid[:, None] if ends is None else ends
    col = ends - 1 - rest[:, None]  # [B, K1]: the window offset of the token each column ends after
    cols = jnp.where((col >= 0)[..., None, None, None], _gather_tokens(states, col), s[:, None])
    if t < chunk:  # one step's decode or verify tokens, a short prefill: all of it is the recurrent rest (rest = 0)
        return out_rest, cols

    out = jnp.zeros(v.shape[:3] + (out_rest.shape[-1],), out_rest.dtype)
    out = out.at[:, :w_head].set(jnp.where((pos[:, :w_head] < head[:, None])[..., None, None], out_head, 0.0))
    in_body = (pos >= head[:, None]) & (pos < rest[:, None])
    out = jnp.where(in_body[..., None, None], out_body, out)
    from_rest = _gather_tokens(out_rest, pos - rest[:, None])  # token i is window token i - rest
    out = jnp.where((pos >= rest[:, None])[..., None, None], from_rest, out)
    return out, cols


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK):
    """Chunked WY form, exact up to rounding. Same arguments as `delta_rule_recurrent`; T is padded internally."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:
        q, k, v = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (g, beta))
    n = (t + pad) // chunk

    def to_chunks(a):  # [B, T, H, ...] -> [N, B, H, C, ...]
        a = a.reshape(b, n, chunk, h, *a.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(a, 1, 0), 3, 2)

    qc, kc, vc, gc, bc = (to_chunks(a) for a in (q, k, v, g, beta))
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    hp = "highest"

    def step(s, inputs):
        qi, ki, vi, gi, bi = inputs  # [B, H, C, ...]
        cum = jnp.cumsum(gi, axis=-1)  # [B, H, C] log decay since the chunk start
        decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # exp(G_i - G_j), i >= j
        k_beta, v_beta = ki * bi[..., None], vi * bi[..., None]
        # WY representation: with L the strictly lower part of (k_beta k^T) * decay, T = (I + L)^-1,
        # u = T v_beta and w = T (k_beta exp(G)). solve_triangular ignores the diagonal (unit_diagonal).
        system = jnp.einsum("bhik,bhjk->bhij", k_beta, ki, precision=hp) * decay
        u = jax.scipy.linalg.solve_triangular(system, v_beta, lower=True, unit_diagonal=True)
        w = jax.scipy.linalg.solve_triangular(system, k_beta * jnp.exp(cum)[..., None], lower=True,
                                              unit_diagonal=True)
        intra = jnp.einsum("bhik,bhjk->bhij", qi, ki, precision=hp) * decay
        v_new = u - jnp.einsum("bhck,bhkv->bhcv", w, s, precision=hp)
        inter = jnp.einsum("bhck,bhkv->bhcv", qi * jnp.exp(cum)[..., None], s, precision=hp)
        out = inter + jnp.einsum("bhij,bhjv->bhiv", intra, v_new, precision=hp)
        last = cum[..., -1:]
        k_decayed = ki * jnp.exp(last - cum)[..., None]
        s = s * jnp.exp(last)[..., None] + jnp.einsum("bhck,bhcv->bhkv", k_decayed, v_new, precision=hp)
        return s, out

    state, out = jax.lax.scan(step, state, (qc, kc, vc, gc, bc))  # out [N, B, H, C, Dv]
    out = jnp.moveaxis(out, 0, 1)  # [B, N, H, C, Dv]
    out = jnp.moveaxis(out, 3, 2).reshape(b, n * chunk, h, dv)
    return out[:, :t], state


def delta_rule_kernels(q, k, v, g, beta, state, base=None, k1: int | None = None, *, impl: str):
    """The delta rule through the Pallas kernel entry points (impl "pallas" or "interpret").

    q, k [B, T, Hk, Dk] raw (not normalised, not repeated to Hv, any float dtype); v [B, T, Hv, Dv]; g, beta
    [B, T, Hv] fp32 with tokens past each row's valid length already identities (g = 0, beta = 0); state
    [B, Hv, Dk, Dv] fp32. Without `base`: returns (out [B, T, Hv, Dv] in v.dtype, final state [B, Hv, Dk, Dv]).
    With `base` [B] and k1 (the engine's checkpoint columns: the states after base + 1 .. base + k1 tokens, base + k1 <= T): the states after
    tokens base .. base + k1 - 1, [B, k1, Hv, Dk, Dv].
    """
    b, t = g.shape[:2]
    dk = k.shape[-1]
    kw = dict(scale=dk**-0.5, use_qk_l2norm=True, impl=impl)
    slots = jnp.arange(b, dtype=jnp.int32)

    if base is None:
        if t <= 4:  # decode / short verify: the slot kernel; right padding is identity, so the last column is final
            # fresh state array (the kernel donates it): column 0 = start state, column i written after token i
            states = jnp.zeros((b, t) + state.shape[1:], jnp.float32).at[:, 0].set(state.astype(jnp.float32))
            out, states = gdn_kernels.recurrent_gated_delta_rule_slots(q, k, v, g, beta, state=states, slots=slots,
                                                                       **kw)
            return out, states[:, t - 1]
        return gdn_kernels.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, **kw)

    # checkpoint columns: the store path on a fresh one-layer leaf whose column 0 holds the starting state
    leaf = jnp.zeros((b, k1, 1) + state.shape[1:], jnp.float32).at[:, 0, 0].set(state.astype(jnp.float32))
    rec = StoreRecState(leaf, slots, jnp.zeros((b,), jnp.int32), 0)
    ends = base[:, None] + 1 + jnp.arange(k1)[None, :]
    out, rec = delta_rule_in_store(q, k, v, g, beta, rec, ends, impl=impl)
    return out, rec.leaf[:, :, 0]


class StoreRecState(NamedTuple):
    """The engine store's recurrent-state leaf, addressed by slot in place (`RealRunner.step` on the kernel path).

    leaf: [num_slots + 1, K1, n_gdn, Hv, Dk, Dv] fp32 (state_store layout, every GDN layer); slots: [B] int32 slot
    of each row, -1 for rows that must be neither read nor written (padding, stale generations); read_col: [B]
    the column holding each row's committed state; layer: this layer's index among the GDN layers. The kernels
    read (slot, read_col) and write the checkpoint columns of (slot, :) of this layer, nothing else: no gather
    of the state into the batch, no scatter back.
    """

    leaf: jax.Array
    slots: jax.Array
    read_col: jax.Array
    layer: int


def uses_kernels(dtype) -> bool:
    """Whether gdn_forward runs the Pallas kernels for activations of this dtype (decided at trace time)."""
    mode = resolve_impl(None)
    return not (mode == "reference" or (mode == "pallas" and jnp.dtype(dtype) == jnp.float32))


# the decode kernel's layout in batch-invariant traces: its default follows B (gdn_decode), and how a program lays
# out its reductions sets a row's rounding (the H100 probe saw rows change at 32 rows: BV 16 below 16 rows, else 64)
INVARIANT_DECODE_LAYOUT = dict(block_v=16, num_warps=2)


def delta_rule_in_store(q, k, v, g, beta, rec: StoreRecState, ends, *, impl: str, start=None, n_valid=None):
    """The delta rule with checkpoint columns, reading and writing a store leaf in place (the engine's store, or
    the fresh one-layer leaf of `delta_rule_kernels`).

    Same inputs as delta_rule_kernels; ends [B, K1] as in gdn_forward. The head tokens (before base = ends[:, 0]
    - 1) go through the varlen chunked kernel (rows packed back to back, initial state from (slot, read_col),
    final state to column 0), then the K1 tail tokens through the slot decode kernel reading column 0 (or
    read_col when there is no head) and writing the state after tail token c to column c. Returns (out, rec with
    the updated leaf).

    In a batch-invariant trace (fixed_order.enabled(), with `start` and `n_valid`) the tokens are split by the
    absolute rule of `delta_rule_absolute` instead (`_in_store_absolute`)."""
    if fixed_order.enabled() and start is not None and n_valid is not None:
        return _in_store_absolute(q, k, v, g, beta, rec, ends, start, n_valid, impl=impl)
    b, t = g.shape[:2]
    k1 = ends.shape[1]
    kw = dict(scale=k.shape[-1] ** -0.5, use_qk_l2norm=True, impl=impl, layer=rec.layer)
    leaf, read_col = rec.leaf, rec.read_col
    base = ends[:, 0] - 1
    out = None
    if t > k1:  # t == k1 forces base = 0 (base + k1 <= t): a plain decode / verify step has no head
        head = (jnp.arange(t)[None, :] < base[:, None])[..., None]
        pack = lambda a: a.reshape((1, b * t) + a.shape[2:])
        out, leaf = gdn_kernels.chunk_gated_delta_rule_varlen(
            pack(q), pack(k), pack(v), pack(jnp.where(head, g, 0.0)), pack(jnp.where(head, beta, 0.0)),
            cu_seqlens=jnp.arange(b + 1, dtype=jnp.int32) * t, state=leaf, slots=rec.slots, read_col=read_col,
            **kw)
        out = out.reshape(b, t, *out.shape[2:])
        read_col = jnp.zeros_like(read_col)  # the state after the head tokens is now in column 0
    idx = base[:, None] + jnp.arange(k1)[None, :]  # [B, k1], < T
    take = lambda a: jnp.take_along_axis(a, idx.reshape(b, k1, *([1] * (a.ndim - 2))), axis=1)
    out_t, leaf = gdn_kernels.recurrent_gated_delta_rule_slots(take(q), take(k), take(v), take(g), take(beta),
                                                               state=leaf, slots=rec.slots, read_col=read_col, **kw)
    out = out_t if out is None else out.at[jnp.arange(b)[:, None], idx].set(out_t)
    return out, rec._replace(leaf=leaf)


def _in_store_absolute(q, k, v, g, beta, rec: StoreRecState, ends, start, n_valid, *, impl: str,
                       chunk: int = CHUNK):
    """delta_rule_in_store with `delta_rule_absolute`'s rule, so a token's result does not depend on how its prompt
    was cut into steps or on what else the step holds: the chunked kernel runs exactly the whole absolute chunks
    [c*chunk, (c+1)*chunk) inside each row's tokens; every other token (a ragged head before them, the tail after
    them, a decode or verify step's tokens) goes through the recurrent kernel, in one fixed layout for every B.

    Up to three kernel calls, each reading the state the previous one left in column 0 (identity tokens, g = beta
    = 0, leave a state bit for bit unchanged, so a row with nothing in a phase passes its state through):
      A. the ragged head (recurrent, a window of chunk - 1 tokens, each row running its own head's length, the
         state after it to column 0; only steps of at least one chunk);
      B. the whole chunks (the varlen chunked kernel, each row shifted so that they start at its offset 0; it
         writes every row's final state to column 0);
      C. the rest (recurrent, a window of up to 2 * chunk - 1 tokens, each row running up to its last checkpoint
         token), writing the state after the token each checkpoint column ends at (ends[:, c]) to column c. A
         column that ends inside the whole chunks is not written (K1 > 1 only: a prefill step ending on the grid,
         whose earlier columns the engine never reads); one at their end already holds its state in column 0.
    The recurrent calls run their tokens in a loop of a per-row length (`lengths`): the same loop body for a
    decode token as for a window's, and no unrolled 127-token kernel (minutes of Triton compile per layer)."""
    b, t = g.shape[:2]
    k1 = ends.shape[1]
    kw = dict(scale=k.shape[-1] ** -0.5, use_qk_l2norm=True, impl=impl, layer=rec.layer)
    recurrent = lambda *a, **x: gdn_kernels.recurrent_gated_delta_rule_slots(  # noqa: E731
        *a, slots=rec.slots, **kw, **INVARIANT_DECODE_LAYOUT, **x)
    leaf, read_col = rec.leaf, rec.read_col
    pos = jnp.arange(t)[None, :]
    identity_outside = lambda a, m: jnp.where(m[..., None], a, 0.0)  # noqa: E731  g, beta [B, T, H]
    head, body, rest = absolute_chunk_split(start, n_valid, chunk)  # body = 0 when t < chunk
    out = jnp.zeros(v.shape, v.dtype)
    if t >= chunk:
        w = chunk - 1  # A: the ragged head, the state after its last token to column 0
        on = pos[:, :w] < head[:, None]
        last_only = jnp.where(pos[:, :w] == head[:, None] - 1, 0, -1).astype(jnp.int32)
        out_head, leaf = recurrent(q[:, :w], k[:, :w], v[:, :w], identity_outside(g[:, :w], on),
                                   identity_outside(beta[:, :w], on), state=leaf, read_col=read_col,
                                   write_cols=last_only, lengths=head)
        out = out.at[:, :w].set(out_head)
        read_col = jnp.where(head > 0, 0, read_col)
        # B: the whole chunks, each row shifted left by its head, its final state to column 0
        sq, sk, sv, sg, sb = (_shift_rows(a, head) for a in (q, k, v, g, beta))
        on = pos < body[:, None]
        pack = lambda a: a.reshape((1, b * t) + a.shape[2:])  # noqa: E731
        out_body, leaf = gdn_kernels.chunk_gated_delta_rule_varlen(
            pack(sq), pack(sk), pack(sv), pack(identity_outside(sg, on)), pack(identity_outside(sb, on)),
            cu_seqlens=jnp.arange(b + 1, dtype=jnp.int32) * t, state=leaf, slots=rec.slots, read_col=read_col,
            **kw)
        from_body = _gather_tokens(out_body.reshape(b, t, *out_body.shape[2:]), pos - head[:, None])
        out = jnp.where(((pos >= head[:, None]) & (pos < rest[:, None]))[..., None, None], from_body, out)
        read_col = jnp.zeros_like(read_col)
    # C: the rest, recurrent; the state after the token each checkpoint column ends at goes to that column
    w = min(t, 2 * chunk - 1)
    sq, sk, sv, sg, sb = ((_shift_rows(a, rest) if t >= chunk else a)[:, :w] for a in (q, k, v, g, beta))
    on = pos[:, :w] < (n_valid - rest)[:, None]
    col = ends - 1 - rest[:, None]  # [B, K1]: the window offset of the token column c ends after
    write = jnp.full((b, w), -1, jnp.int32).at[jnp.arange(b)[:, None], jnp.where(col >= 0, col, w)].set(
        jnp.broadcast_to(jnp.arange(k1, dtype=jnp.int32), (b, k1)), mode="drop")
    out_rest, leaf = recurrent(sq, sk, sv, identity_outside(sg, on), identity_outside(sb, on), state=leaf,
                               read_col=read_col, write_cols=write, lengths=jnp.clip(col[:, -1] + 1, 0, w))
    from_rest = _gather_tokens(out_rest, pos - rest[:, None])
    out = jnp.where((pos >= rest[:, None])[..., None, None], from_rest, out)
    return jnp.where((pos < n_valid[:, None])[..., None, None], out, 0).astype(out.dtype), rec._replace(leaf=leaf)


def causal_conv(x_full: jax.Array, weight: jax.Array, t: int, dilation: int = 1) -> jax.Array:
    """Depthwise causal conv over x_full [B, P + T, C] (P = history), weight [C, K]: out[t] = sum_j w[:, j] x[t+j*d]."""
    kernel = weight.shape[-1]
    out = 0.0
    for j in range(kernel):
        out = out + x_full[:, j * dilation : j * dilation + t, :] * weight[:, j]
    return out


def last_valid(x_full: jax.Array, n_valid: jax.Array, keep: int) -> jax.Array:
    """The `keep` rows ending at each row's last valid token: x_full[b, n_valid[b] : n_valid[b] + keep]."""
    idx = n_valid[:, None] + jnp.arange(keep)[None, :]
    return jnp.take_along_axis(x_full, idx[..., None], axis=1)


def gdn_forward(p: dict, cfg: ModelConfig, u, conv_state, rec_state, valid, n_valid, ends=None,
                start=None):
    """One GDN layer. u [B, T, H]; conv_state [B, K-1, C]; rec_state [B, Hv, Dk, Dv] fp32; valid [B, T] bool.

    Returns (y [B, T, H], new conv_state, new rec_state). With `ends` [B, K1] (token counts base+1 .. base+K1, the
    engine's checkpoint columns) the states come back per column: conv [B, K1, K-1, C], rec [B, K1, Hv, Dk, Dv].
    rec_state may instead be a `StoreRecState` (with `ends`, only where `uses_kernels`): the kernels then update
    the store leaf in place and the returned rec state is the StoreRecState holding the new leaf. start [B]: the
    absolute position of each row's first token (default 0), which places the delta rule's chunks
    (`delta_rule_absolute`).
    """
    bsz, t, _ = u.shape
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kernel = cfg.linear_conv_kernel_dim

    mixed, z = linear_group(u, p, ("in_proj_qkv", "in_proj_z"))
    b_raw, a_raw = linear_group(u, p, ("in_proj_b", "in_proj_a"))
    x_full = jnp.concatenate([conv_state.astype(mixed.dtype), mixed], axis=1)
    if ends is None:
        new_conv = last_valid(x_full, n_valid, kernel - 1)
    else:
        new_conv = jnp.stack([last_valid(x_full, ends[:, c], kernel - 1) for c in range(ends.shape[1])], axis=1)
    mixed = jax.nn.silu(causal_conv(x_full, p["conv1d"].astype(mixed.dtype), t))

    q = mixed[..., : hk * dk].reshape(bsz, t, hk, dk)
    k = mixed[..., hk * dk : 2 * hk * dk].reshape(bsz, t, hk, dk)
    v = mixed[..., 2 * hk * dk :].reshape(bsz, t, hv, dv)
    z = z.reshape(bsz, t, hv, dv)
    beta = jax.nn.sigmoid(b_raw).astype(jnp.float32)
    a = a_raw.astype(jnp.float32)
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a + p["dt_bias"].astype(jnp.float32))
    g = jnp.where(valid[..., None], g, 0.0)
    beta = jnp.where(valid[..., None], beta, 0.0)

    mode = resolve_impl(None)
    if isinstance(rec_state, StoreRecState):
        if ends is None or not uses_kernels(u.dtype):
            raise ValueError("a StoreRecState needs the kernel path and checkpoint ends (see RealRunner.step)")
        core, new_rec = delta_rule_in_store(q, k, v, g, beta, rec_state, ends, impl=mode,
                                            start=jnp.zeros_like(n_valid) if start is None else start,
                                            n_valid=n_valid)
    elif not uses_kernels(u.dtype):
        rep = hv // hk  # key head i serves value heads i*rep .. i*rep+rep-1
        q = jnp.repeat(l2_normalize(q.astype(jnp.float32)), rep, axis=2) * (dk**-0.5)
        k = jnp.repeat(l2_normalize(k.astype(jnp.float32)), rep, axis=2)
        v = v.astype(jnp.float32)
        start = jnp.zeros_like(n_valid) if start is None else start
        if ends is None and (TRAINING_CHUNK or not fixed_order.enabled()):
            if t <= 4:
                core, new_rec = delta_rule_recurrent(q, k, v, g, beta, rec_state)
            else:
                core, new_rec = delta_rule_chunked(q, k, v, g, beta, rec_state, chunk=TRAINING_CHUNK or CHUNK)
        else:  # the engine (checkpoint columns), and a batch-invariant forward: chunks at absolute positions
            core, new_rec = delta_rule_absolute(q, k, v, g, beta, rec_state, start, n_valid, ends)
            new_rec = new_rec if ends is not None else new_rec[:, 0]
    else:
        base = None if ends is None else ends[:, 0] - 1
        k1 = None if ends is None else ends.shape[1]
        core, new_rec = delta_rule_kernels(q, k, v, g, beta, rec_state, base, k1, impl=mode)

    core = core.astype(u.dtype)
    out = gated_rms_norm(core, z, p["norm"], cfg.rms_norm_eps, cfg.output_gate_type)
    return linear(out.reshape(bsz, t, hv * dv), p["out_proj"]), new_conv, new_rec
