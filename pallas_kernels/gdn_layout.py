"""Layout of the gated delta rule's inputs and slot-indexed states, shared by the pure-JAX reference
(gdn_reference) and the Pallas kernels (gdn_prefill, gdn_decode), so that both address the same rows.

State layout (docs/kernels-gdn.md):
  * state array [num_slots, K1, Hv, Dk, Dv] fp32, K1 = num_spec + 1 checkpoint columns per slot
    (a 4-D [num_slots, Hv, Dk, Dv] array is accepted as K1 = 1);
  * prefill reads column read_col[n] (default 0) of slot slots[n] and writes the final state to column 0;
  * decode of T tokens (1 <= T <= K1) reads column read_col[b] and writes the state after token t to column t;
  * a slot < 0 marks a padding row / sequence: never read, never written (its outputs are zeros).
The flat view [num_slots * K1, Hv, Dk, Dv] (a free reshape) addresses row slot * K1 + col.
Varlen prefill packs N sequences back to back and lays them out chunk-aligned (each starts on a CHUNK boundary).
"""

from __future__ import annotations

import jax.numpy as jnp

CHUNK = 64
L2_EPS = 1e-6

__all__ = ["CHUNK", "L2_EPS", "flat_state", "slot_rows", "varlen_chunk_layout"]


def flat_state(state, layer=None):
    """Flat row view of a slot-indexed state array: (flat [rows, Hv, Dk, Dv], K1, col_stride, offset, unflatten).

    [num_slots, K1, Hv, Dk, Dv] (4-D: K1 = 1) -> row slot * K1 + col. With `layer` (a static int) the array is
    the engine store's leaf [num_slots, K1, L, Hv, Dk, Dv] holding every GDN layer (state_store layout) and the
    row of (slot, col) is (slot * K1 + col) * L + layer: the kernels address the store in place, no gather."""
    if layer is not None:
        if state.ndim != 6:
            raise ValueError(f"layer= needs a [num_slots, K1, L, Hv, Dk, Dv] state, got shape {state.shape}")
        ns, k1, n_layers = state.shape[:3]
        if not 0 <= layer < n_layers:
            raise ValueError(f"layer {layer} out of range for {n_layers} layers")
        shape = state.shape
        return (state.reshape((ns * k1 * n_layers,) + shape[3:]), k1, n_layers, int(layer),
                lambda s: s.reshape(shape))
    if state.ndim == 4:
        return state, 1, 1, 0, (lambda s: s)
    ns, k1 = state.shape[:2]
    shape = state.shape
    return state.reshape((ns * k1,) + shape[2:]), k1, 1, 0, (lambda s: s.reshape(shape))


def slot_rows(slots, read_col, n, k1, stride=1, offset=0):
    """(slots int32, row of each slot's read column, row of its column 0) in a flat_state view; a row's column
    c lives at row0 + c * stride."""
    slots = slots.astype(jnp.int32)
    rc = jnp.zeros((n,), jnp.int32) if read_col is None else read_col.astype(jnp.int32)
    return slots, (slots * k1 + rc) * stride + offset, slots * k1 * stride + offset


def varlen_chunk_layout(cu_seqlens, total_tokens, chunk_size=CHUNK):
    """Chunk-aligned layout of packed sequences (each sequence starts on a chunk boundary).

    Returns a dict of int32 arrays: NC (static number of aligned chunks = cdiv(T, C) + N),
    chunk_seq [NC] (sequence of each aligned chunk, N for unused chunks), chunk_tok0 [NC] (packed index of
    its first token), chunk_len [NC] (valid tokens, 0 for unused), chunk_first / chunk_last [NC] bool,
    tok_pos [T] (aligned position of each packed token)."""
    C = chunk_size
    cu = cu_seqlens.astype(jnp.int32)
    N = cu.shape[0] - 1
    T = total_tokens
    NC = -(-T // C) + N
    lens = cu[1:] - cu[:-1]
    nch = (lens + C - 1) // C
    ch0 = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nch).astype(jnp.int32)])  # [N+1]
    c = jnp.arange(NC, dtype=jnp.int32)
    seq = (jnp.searchsorted(ch0[1:], c, side="right")).astype(jnp.int32)  # first n with ch0[n+1] > c
    seq_c = jnp.minimum(seq, N - 1)
    local = c - ch0[seq_c]
    valid = seq < N
    tok0 = cu[seq_c] + local * C
    clen = jnp.where(valid, jnp.clip(lens[seq_c] - local * C, 0, C), 0)
    first = valid & (local == 0)
    last = valid & (local == nch[seq_c] - 1)
    t = jnp.arange(T, dtype=jnp.int32)
    tseq = jnp.clip(jnp.searchsorted(cu, t, side="right").astype(jnp.int32) - 1, 0, N - 1)
    tok_pos = ch0[tseq] * C + (t - cu[tseq])
    return dict(NC=NC, chunk_seq=jnp.where(valid, seq, N), chunk_tok0=tok0, chunk_len=clen,
                chunk_first=first, chunk_last=last, tok_pos=tok_pos)
