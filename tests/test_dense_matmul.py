"""The batch-invariant dense bf16 matmul (pallas_kernels/dense_matmul.py) in interpret mode vs the pure-JAX
reference, and its row invariance: a row's bits must not depend on M. Fresh random inputs each run (the seed is in
every failure message)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dense_matmul as dm
from pallas_kernels.dense_matmul import dense_matmul, dense_matmul_reference


def fresh_rng():
    seed = int.from_bytes(os.urandom(4), "little")
    return np.random.default_rng(seed), seed


def random_operands(rng, m, n, k, dtype=jnp.bfloat16):
    x = jnp.asarray(rng.standard_normal((m, k)) + 0.1, dtype)  # never all zeros
    w = jnp.asarray(rng.standard_normal((n, k)) * k ** -0.5, dtype)
    return x, w


def assert_close(y, x, w, seed, rtol=1e-2):
    ref = np.asarray(dense_matmul_reference(x, w).astype(jnp.float32))
    got = np.asarray(y.astype(jnp.float32))
    assert y.dtype == x.dtype, seed
    assert got.shape == ref.shape, seed
    assert np.isfinite(got).all(), f"non-finite outputs, seed={seed}"
    err = np.abs(got - ref).max() / (np.abs(ref).max() + 1e-6)
    assert err < rtol, f"max error {err:.2e} of max |y|, seed={seed}"


@pytest.mark.parametrize("n,k", [(1, 512), (48, 512), (64, 512), (40, 96), (128, 512)])
def test_close_to_reference(n, k):
    rng, seed = fresh_rng()
    x, w = random_operands(rng, 40, n, k)
    for m in (1, 2, 3, 17, 40):
        assert_close(dense_matmul(x[:m], w, interpret=True), x[:m], w, f"{seed} m={m}")


def test_float16():
    rng, seed = fresh_rng()
    x, w = random_operands(rng, 3, 32, 128, jnp.float16)
    assert_close(dense_matmul(x, w, interpret=True), x, w, seed)


@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
def test_rows_are_bitwise_the_same_for_every_row_count(out_dtype):
    """Row i of an M = 40 call (BM 64) equals row i of the M = 1, 2, 3 (BM 16) and M = 17 (BM 64, other padding)
    calls bit for bit; N = 48 runs BN 16, K = 512 two K splits of 4 blocks, K = 2048 eight. The float32 result is the accumulator
    itself: a bf16 result would hide all but ~1 in 5000 changes of the addition order."""
    rng, seed = fresh_rng()
    for n, k in ((48, 512), (128, 512), (48, 2048)):  # 2, 2 and 8 K splits, their partials summed in a fixed tree
        x, w = random_operands(rng, 40, n, k)
        full = np.asarray(dense_matmul(x, w, interpret=True, out_dtype=out_dtype))
        assert full.dtype == (out_dtype or x.dtype), seed
        assert_close(jnp.asarray(full).astype(x.dtype), x, w, seed)
        for m in (1, 2, 3, 17):
            part = np.asarray(dense_matmul(x[:m], w, interpret=True, out_dtype=out_dtype))
            assert part.tobytes() == full[:m].tobytes(), f"n={n} m={m} seed={seed}"
        # the rows at the end of the batch too: a row's result does not depend on its neighbours
        tail = np.asarray(dense_matmul(x[37:], w, interpret=True, out_dtype=out_dtype))
        assert tail.tobytes() == full[37:].tobytes(), f"n={n} tail seed={seed}"


def test_fixed_configuration():
    """The K block and BN depend on K and N only; BM alone follows M."""
    assert [dm.block_k(k) for k in (16, 48, 96, 512, 2560, 2576)] == [16, 16, 32, 64, 64, 16]
    assert [dm.block_m(m) for m in (1, 16, 17, 40, 8192)] == [16, 16, 64, 64, 64]
    assert [dm.block_n(n) for n in (16, 32, 48, 64, 512, 4096)] == [16, 32, 16, 64, 64, 64]
    # K splits: more for fewer column tiles, at least 4 blocks of 64 each, never a function of M
    assert [dm.k_splits(2560, n) for n in (48, 512, 4096, 248320)] == [8, 8, 2, 1]
    assert [dm.k_splits(k, 48) for k in (96, 512, 1024)] == [1, 2, 4]


def test_rejects_bad_shapes():
    x = jnp.ones((2, 40), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        dense_matmul(x, jnp.ones((16, 40), jnp.bfloat16), interpret=True)
    x = jnp.ones((2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="K=64 but w"):
        dense_matmul(x, jnp.ones((16, 48), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="both bfloat16 or both float16"):
        dense_matmul(x, jnp.ones((16, 64), jnp.float16), interpret=True)
    with pytest.raises(ValueError, match="both bfloat16 or both float16"):
        dense_matmul(x.astype(jnp.float32), jnp.ones((16, 64), jnp.float32), interpret=True)
