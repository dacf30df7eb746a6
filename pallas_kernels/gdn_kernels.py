"""Gated delta rule entry points behind the kernel switch: each runs the Pallas kernel (gdn_prefill, gdn_decode)
or the pure-JAX reference of the same name (gdn_reference), as `impl` or FLASHNEXT_KERNELS says (kernel_switch).

The model calls these; the contracts (shapes, state layout of gdn_layout, padding rules) are the reference's.
"""

from __future__ import annotations

from pallas_kernels import gdn_decode, gdn_prefill, gdn_reference
from pallas_kernels.gdn_layout import CHUNK
from pallas_kernels.kernel_switch import resolve_impl

__all__ = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_varlen", "recurrent_gated_delta_rule_slots"]


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state=None, output_final_state=True,
                           use_qk_l2norm=False, impl=None, chunk_size=CHUNK):
    """Chunked gated delta rule for a batch of equal-length (or right-padded) sequences: the prefill kernel or
    gdn_reference.chunk_gated_delta_rule (its contract; `chunk_size` is the reference's)."""
    mode = resolve_impl(impl)
    if mode != "reference":
        return gdn_prefill.chunk_gated_delta_rule_pallas(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                                         output_final_state=output_final_state,
                                                         use_qk_l2norm=use_qk_l2norm, interpret=(mode == "interpret"))
    return gdn_reference.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                                output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
                                                chunk_size=chunk_size)


def chunk_gated_delta_rule_varlen(q, k, v, g, beta, *, cu_seqlens, state, slots, scale, read_col=None,
                                  has_initial_state=None, use_qk_l2norm=False, impl=None, chunk_size=CHUNK,
                                  layer=None):
    """Varlen chunked prefill with slot-indexed states: the prefill kernel or
    gdn_reference.chunk_gated_delta_rule_varlen (its contract). The Pallas path updates the state in place."""
    mode = resolve_impl(impl)
    if mode != "reference":
        return gdn_prefill.chunk_gated_delta_rule_varlen_pallas(
            q, k, v, g, beta, cu_seqlens=cu_seqlens, state=state, slots=slots, scale=scale, read_col=read_col,
            has_initial_state=has_initial_state, use_qk_l2norm=use_qk_l2norm, interpret=(mode == "interpret"),
            layer=layer)
    return gdn_reference.chunk_gated_delta_rule_varlen(
        q, k, v, g, beta, cu_seqlens=cu_seqlens, state=state, slots=slots, scale=scale, read_col=read_col,
        has_initial_state=has_initial_state, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, layer=layer)


def recurrent_gated_delta_rule_slots(q, k, v, g, beta, *, state, slots, scale, read_col=None,
                                     use_qk_l2norm=False, impl=None, layer=None, write_cols=None, block_v=None,
                                     num_warps=None, lengths=None):
    """Decode / MTP verify of T tokens per row with checkpointed slot states: the decode kernel or
    gdn_reference.recurrent_gated_delta_rule_slots (its contract).
    block_v / num_warps / lengths: the kernel's layout and per-row token counts (recurrent_gated_delta_rule_slots_
    pallas; tokens past lengths[b] must then be identities, g = beta = 0, and their outputs are unspecified); the
    reference ignores them."""
    mode = resolve_impl(impl)
    if mode != "reference":
        return gdn_decode.recurrent_gated_delta_rule_slots_pallas(
            q, k, v, g, beta, state=state, slots=slots, scale=scale, read_col=read_col,
            use_qk_l2norm=use_qk_l2norm, interpret=(mode == "interpret"), layer=layer, write_cols=write_cols,
            block_v=block_v, num_warps=num_warps, lengths=lengths)
    return gdn_reference.recurrent_gated_delta_rule_slots(
        q, k, v, g, beta, state=state, slots=slots, scale=scale, read_col=read_col, use_qk_l2norm=use_qk_l2norm,
        layer=layer, write_cols=write_cols)
