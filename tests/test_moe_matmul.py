"""Grouped MoE (routed experts over stacked int4 experts): Pallas kernels in interpret mode vs the pure-JAX
reference, odd routings included. Fresh random inputs each run (seed in every failure message)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import quant_layout as ql
from pallas_kernels.moe_matmul import (MoEConfig, _tile_routing, num_tiles_for, routed_experts,
                                       routed_experts_pallas, routed_experts_reference)

E, H, I = 8, 256, 128  # real H=2560, I=640 scaled down (H two int4 groups of 128, I one)


def fresh_rng():
    seed = int.from_bytes(os.urandom(4), "little")
    return np.random.default_rng(seed), seed


def experts(rng, bits=4, group=128):
    def one(k, n):
        q = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), size=(E, k, n)).astype(np.int8)
        s = (rng.uniform(0.5, 2.0, (E, k // group, n)) * np.where(rng.random((E, k // group, n)) < .5, -1, 1)
             * 0.05 / np.sqrt(k)).astype(np.float16)
        return jax.tree_util.tree_map(jnp.asarray, ql.pack(q, s, bits, group))
    return one(H, 2 * I), one(I, H)


def inputs(rng, m, k):
    x = jnp.asarray(rng.standard_normal((m, H)) + 0.1, jnp.bfloat16)
    wts = jnp.asarray(rng.uniform(0.1, 1.0, (m, k)), jnp.float32)
    return x, wts


def check(x, ids, wts, wgu, wd, seed, config=None):
    got = routed_experts_pallas(x, ids, wts, wgu, wd, config=config, interpret=True)
    ref = routed_experts_reference(x, ids, wts, wgu, wd)
    got, ref = np.asarray(got.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    assert got.shape == (x.shape[0], H)
    assert np.isfinite(got).all(), f"NaN / unwritten rows, seed={seed}"
    err = np.abs(got - ref).max() / (np.abs(ref).max() + 1e-6)
    assert err < 2e-2, f"max error {err:.2e}, ids={np.asarray(ids).tolist()}, seed={seed}"


@pytest.mark.parametrize("m,k", [(1, 4), (2, 3), (3, 2), (16, 2), (64, 2)])
def test_random_routing_matches_reference(m, k):
    rng, seed = fresh_rng()
    wgu, wd = experts(rng)
    x, wts = inputs(rng, m, k)
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(m)]), jnp.int32)
    check(x, ids, wts, wgu, wd, seed)


def test_repeated_expert_within_a_token():
    rng, seed = fresh_rng()
    wgu, wd = experts(rng)
    x, wts = inputs(rng, 3, 3)
    ids = jnp.asarray([[5, 5, 1], [2, 2, 2], [0, 5, 0]], jnp.int32)
    check(x, ids, wts, wgu, wd, seed)


def test_all_tokens_on_one_expert_spanning_several_tiles():
    rng, seed = fresh_rng()
    wgu, wd = experts(rng)
    x, wts = inputs(rng, 37, 1)  # 37 rows on expert 6: three tiles of 16
    ids = jnp.full((37, 1), 6, jnp.int32)
    check(x, ids, wts, wgu, wd, seed)


def test_unused_experts_and_last_expert():
    rng, seed = fresh_rng()
    wgu, wd = experts(rng)
    x, wts = inputs(rng, 4, 2)
    ids = jnp.asarray([[E - 1, 0], [0, E - 1], [E - 1, 0], [3, E - 1]], jnp.int32)  # experts 1,2,4,5,6 unused
    check(x, ids, wts, wgu, wd, seed, config=MoEConfig(bn_gate_up=32, bn_down=64))


def test_tile_routing_puts_each_pair_in_a_single_expert_tile():
    rng, _ = fresh_rng()
    m, k, bm = 9, 3, 4
    ids = jnp.asarray(rng.integers(0, 3, (m, k)), jnp.int32)
    n_tiles = num_tiles_for(m, k, 3, bm)
    src, tile_expert, pos = map(np.asarray, _tile_routing(ids, bm, n_tiles))
    pos_flat = pos.reshape(-1)
    assert len(set(pos_flat.tolist())) == m * k  # every pair its own row
    for p, e, tok in zip(pos_flat, np.asarray(ids).reshape(-1), np.repeat(np.arange(m), k)):
        assert tile_expert[p // bm] == e and src[p] == tok
    used = set((pos_flat // bm).tolist())
    assert all(tile_expert[t] == -1 for t in range(n_tiles) if t not in used)


def test_reference_accepts_plain_weights():
    rng, seed = fresh_rng()
    wgu, wd = experts(rng)
    x, wts = inputs(rng, 3, 2)
    ids = jnp.asarray(rng.integers(0, E, (3, 2)), jnp.int32)
    plain = routed_experts(x, ids, wts, ql.dequantize(wgu), ql.dequantize(wd), impl="interpret")
    quant = routed_experts(x, ids, wts, wgu, wd, impl="reference")
    np.testing.assert_array_equal(np.asarray(plain, np.float32), np.asarray(quant, np.float32),
                                  err_msg=f"seed={seed}")


def test_switch_runs_the_kernel_under_jit():
    rng, seed = fresh_rng()
    wgu, wd = experts(rng)
    x, wts = inputs(rng, 2, 2)
    ids = jnp.asarray([[1, 4], [4, 7]], jnp.int32)
    got = jax.jit(lambda *a: routed_experts(*a, impl="interpret"))(x, ids, wts, wgu, wd)
    ref = routed_experts_reference(x, ids, wts, wgu, wd)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=2e-2,
                               atol=2e-2 * float(jnp.abs(ref.astype(jnp.float32)).max()), err_msg=f"seed={seed}")


def test_clear_errors_for_shapes_the_kernels_cannot_take():
    rng, _ = fresh_rng()
    wgu, wd = experts(rng)
    x, wts = inputs(rng, 2, 2)
    ids = jnp.zeros((2, 2), jnp.int32)
    with pytest.raises(ValueError, match="w_down must be"):
        routed_experts_pallas(x, ids, wts, wgu, wgu, interpret=True)
    with pytest.raises(ValueError, match="expert_ids"):
        routed_experts_pallas(x, ids[:1], wts, wgu, wd, interpret=True)
    with pytest.raises(TypeError, match="QuantizedWeight"):
        routed_experts_pallas(x, ids, wts, ql.dequantize(wgu), wd, interpret=True)
    with pytest.raises(ValueError, match="stacked"):
        routed_experts_pallas(x, ids, wts, wgu[0], wd, interpret=True)


def test_interpret_mode_poisons_unwritten_outputs():
    """The premise of the finiteness checks: an output block the kernel never writes comes back NaN."""
    def kernel(o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = jnp.ones_like(o_ref)

    out = pl.pallas_call(kernel, grid=(2,), out_specs=pl.BlockSpec((8, 16), lambda i: (i, 0)),
                         out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32), interpret=True)()
    out = np.asarray(out)
    assert (out[:8] == 1).all() and np.isnan(out[8:]).all()
