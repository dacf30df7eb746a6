"""Pallas (Triton backend) kernels for sparse QSA over the paged store, and their entry points behind the switch.

* `indexer_scores`: one tile of block scores, grid (B, T / TQ, N / TN); each program multiplies a [TQ, dI] query
  head by the [TN, dI] block keys per indexer head and sums the relus. The caller merges tiles into a running
  top-k (flashnext_jax/qsa_paged.py), so no [T, L / ratio] array ever exists.
* `sparse_attention`: grid (B, T, kv heads); each program walks the query's J selected blocks (fori_loop),
  loads `ratio` rows of K and V straight from the page pools at (page, offset, layer, head) and keeps an online
  softmax for the query's G (padded to a power of two) heads. Nothing is gathered into a per-row copy.

References with the same contracts: qsa_sparse_reference.py. `impl` (or FLASHNEXT_KERNELS) picks one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import qsa_sparse_reference as ref
from pallas_kernels.quant_layout import resolve_impl


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


def _pad_to(a, axis: int, size: int, value=0):
    pad = size - a.shape[axis]
    if not pad:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, pad)
    return jnp.pad(a, widths, constant_values=value)


# ------------------------------------------------------------------------------------------ indexer scoring


def _scores_kernel(q_ref, k_ref, nc_ref, o_ref, *, n_heads, tn):
    j = pl.program_id(2)
    keys = k_ref[0].astype(jnp.float32)  # [TN, dI]
    acc = None
    for h in range(n_heads):
        s = jnp.dot(q_ref[0, :, h, :].astype(jnp.float32), keys.T, preferred_element_type=jnp.float32)
        acc = jnp.maximum(s, 0.0) if acc is None else acc + jnp.maximum(s, 0.0)
    acc = acc / jnp.sqrt(jnp.float32(keys.shape[-1]))
    blocks = j * tn + jnp.arange(tn)  # block numbers relative to the tile's first block
    o_ref[0] = jnp.where(blocks[None, :] < nc_ref[0][:, None], acc, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("interpret",))
def indexer_scores_pallas(q_index, keys, n_complete, block0=0, interpret: bool = False):
    """Same contract as qsa_sparse_reference.indexer_scores."""
    b, t, ni, di = q_index.shape
    n = keys.shape[1]
    tq = min(64, _pow2_at_least(t, 16))
    tn = min(64, _pow2_at_least(n, 16))
    tp, np_ = -(-t // tq) * tq, -(-n // tn) * tn
    q = _pad_to(q_index, 1, tp)
    k = _pad_to(keys, 1, np_)
    nc = _pad_to((n_complete - block0).astype(jnp.int32), 1, tp)  # complete blocks counted from the tile
    out = pl.pallas_call(
        functools.partial(_scores_kernel, n_heads=ni, tn=tn),
        grid=(b, tp // tq, np_ // tn),
        in_specs=[pl.BlockSpec((1, tq, ni, di), lambda i, a, c: (i, a, 0, 0)),
                  pl.BlockSpec((1, tn, di), lambda i, a, c: (i, c, 0)),
                  pl.BlockSpec((1, tq), lambda i, a, c: (i, a))],
        out_specs=pl.BlockSpec((1, tq, tn), lambda i, a, c: (i, a, c)),
        out_shape=jax.ShapeDtypeStruct((b, tp, np_), jnp.float32),
        interpret=interpret,
    )(q, k, nc)
    return out[:, :t, :n]


# ------------------------------------------------------------------------------------ gathered attention


def _attention_kernel(q_ref, page_ref, off_ref, len_ref, k_ref, v_ref, o_ref, *, layer, ratio, n_blocks, scale):
    h = pl.program_id(2)
    q = q_ref[0, 0, 0].astype(jnp.float32)  # [Gp, hd]
    gp, hd = q.shape

    def body(j, carry):
        m, l, acc = carry
        page, off, n = page_ref[0, 0, j], off_ref[0, 0, j], len_ref[0, 0, j]
        on = jnp.arange(ratio) < n  # [ratio]
        k = k_ref[page, pl.ds(off, ratio), layer, h, :].astype(jnp.float32)  # [ratio, hd]
        v = v_ref[page, pl.ds(off, ratio), layer, h, :].astype(jnp.float32)
        k = jnp.where(on[:, None], k, 0.0)
        v = jnp.where(on[:, None], v, 0.0)
        s = jnp.sum(q[:, None, :] * k[None, :, :], axis=-1) * scale  # [Gp, ratio]
        s = jnp.where(on[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.where(on[None, :], jnp.exp(s - safe[:, None]), 0.0)
        corr = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - safe))
        l = l * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[:, None] + jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
        return m_new, l, acc

    init = (jnp.full((gp,), -jnp.inf, jnp.float32), jnp.zeros((gp,), jnp.float32), jnp.zeros((gp, hd), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    out = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
    o_ref[0, 0, 0] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("layer", "ratio", "interpret"))
def sparse_attention_pallas(q, k_pool, v_pool, blk_page, blk_off, blk_len, *, layer: int, ratio: int,
                            interpret: bool = False):
    """Same contract as qsa_sparse_reference.sparse_attention (the pools are read in place, never copied)."""
    b, t, kv, g, hd = q.shape
    gp = _pow2_at_least(g)
    qp = _pad_to(q, 3, gp)
    j = blk_page.shape[-1]
    pool_spec = pl.BlockSpec(k_pool.shape, lambda i, a, c: (0,) * k_pool.ndim)
    table_spec = pl.BlockSpec((1, 1, j), lambda i, a, c: (i, a, 0))
    out = pl.pallas_call(
        functools.partial(_attention_kernel, layer=layer, ratio=ratio, n_blocks=j, scale=hd**-0.5),
        grid=(b, t, kv),
        in_specs=[pl.BlockSpec((1, 1, 1, gp, hd), lambda i, a, c: (i, a, c, 0, 0)), table_spec, table_spec,
                  table_spec, pool_spec, pool_spec],
        out_specs=pl.BlockSpec((1, 1, 1, gp, hd), lambda i, a, c: (i, a, c, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        interpret=interpret,
    )(qp, blk_page.astype(jnp.int32), blk_off.astype(jnp.int32), blk_len.astype(jnp.int32), k_pool, v_pool)
    return out[:, :, :, :g]


# ------------------------------------------------------------------------------------------- entry points


def indexer_scores(q_index, keys, n_complete, block0=0, *, impl: str | None = None):
    """Kernel or reference per the switch (qsa_sparse_reference.indexer_scores has the contract)."""
    mode = resolve_impl(impl)
    if mode == "reference":
        return ref.indexer_scores(q_index, keys, n_complete, block0)
    return indexer_scores_pallas(q_index, keys, n_complete, block0, interpret=mode == "interpret")


def sparse_attention(q, k_pool, v_pool, layer: int, blk_page, blk_off, blk_len, *, ratio: int,
                     impl: str | None = None, query_tile: int = 128):
    """Kernel or reference per the switch (qsa_sparse_reference.sparse_attention has the contract). Unlike the
    other kernels, 'auto' means the reference here on a GPU too: on the H200 the kernel took 1.51 ms per layer for a
    decode query against the reference's 0.13 ms and 114 ms against 46 ms for an 8,192-token chunk
    (bench/results/qsa_kernels.json: one program per query walks 513 blocks of 4 keys, latency bound).
    'pallas' (argument or FLASHNEXT_KERNELS) still runs the kernel."""
    mode = resolve_impl(impl, gpu_auto="reference")
    if mode == "reference":
        return ref.sparse_attention(q, k_pool, v_pool, layer, blk_page, blk_off, blk_len, ratio=ratio,
                                    query_tile=query_tile)
    return sparse_attention_pallas(q, k_pool, v_pool, blk_page, blk_off, blk_len, layer=layer, ratio=ratio,
                                   interpret=mode == "interpret")


__all__ = ["indexer_scores", "sparse_attention", "indexer_scores_pallas", "sparse_attention_pallas"]
