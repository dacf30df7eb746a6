"""The sparse QSA Pallas kernels (interpret mode on CPU) equal their pure-JAX references, and the paged layer
run through the kernels equals the dense oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import qsa_sparse
from pallas_kernels import qsa_sparse_reference as ref


@pytest.mark.parametrize("t,n,block0", [(1, 37, 0), (5, 64, 16), (70, 130, 3)])
def test_indexer_scores_kernel_equals_reference(t, n, block0):
    ks = jax.random.split(jax.random.key(t), 3)
    q = jax.random.normal(ks[0], (2, t, 3, 16))
    keys = jax.random.normal(ks[1], (2, n, 16))
    n_complete = jax.random.randint(ks[2], (2, t), 0, block0 + n + 4)
    want = ref.indexer_scores(q, keys, n_complete, block0)
    got = qsa_sparse.indexer_scores(q, keys, n_complete, block0, impl="interpret")
    assert np.isneginf(np.asarray(want)).any() and np.isfinite(np.asarray(want)).any()
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(np.asarray(want))
    np.testing.assert_allclose(np.asarray(got)[finite], np.asarray(want)[finite], rtol=1e-5, atol=1e-5)


# decode, a few queries with G not a power of two, and block lists of several kernel steps (a partial last one);
# the key lists cut into splits (more splits than steps: some splits empty) and combined
@pytest.mark.parametrize("t,j,g,keys_per_step,kv_splits", [(1, 5, 2, 64, 1), (3, 9, 3, 64, 1), (2, 21, 3, 16, 1),
                                                           (1, 21, 3, 16, 4), (2, 21, 3, 16, 8), (3, 9, 3, 64, 2)])
def test_sparse_attention_kernel_equals_reference(t, j, g, keys_per_step, kv_splits):
    ratio, page, pages, kv, hd = 4, 8, 6, 2, 16
    ks = jax.random.split(jax.random.key(j), 6)
    k_pool = jax.random.normal(ks[0], (pages + 1, page, 2, kv, hd))
    v_pool = jax.random.normal(ks[1], (pages + 1, page, 2, kv, hd))
    k_pool = k_pool.at[pages].set(jnp.nan)  # the null page: read only where masked, must never reach an output
    v_pool = v_pool.at[pages].set(jnp.nan)
    q = jax.random.normal(ks[2], (2, t, kv, g, hd))
    blk_page = jax.random.randint(ks[3], (2, t, j), 0, pages + 1)
    blk_off = jax.random.randint(ks[4], (2, t, j), 0, page // ratio) * ratio
    blk_len = jax.random.randint(ks[5], (2, t, j), 0, ratio + 1)
    blk_len = jnp.where(blk_page == pages, 0, blk_len).at[1, 0].set(0)  # row 1's first query attends nothing
    want = ref.sparse_attention(q, k_pool, v_pool, 1, blk_page, blk_off, blk_len, ratio=ratio)
    got = qsa_sparse.sparse_attention_pallas(q, k_pool, v_pool, blk_page, blk_off, blk_len, layer=1, ratio=ratio,
                                             keys_per_step=keys_per_step, kv_splits=kv_splits, interpret=True)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got)[1, 0] == 0)


def test_split_attention_of_a_query_does_not_follow_the_step():
    """With the splits fixed, one query's output alone (a decode step) equals its output among other queries and
    rows (a prefill chunk beside another request), bit for bit: the batch-invariant path's contract."""
    ratio, page, pages, kv, g, hd, j = 4, 8, 6, 2, 3, 16, 21
    ks = jax.random.split(jax.random.key(5), 6)
    k_pool = jax.random.normal(ks[0], (pages + 1, page, 1, kv, hd), jnp.bfloat16)
    v_pool = jax.random.normal(ks[1], (pages + 1, page, 1, kv, hd), jnp.bfloat16)
    q = jax.random.normal(ks[2], (2, 7, kv, g, hd), jnp.bfloat16)
    blk_page = jax.random.randint(ks[3], (2, 7, j), 0, pages)
    blk_off = jax.random.randint(ks[4], (2, 7, j), 0, page // ratio) * ratio
    blk_len = jax.random.randint(ks[5], (2, 7, j), 0, ratio + 1)
    run = lambda *a: np.asarray(qsa_sparse.sparse_attention_pallas(  # noqa: E731
        *a[:1], k_pool, v_pool, *a[1:], layer=0, ratio=ratio, keys_per_step=16, kv_splits=4, interpret=True),
        np.float32)
    many = run(q, blk_page, blk_off, blk_len)
    alone = run(*(a[1:2, 4:5] for a in (q, blk_page, blk_off, blk_len)))
    np.testing.assert_array_equal(alone[0, 0], many[1, 4])


def test_paged_layer_through_kernels_equals_dense(monkeypatch):
    import test_qsa_paged as tp

    monkeypatch.setenv("FLASHNEXT_KERNELS", "interpret")
    jax.clear_caches()
    try:
        u = tp.u_of(1, 60, seed=9)
        got = tp.run_paged(u, [60], [27, 1, 5], 16, score_elements=27 * 8 * 8)
        assert tp.rel(got[0], tp.dense(u)[0]) <= 1e-5
    finally:
        monkeypatch.delenv("FLASHNEXT_KERNELS")
        jax.clear_caches()
