"""Pallas (Triton backend) kernels for sparse QSA over the paged store, and their entry points behind the switch.

* `indexer_scores`: one tile of block scores, grid (B, T / TQ, N / TN); each program multiplies a [TQ, dI] query
  head by the [TN, dI] block keys per indexer head and sums the relus. The caller merges tiles into a running
  top-k (flashnext_jax/qsa_paged.py), so no [T, L / ratio] array ever exists.
* `sparse_attention`: grid (B, T, kv heads); each program walks the query's selected blocks and tail as one flat
  list of keys (`key_rows`), 64 keys per step: one gathered [64, hd] load of K and of V straight from the page
  pools at (page, row, layer, head), two tensor-core dots for the query's G heads (padded to 16) and an online
  softmax. Nothing is gathered into a per-row or per-tile copy.

References with the same contracts: qsa_sparse_reference.py. `impl` (or FLASHNEXT_KERNELS) picks one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import fixed_order
from pallas_kernels import qsa_sparse_reference as ref
from pallas_kernels.kernel_switch import resolve_impl


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


def key_rows(blk_page, blk_off, blk_len, *, ratio: int, keys_per_step: int):
    """Per key of every query's block list: (page [B, T, S], row in the page [B, T, S], -1 where the key is not
    attended), S = J * ratio padded to a multiple of keys_per_step. The kernel walks these flat lists."""
    b, t, j = blk_page.shape
    r = jnp.arange(ratio)
    on = r < blk_len[..., None]
    page = jnp.broadcast_to(blk_page[..., None], (b, t, j, ratio)).reshape(b, t, j * ratio)
    row = jnp.where(on, blk_off[..., None] + r, -1).reshape(b, t, j * ratio)
    s = -(-(j * ratio) // keys_per_step) * keys_per_step
    return _pad_to(page.astype(jnp.int32), 2, s), _pad_to(row.astype(jnp.int32), 2, s, value=-1)


def _online_softmax(q, page_ref, row_ref, k_ref, v_ref, h, first, last, *, layer, keys_per_step, scale):
    """Steps first .. last - 1 of one (row, query, kv head)'s key list: an online softmax, each step one gathered
    [S, hd] load of K and of V from the pools and two tensor-core dots for the query's heads. Returns the running
    (max [Gp], sum [Gp], unnormalised output [Gp, hd]) in fp32."""
    gp, hd = q.shape

    def body(i, carry):
        m, l, acc = carry
        span = pl.ds(i * keys_per_step, keys_per_step)
        page, row = page_ref[0, 0, span], row_ref[0, 0, span]  # [S]
        on = row >= 0
        row = jnp.maximum(row, 0)
        k = jnp.where(on[:, None], k_ref[page, row, layer, h, :], 0).astype(q.dtype)  # [S, hd]; poisoned rows
        v = jnp.where(on[:, None], v_ref[page, row, layer, h, :], 0).astype(q.dtype)  # never reach a sum
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale  # [Gp, S]
        s = jnp.where(on[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.where(on[None, :], jnp.exp(s - safe[:, None]), 0.0)
        corr = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - safe))
        l = l * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((gp,), -jnp.inf, jnp.float32), jnp.zeros((gp,), jnp.float32), jnp.zeros((gp, hd), jnp.float32))
    return jax.lax.fori_loop(first, last, body, init)


def _attention_kernel(q_ref, page_ref, row_ref, k_ref, v_ref, o_ref, *, layer, keys_per_step, n_steps, scale):
    """One (row, query, kv head) over its whole key list, normalised in place."""
    _, l, acc = _online_softmax(q_ref[0, 0, 0], page_ref, row_ref, k_ref, v_ref, pl.program_id(2), 0, n_steps,
                                layer=layer, keys_per_step=keys_per_step, scale=scale)
    out = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
    o_ref[0, 0, 0] = out.astype(o_ref.dtype)


def _split_kernel(q_ref, page_ref, row_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, layer, keys_per_step, n_steps,
                  steps_per_split, scale):
    """One (row, query, kv head, split): the split's steps of the key list, left unnormalised for the combine."""
    first = pl.program_id(3) * steps_per_split
    m, l, acc = _online_softmax(q_ref[0, 0, 0], page_ref, row_ref, k_ref, v_ref, pl.program_id(2), first,
                                jnp.minimum(first + steps_per_split, n_steps), layer=layer,
                                keys_per_step=keys_per_step, scale=scale)
    acc_ref[0, 0, 0, 0], m_ref[0, 0, 0, 0], l_ref[0, 0, 0, 0] = acc, m, l


def _combine_kernel(acc_ref, m_ref, l_ref, o_ref, *, n_splits):
    """One (row, query, kv head): the splits' partial softmaxes rescaled to their common max and added in split
    order (a fixed order, whatever the step's shape)."""
    # each split read from the refs (Triton has no slice of a loaded value)
    top = functools.reduce(jnp.maximum, [m_ref[0, 0, 0, i] for i in range(n_splits)])  # [Gp]
    safe = jnp.where(top == -jnp.inf, 0.0, top)
    l, acc = None, None
    for i in range(n_splits):
        m = m_ref[0, 0, 0, i]
        w = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - safe))  # [Gp]
        li, ai = w * l_ref[0, 0, 0, i], w[:, None] * acc_ref[0, 0, 0, i]
        l, acc = (li, ai) if l is None else (l + li, acc + ai)
    out = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
    o_ref[0, 0, 0] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("layer", "ratio", "keys_per_step", "kv_splits", "interpret"))
def sparse_attention_pallas(q, k_pool, v_pool, blk_page, blk_off, blk_len, *, layer: int, ratio: int,
                            keys_per_step: int = 64, kv_splits: int = 1, interpret: bool = False):
    """Same contract as qsa_sparse_reference.sparse_attention (the pools are read in place, never copied). The
    query heads of a kv head are padded to at least 16 (the smallest tensor-core tile).

    kv_splits > 1 cuts every query's key list into that many runs of whole steps, one program each, and a second
    kernel combines them (flash-decoding): a decode step has only B x kv-heads programs otherwise, each walking
    ~33 steps in a row. The split depends on the key-list length alone (J x ratio, fixed by the config), so a
    query's sums are formed the same way in a one-token step and inside a prefill chunk."""
    b, t, kv, g, hd = q.shape
    gp = _pow2_at_least(g, 16)
    qp = _pad_to(q, 3, gp)
    page, row = key_rows(blk_page, blk_off, blk_len, ratio=ratio, keys_per_step=keys_per_step)
    s = page.shape[-1]
    n_steps = s // keys_per_step
    pool_spec = pl.BlockSpec(k_pool.shape, lambda i, a, c, *_: (0,) * k_pool.ndim)
    table_spec = pl.BlockSpec((1, 1, s), lambda i, a, c, *_: (i, a, 0))
    q_spec = pl.BlockSpec((1, 1, 1, gp, hd), lambda i, a, c, *_: (i, a, c, 0, 0))
    if kv_splits == 1:
        out = pl.pallas_call(
            functools.partial(_attention_kernel, layer=layer, keys_per_step=keys_per_step, n_steps=n_steps,
                              scale=hd**-0.5),
            grid=(b, t, kv),
            in_specs=[q_spec, table_spec, table_spec, pool_spec, pool_spec],
            out_specs=q_spec,
            out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
            interpret=interpret,
        )(qp, page, row, k_pool, v_pool)
        return out[:, :, :, :g]
    splits = kv_splits
    acc_spec = pl.BlockSpec((1, 1, 1, 1, gp, hd), lambda i, a, c, d: (i, a, c, d, 0, 0))
    ml_spec = pl.BlockSpec((1, 1, 1, 1, gp), lambda i, a, c, d: (i, a, c, d, 0))
    acc, m, l = pl.pallas_call(
        functools.partial(_split_kernel, layer=layer, keys_per_step=keys_per_step, n_steps=n_steps,
                          steps_per_split=-(-n_steps // splits), scale=hd**-0.5),
        grid=(b, t, kv, splits),
        in_specs=[q_spec, table_spec, table_spec, pool_spec, pool_spec],
        out_specs=[acc_spec, ml_spec, ml_spec],
        out_shape=[jax.ShapeDtypeStruct((b, t, kv, splits, gp, hd), jnp.float32),
                   jax.ShapeDtypeStruct((b, t, kv, splits, gp), jnp.float32),
                   jax.ShapeDtypeStruct((b, t, kv, splits, gp), jnp.float32)],
        interpret=interpret,
    )(qp, page, row, k_pool, v_pool)
    part_spec = lambda *tail: pl.BlockSpec((1, 1, 1, splits) + tail, lambda i, a, c: (i, a, c, 0) + (0,) * len(tail))
    out = pl.pallas_call(
        functools.partial(_combine_kernel, n_splits=splits),
        grid=(b, t, kv),
        in_specs=[part_spec(gp, hd), part_spec(gp), part_spec(gp)],
        out_specs=pl.BlockSpec((1, 1, 1, gp, hd), lambda i, a, c: (i, a, c, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        interpret=interpret,
    )(acc, m, l)
    return out[:, :, :, :g]


# ------------------------------------------------------------------------------------------- entry points


def indexer_scores(q_index, keys, n_complete, block0=0, *, impl: str | None = None):
    """Kernel or reference per the switch (qsa_sparse_reference.indexer_scores has the contract)."""
    mode = resolve_impl(impl)
    if mode == "reference":
        return ref.indexer_scores(q_index, keys, n_complete, block0)
    return indexer_scores_pallas(q_index, keys, n_complete, block0, interpret=mode == "interpret")


# query counts from which 'auto' runs the attention kernel on a GPU (bench/results/qsa_kernels.json, H200, 8,192
# queries: kernel 7.6 ms against the reference's 46.5; one decode query: 0.27 ms against 0.13)
KERNEL_MIN_QUERIES = 64

# splits of every query's key list in batch-invariant traces: a fixed number, so a decode query is summed the same
# way alone and inside a prefill chunk, and enough programs that a one-token step does not walk 33 steps in a row
INVARIANT_KV_SPLITS = 8


def sparse_attention(q, k_pool, v_pool, layer: int, blk_page, blk_off, blk_len, *, ratio: int,
                     impl: str | None = None, query_tile: int = 128):
    """Kernel or reference per the switch (qsa_sparse_reference.sparse_attention has the contract). 'auto' on a GPU
    runs the kernel for a step of at least KERNEL_MIN_QUERIES queries in a 16-bit dtype (prefill chunks: no
    [tile, keys] gather is materialised) and the reference for decode-sized steps (a handful of programs walking
    2,052 keys each is latency bound, where the reference's one gather spreads over the whole GPU) and for float32
    (the kernel's dots would round through TF32); batch-invariant traces (fixed_order.enabled()) run the kernel
    for every 16-bit step."""
    b, t = q.shape[:2]
    # batch-invariant traces: the kernel for every step shape, a decode step's queries too (its online softmax and
    # the reference's XLA softmax and dots round differently, and which one ran followed the step's query count)
    many = b * t >= KERNEL_MIN_QUERIES or fixed_order.enabled()
    kernel_fits = many and jnp.dtype(q.dtype).itemsize == 2
    mode = resolve_impl(impl, gpu_auto="pallas" if kernel_fits else "reference")
    if mode == "reference":
        return ref.sparse_attention(q, k_pool, v_pool, layer, blk_page, blk_off, blk_len, ratio=ratio,
                                    query_tile=query_tile)
    return sparse_attention_pallas(q, k_pool, v_pool, blk_page, blk_off, blk_len, layer=layer, ratio=ratio,
                                   kv_splits=INVARIANT_KV_SPLITS if fixed_order.enabled() else 1,
                                   interpret=mode == "interpret")


__all__ = ["indexer_scores", "sparse_attention", "indexer_scores_pallas", "sparse_attention_pallas"]
