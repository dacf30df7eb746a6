"""Quantized weight layout, the kernel switch, and the W{4,6,8}A16 dense Pallas kernel (interpret mode) vs the
pure-JAX reference. Fresh random inputs each run (the seed is in every failure message); never zeros."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import quant_layout as ql
from pallas_kernels.kernel_switch import resolve_impl, use_pallas
from pallas_kernels.quant_matmul import (DenseConfig, check_kernel_shape, default_config, quant_matmul,
                                         quant_matmul_pallas, quant_matmul_reference)

FORMATS = [(4, 128), (6, 64), (8, 64), (8, 128)]


def fresh_rng():
    seed = int.from_bytes(os.urandom(4), "little")
    return np.random.default_rng(seed), seed


def random_q(rng, shape, bits):
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    q = rng.integers(lo, hi, size=shape).astype(np.int8)
    q.reshape(-1)[:2] = [lo, hi - 1]  # both extremes always present
    return q


def random_scales(rng, shape, dtype=np.float16):
    mag = rng.uniform(0.5, 2.0, size=shape) * 0.02
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)  # signed scales, about half negative
    return (mag * sign).astype(dtype)


def random_weight(rng, k, n, bits, group, lead=(), dtype=np.float16):
    q = random_q(rng, (*lead, k, n), bits)
    s = random_scales(rng, (*lead, k // group, n), dtype)
    return q, s, jax.tree_util.tree_map(jnp.asarray, ql.pack(q, s, bits, group))


def random_x(rng, m, k, dtype=jnp.bfloat16):
    x = rng.standard_normal((m, k)) + 0.1  # never all zeros
    return jnp.asarray(x, dtype)


def assert_close_to_reference(y, x, w, seed, rtol=2e-2):
    ref = np.asarray(quant_matmul_reference(x, w).astype(jnp.float32))
    got = np.asarray(y.astype(jnp.float32))
    assert got.shape == ref.shape, seed
    assert np.isfinite(got).all(), f"unwritten (NaN) or non-finite outputs, seed={seed}"
    scale = np.abs(ref).max() + 1e-6
    err = np.abs(got - ref).max() / scale
    assert err < rtol, f"max error {err:.2e} of max |y|, seed={seed}"


# ------------------------------------------------------------------------------------------------ layout

@pytest.mark.parametrize("bits,group", FORMATS + [(4, 32), (6, 128)])
def test_pack_unpack_roundtrip_is_exact(bits, group):
    rng, seed = fresh_rng()
    q, s, w = random_weight(rng, 2 * group, 48, bits, group, lead=(3,))
    assert w.shape == (3, 2 * group, 48)
    np.testing.assert_array_equal(ql.unpack_ints(w), q, err_msg=f"seed={seed}")
    np.testing.assert_array_equal(np.asarray(ql.dequantize_ints(w)), q.astype(np.int32), err_msg=f"seed={seed}")


@pytest.mark.parametrize("bits,group", FORMATS)
def test_dequantize_is_q_times_signed_group_scale(bits, group):
    rng, seed = fresh_rng()
    q, s, w = random_weight(rng, 3 * group, 32, bits, group)
    want = q.astype(np.float32) * np.repeat(s.astype(np.float32), group, axis=0)
    np.testing.assert_array_equal(np.asarray(ql.dequantize(w)), want, err_msg=f"seed={seed}")
    assert (s < 0).any() and (s > 0).any()


def test_int4_byte_layout_pairs_half_groups():
    q = np.zeros((128, 16), np.int8)
    q[0, 0], q[64, 0], q[63, 1], q[127, 1] = 3, -2, -8, 7
    w = ql.pack(q, np.ones((1, 16), np.float32), 4, 128)
    p = np.asarray(w.planes[0])
    assert p.shape == (64, 16) and p.dtype == np.uint8
    assert p[0, 0] == 0x03 | (0xE << 4)  # low nibble row 0, high nibble row G/2, two's complement
    assert p[63, 1] == 0x8 | (0x7 << 4)


def test_int6_is_a_4bit_plus_2bit_plane_at_six_bits_per_weight():
    rng, _ = fresh_rng()
    q, s, w = random_weight(rng, 256, 64, 6, 64)
    p4, p2 = w.planes
    assert p4.shape == (128, 64) and p2.shape == (64, 64)
    assert p4.dtype == p2.dtype == jnp.uint8
    assert (p4.size + p2.size) * 8 == 6 * q.size


def test_int8_plane_is_the_integers():
    rng, _ = fresh_rng()
    q, s, w = random_weight(rng, 128, 32, 8, 64)
    np.testing.assert_array_equal(np.asarray(w.planes[0]), q)


def test_pack_rejects_bad_inputs():
    rng, _ = fresh_rng()
    with pytest.raises(ValueError, match="lie in"):
        ql.pack(np.full((128, 16), 8, np.int8), np.ones((1, 16), np.float32), 4, 128)
    with pytest.raises(ValueError, match="multiple of group_size"):
        ql.pack(np.zeros((100, 16), np.int8), np.ones((1, 16), np.float32), 4, 128)
    with pytest.raises(ValueError, match="scales must have shape"):
        ql.pack(np.zeros((128, 16), np.int8), np.ones((2, 16), np.float32), 4, 128)
    with pytest.raises(ValueError, match="bits must be"):
        ql.pack(np.zeros((128, 16), np.int8), np.ones((1, 16), np.float32), 5, 128)
    with pytest.raises(ValueError, match="multiple of 4"):
        ql.pack(np.zeros((6, 16), np.int8), np.ones((1, 16), np.float32), 6, 6)


def test_quantized_weight_is_a_pytree_with_static_metadata():
    rng, _ = fresh_rng()
    _, _, w = random_weight(rng, 128, 32, 6, 64, lead=(2,))
    leaves, tree = jax.tree_util.tree_flatten(w)
    assert len(leaves) == 3  # two planes + scales
    w2 = jax.tree_util.tree_unflatten(tree, leaves)
    assert (w2.bits, w2.group_size, w2.k, w2.n) == (6, 64, 128, 32)
    assert w[1].shape == (128, 32)
    out = jax.jit(ql.dequantize)(w)
    assert out.shape == (2, 128, 32) and out.dtype == jnp.float32


def test_dequantize_columns_gathers_columns():
    rng, seed = fresh_rng()
    q, s, w = random_weight(rng, 128, 48, 8, 64)
    cols = jnp.asarray([[3, 0], [47, 3]])
    got = np.asarray(ql.dequantize_columns(w, cols))
    full = np.asarray(ql.dequantize(w))
    np.testing.assert_array_equal(got, full.T[np.asarray(cols)], err_msg=f"seed={seed}")


def test_quantize_rtn_signs_follow_the_larger_extreme():
    rng, _ = fresh_rng()
    w = rng.standard_normal((256, 32)).astype(np.float32)
    qw = ql.quantize_rtn(w, 4, 128)
    err = np.abs(np.asarray(ql.dequantize(qw)) - w).max()
    assert err <= np.abs(np.asarray(qw.scales)).max() + 1e-6  # the far extreme may clip by one step
    assert (np.asarray(qw.scales) < 0).any()


# ------------------------------------------------------------------------------------------------ switch

def test_switch_defaults_to_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("FLASHNEXT_KERNELS", raising=False)
    assert resolve_impl(None) == "reference" and not use_pallas(None)


def test_switch_env_var_and_argument(monkeypatch):
    monkeypatch.setenv("FLASHNEXT_KERNELS", "interpret")
    assert resolve_impl(None) == "interpret" and use_pallas(None)
    assert resolve_impl("reference") == "reference"  # the argument wins
    monkeypatch.setenv("FLASHNEXT_KERNELS", "bogus")
    with pytest.raises(ValueError, match="FLASHNEXT_KERNELS"):
        resolve_impl(None)


def test_plain_array_takes_the_reference_path():
    rng, _ = fresh_rng()
    x = random_x(rng, 3, 64)
    w = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    y = quant_matmul(x, w, impl="interpret")
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(quant_matmul_reference(x, w), np.float32))


# ------------------------------------------------------------------------------------------------ kernel

@pytest.mark.parametrize("bits,group", FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 16, 64, 512])
def test_kernel_matches_reference(bits, group, m):
    """Real K/N structure scaled down: K spans several groups, N several column tiles."""
    rng, seed = fresh_rng()
    k = 3 * group if m < 512 else 2 * group
    n = 96 if m < 512 else 64
    _, _, w = random_weight(rng, k, n, bits, group, dtype=np.float16 if bits != 8 else jnp.bfloat16)
    x = random_x(rng, m, k)
    y = quant_matmul_pallas(x, w, interpret=True)
    assert y.dtype == x.dtype and y.shape == (m, n)
    assert_close_to_reference(y, x, w, seed)


@pytest.mark.parametrize("cfg", [
    DenseConfig(bm=16, bn=32, splits=3, groups_per_iter=1),
    DenseConfig(bm=16, bn=16, splits=1, groups_per_iter=3),
    DenseConfig(bm=32, bn=64, splits=1, groups_per_iter=1),
])
def test_kernel_tilings_write_every_output(cfg):
    rng, seed = fresh_rng()
    _, _, w = random_weight(rng, 192, 64, 6, 64)
    x = random_x(rng, 5, 192)
    assert_close_to_reference(quant_matmul_pallas(x, w, config=cfg, interpret=True), x, w, seed)


def test_kernel_float32_activations_use_exact_dequantization():
    rng, seed = fresh_rng()
    _, _, w = random_weight(rng, 256, 32, 4, 128)
    x = random_x(rng, 2, 256, jnp.float32)
    y = quant_matmul_pallas(x, w, interpret=True)
    assert y.dtype == jnp.float32
    assert_close_to_reference(y, x, w, seed, rtol=1e-4)


def test_dispatch_uses_dequant_dot_above_decode_sizes_and_stays_close():
    rng, seed = fresh_rng()
    _, _, w = random_weight(rng, 128, 32, 4, 128)
    x = random_x(rng, 40, 128)
    assert_close_to_reference(quant_matmul(x, w, impl="interpret"), x, w, seed)
    with pytest.raises(ValueError, match="path"):
        quant_matmul(x, w, impl="interpret", path="nope")


def test_kernel_under_jit_with_weight_as_argument():
    rng, seed = fresh_rng()
    _, _, w = random_weight(rng, 128, 32, 8, 64)
    x = random_x(rng, 2, 128)
    y = jax.jit(lambda x, w: quant_matmul(x, w, impl="interpret"))(x, w)
    assert_close_to_reference(y, x, w, seed)


def test_default_configs_tile_the_real_shapes():
    for k, n, bits, g in [(2560, 10240, 6, 64), (6144, 2560, 6, 64), (2560, 248320, 8, 128),
                          (10240, 320, 8, 64), (320, 10240, 8, 64), (2560, 1280, 4, 128)]:
        for m in (1, 2, 4, 16, 64, 512):
            cfg = default_config(m, k, n, bits, g)
            assert n % cfg.bn == 0 and (k // g) % cfg.splits == 0
            assert ((k // g) // cfg.splits) % cfg.groups_per_iter == 0


def test_clear_errors_for_shapes_the_kernel_cannot_take():
    rng, _ = fresh_rng()
    _, _, w = random_weight(rng, 128, 40, 8, 64)  # N = 40: not a multiple of 16
    with pytest.raises(ValueError, match="multiple of 16"):
        quant_matmul_pallas(random_x(rng, 1, 128), w, interpret=True)
    _, _, w = random_weight(rng, 128, 32, 6, 32)  # 2-bit slots of 8 rows: too small for a dot tile
    with pytest.raises(ValueError, match="power of two >= 16"):
        quant_matmul_pallas(random_x(rng, 1, 128), w, interpret=True)
    _, _, w = random_weight(rng, 128, 32, 4, 128)
    with pytest.raises(ValueError, match="K=64"):
        quant_matmul_pallas(random_x(rng, 1, 64), w, interpret=True)
    with pytest.raises(ValueError, match="flatten"):
        quant_matmul_pallas(jnp.ones((1, 2, 128), jnp.bfloat16), w, interpret=True)
    _, _, w3 = random_weight(rng, 128, 32, 4, 128, lead=(2,))
    with pytest.raises(ValueError, match="2-D"):
        check_kernel_shape((1, 128), w3)
    with pytest.raises(ValueError, match="does not tile"):
        quant_matmul_pallas(random_x(rng, 1, 128), w, interpret=True,
                            config=DenseConfig(bm=16, bn=32, splits=3, groups_per_iter=1))


def test_auto_path_falls_back_for_untileable_shapes_but_kernel_path_raises():
    rng, seed = fresh_rng()
    _, _, w = random_weight(rng, 128, 40, 8, 64)
    x = random_x(rng, 2, 128)
    assert_close_to_reference(quant_matmul(x, w, impl="interpret"), x, w, seed)
    with pytest.raises(ValueError, match="multiple of 16"):
        quant_matmul(x, w, impl="interpret", path="kernel")
