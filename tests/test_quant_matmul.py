"""Quantized weight layout, the kernel switch, and the W{4,6,8}A16 dense Pallas kernel (interpret mode) vs the
pure-JAX reference. Fresh random inputs each run (the seed is in every failure message); never zeros."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fixed_order
from pallas_kernels import quant_layout as ql
from pallas_kernels import quant_gemv as qg
from pallas_kernels import quant_matmul as qm
from pallas_kernels.kernel_switch import resolve_impl, use_pallas
from pallas_kernels.quant_gemv import (GemvConfig, check_gemv_config, default_gemv_config, gemv_layout,
                                       quant_matmul_gemv)
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


@pytest.mark.parametrize("bits,group", FORMATS)
@pytest.mark.parametrize("m", [3, 16])
def test_kernel_with_weights_as_left_operand_matches_reference(bits, group, m):
    """weights_left computes y^T = q^T x^T (the GPU tiling for 3..32 tokens) with the offset removed from the
    weights before the dot: same contract, split-K included."""
    rng, seed = fresh_rng()
    _, _, w = random_weight(rng, 4 * group, 128, bits, group, dtype=np.float16 if bits != 8 else jnp.bfloat16)
    x = random_x(rng, m, 4 * group)
    cfg = DenseConfig(bm=16, bn=64, splits=2, groups_per_iter=2, weights_left=True)
    y = quant_matmul_pallas(x, w, config=cfg, interpret=True)
    assert y.dtype == x.dtype and y.shape == (m, 128)
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


# ------------------------------------------------------------------------------------------------ GEMV path

def _ptx_run(asm: str, operands: dict) -> dict:
    """A tiny interpreter for the PTX subset of the GEMV field extractors (uint32 numpy lanes), so their bit
    logic is checked on the CPU (the kernel runs them only on the GPU; interpret mode runs _fields_jnp)."""
    regs = dict(operands)

    def val(tok):
        tok = tok.strip()
        if tok.startswith("0x"):
            return np.uint32(int(tok, 16))
        if tok.lstrip("-").isdigit():
            return np.uint32(int(tok))
        return regs[tok]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b64":
            dst, src = rest.split(",", 1)
            lo, hi = [t.strip() for t in src.strip().strip("{}").split(",")]
            regs[dst.strip()] = (regs[lo].astype(np.uint64), regs[hi].astype(np.uint64))
            continue
        args = [a.strip() for a in rest.split(",")]
        d, srcs = args[0], [val(a) for a in args[1:]]
        with np.errstate(over="ignore"):
            if op == "shl.b32":
                r = srcs[0] << srcs[1]
            elif op == "shr.u32":
                r = srcs[0] >> srcs[1]
            elif op == "and.b32":
                r = srcs[0] & srcs[1]
            elif op == "xor.b32":
                r = srcs[0] ^ srcs[1]
            elif op == "lop3.b32":
                a, b, c, lut = srcs
                r = np.zeros_like(a | b | c)
                for bit in range(8):
                    if (int(lut) >> bit) & 1:
                        ta = a if bit & 4 else ~a
                        tb = b if bit & 2 else ~b
                        tc = c if bit & 1 else ~c
                        r |= ta & tb & tc
            elif op == "prmt.b32":
                a, b, sel = srcs
                pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
                pool = [np.broadcast_to(p, np.broadcast(a, b).shape).astype(np.uint32) for p in pool]
                r = sum(pool[(int(sel) >> (4 * i)) & 7] << np.uint32(8 * i) for i in range(4))
            else:
                raise AssertionError(f"unexpected PTX op {op}")
        regs[d] = np.asarray(r, np.uint32)
    return regs


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_gemv_ptx_field_extractors_match_the_jnp_formulas(bits):
    """The inline PTX (4 packed bytes per 32-bit register) gives the same fp32 bit patterns as _fields_jnp for
    random words, and those are exactly offset + q."""
    rng, seed = fresh_rng()
    n_args = 3 if bits == 6 else 1
    words = [rng.integers(0, 1 << 32, size=4096, dtype=np.uint64).astype(np.uint32) for _ in range(n_args)]
    words[0][:256] = np.arange(256, dtype=np.uint32) * 0x01010101  # every byte value in every lane
    calls = {4: (qg._ASM4,), 8: (qg._ASM8,), 6: qg._ASM6}[bits]
    first_in = 8 if bits == 8 else 4
    ptx_fields = []  # [field][lane] -> uint32 array over words
    for asm in calls:
        regs = _ptx_run(asm, {f"${first_in + i}": w for i, w in enumerate(words)} if bits != 8
                        else {"$4": words[0]})
        outs = [regs[f"${i}"] for i in range(4)]
        if bits == 8:
            ptx_fields.append(outs)
        else:
            ptx_fields.append([o[0].astype(np.uint32) for o in outs])
            ptx_fields.append([o[1].astype(np.uint32) for o in outs])
    _, _, slots = gemv_layout(bits, 64)
    for lane in range(4):
        raws = [jnp.asarray(((w >> np.uint32(8 * lane)) & 0xFF).astype(np.uint8)) for w in words]
        if bits == 8:  # the int8 plane's dtype
            raws = [jax.lax.bitcast_convert_type(r, jnp.int8) for r in raws]
        want = [np.asarray(f) for f in qg._fields_jnp(bits, raws)]
        assert len(want) == len(ptx_fields) == len(slots)
        for s, (w, got) in enumerate(zip(want, ptx_fields)):
            np.testing.assert_array_equal(got[lane], w, err_msg=f"{bits}-bit slot {s} lane {lane} seed={seed}")
        # the fp32 value of each field is offset + q
        b = [np.asarray(r).astype(np.int32) & 0xFF for r in raws]
        if bits == 8:
            qs = [np.where(b[0] >= 128, b[0] - 256, b[0])]
        elif bits == 4:
            nib = [b[0] & 15, b[0] >> 4]
            qs = [np.where(v >= 8, v - 16, v) for v in nib]
        else:
            a, bb, p = b
            hs = [(p >> (2 * s)) & 3 for s in range(4)]
            hs = [np.where(h >= 2, h - 4, h) for h in hs]
            ls = [a & 15, bb & 15, a >> 4, bb >> 4]
            qs = [16 * h + l for h, l in zip(hs, ls)]
        for (_, off), w, q in zip(slots, want, qs):
            np.testing.assert_array_equal(w.view(np.float32) - off, q.astype(np.float32))


GEMV_SHAPES = {(4, 128): (512, 256), (6, 64): (384, 128), (8, 64): (256, 192), (8, 128): (640, 512)}


@pytest.mark.parametrize("bits,group", FORMATS)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_gemv_matches_reference(bits, group, m):
    """Real K/N structure scaled down; M odd: explicit split-K > 1 tiling, M even: split-K 1 (y written in
    x.dtype by the kernel); NaN-poisoned outputs (interpret mode) would fail the finiteness check."""
    rng, seed = fresh_rng()
    k, n = GEMV_SHAPES[(bits, group)]
    _, _, w = random_weight(rng, k, n, bits, group, dtype=np.float16 if bits != 8 else jnp.bfloat16)
    x = random_x(rng, m, k)
    _, space, _ = gemv_layout(bits, group)
    if m % 2:
        cfg = GemvConfig(bn=64, splits=(k // group) // (2 if (k // group) % 2 == 0 else 1) or 1,
                         rows=min(8, space), unroll=1, fields="jnp" if m == 3 else "asm")
    else:
        cfg = GemvConfig(bn=ql.pow2_divisor(n, 128), splits=1, rows=min(16, space),
                         unroll=2 if (k // group) % 2 == 0 else 1)
    y = quant_matmul_gemv(x, w, config=cfg, interpret=True)
    assert y.dtype == x.dtype and y.shape == (m, n)
    assert_close_to_reference(y, x, w, seed)


def test_gemv_float32_activations_are_accurate_at_every_width():
    """fp32 x and output: the offset-binary fields keep ~1e-5 relative accuracy (the tolerance is 1e-4)."""
    rng, seed = fresh_rng()
    for bits, group in [(4, 128), (6, 64), (8, 128)]:
        _, _, w = random_weight(rng, 2 * group * 2, 128, bits, group)
        x = random_x(rng, 2, 2 * group * 2, jnp.float32)
        y = quant_matmul_gemv(x, w, config=GemvConfig(bn=64, splits=2), interpret=True)
        assert y.dtype == jnp.float32
        assert_close_to_reference(y, x, w, f"{seed} bits={bits}", rtol=1e-4)


def test_gemv_default_configs_tile_the_real_shapes():
    for k, n, bits, g in [(8192, 28672, 4, 128), (2560, 248320, 8, 128), (2560, 10240, 6, 64),
                          (6144, 2560, 6, 64), (10240, 320, 8, 64), (320, 10240, 8, 64), (2560, 1280, 4, 128)]:
        for m in (1, 2, 3, 4, 8):
            cfg = default_gemv_config(m, k, n, bits, g)
            check_gemv_config(cfg, m, k, n, bits, g)
            assert (n // cfg.bn) * cfg.splits >= min(528, (n // cfg.bn) * (k // g))


def test_gemv_forced_through_quant_matmul_under_jit():
    rng, seed = fresh_rng()
    _, _, w = random_weight(rng, 256, 64, 4, 128)
    x = random_x(rng, 2, 256)
    y = jax.jit(lambda x, w: quant_matmul(x, w, impl="interpret", path="gemv"))(x, w)
    assert_close_to_reference(y, x, w, seed)


def test_gemv_clear_errors():
    rng, _ = fresh_rng()
    _, _, w = random_weight(rng, 256, 64, 4, 128)
    with pytest.raises(ValueError, match="M <= 8"):
        quant_matmul(random_x(rng, 9, 256), w, impl="interpret", path="gemv")
    with pytest.raises(ValueError, match="K=128"):
        quant_matmul_gemv(random_x(rng, 1, 128), w, interpret=True)
    _, _, w40 = random_weight(rng, 128, 40, 8, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        quant_matmul_gemv(random_x(rng, 1, 128), w40, interpret=True)
    x = random_x(rng, 1, 256)
    for cfg, msg in [(GemvConfig(bn=48), "bn=48"), (GemvConfig(splits=3), "splits=3"),
                     (GemvConfig(rows=128), "rows=128"), (GemvConfig(bn=16, rows=4), "packs 4 bytes"),
                     (GemvConfig(fields="ptx"), "fields"), (GemvConfig(splits=1, unroll=3), "unroll=3")]:
        with pytest.raises(ValueError, match=msg):
            quant_matmul_gemv(x, w, config=cfg, interpret=True)
    _, _, w3 = random_weight(rng, 256, 32, 4, 128, lead=(2,))
    with pytest.raises(ValueError, match="2-D"):
        quant_matmul_gemv(x, w3, interpret=True)


def test_auto_dispatch_takes_gemv_for_one_or_two_tokens_then_the_tensor_core_kernel(monkeypatch):
    rng, seed = fresh_rng()
    _, _, w = random_weight(rng, 256, 64, 4, 128)
    assert [qm.dispatch_path((m, 256), w) for m in (1, 2, 3, 32, 33)] == [
        "gemv", "gemv", "kernel", "kernel", "dequant_dot"]
    _, _, w40 = random_weight(rng, 128, 40, 8, 64)  # N = 40: neither kernel tiles it
    assert qm.dispatch_path((1, 128), w40) == "dequant_dot"
    calls = []
    real = qm.quant_matmul_gemv
    monkeypatch.setattr(qm, "quant_matmul_gemv", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = random_x(rng, 2, 256)
    with fixed_order.batch_invariant(False):  # the fast dispatch (batch-invariant traces: the test below)
        assert_close_to_reference(quant_matmul(x, w, impl="interpret"), x, w, seed)
    assert calls, "path='auto' at M = 2 must run the GEMV kernel"


@pytest.mark.parametrize("path, split", [("auto", 4), ("prompt_fixed", 1)])
def test_batch_invariant_traces_take_one_kernel_configuration_for_every_row_count(monkeypatch, path, split):
    """Under fixed_order.batch_invariant(True) path='auto' runs the tensor-core kernel at every M (no GEMV, no XLA
    dot), with the split and the operand order fixed by K and N alone; only BM follows M. 'prompt_fixed' (the
    prompt tokens of a step with token kinds) likewise, with no split."""
    rng, seed = fresh_rng()
    _, _, w = random_weight(rng, 512, 64, 4, 128)
    configs = []
    real = qm.quant_matmul_pallas
    monkeypatch.setattr(qm, "quant_matmul_pallas", lambda *a, **k: configs.append(k["config"]) or real(*a, **k))
    monkeypatch.setattr(qm, "quant_matmul_gemv", lambda *a, **k: pytest.fail("GEMV in a batch-invariant trace"))
    monkeypatch.setattr(qm, "dequant_dot_xla", lambda *a, **k: pytest.fail("XLA dot in a batch-invariant trace"))
    x = random_x(rng, 40, 512)
    with fixed_order.batch_invariant(True):
        ys = {m: np.asarray(quant_matmul(x[:m], w, impl="interpret", path=path)) for m in (1, 2, 3, 33, 40)}
    assert {(c.splits, c.bn, c.weights_left, c.groups_per_iter) for c in configs} == {(split, 64, True, 1)}
    assert {c.bm for c in configs} == {16, 64}
    assert_close_to_reference(jnp.asarray(ys[40]), x, w, seed)
    for m, y in ys.items():  # the interpreted kernel's rows do not depend on M either
        assert y.tobytes() == ys[40][:m].tobytes(), m


def test_batch_invariant_trace_adds_the_split_partials_without_a_reduce():
    """In a batch-invariant trace the split-K partials are added as a fixed tree of elementwise adds after the
    kernel (an XLA reduce, fused into its reader, could order them by the program's row count); the result stays
    the reference's, and each row is the same at every M."""
    rng, seed = fresh_rng()
    _, _, w = random_weight(rng, 4 * 64, 128, 8, 64, dtype=jnp.bfloat16)
    x = random_x(rng, 3, 4 * 64)
    cfg = DenseConfig(bm=16, bn=64, splits=4, groups_per_iter=1, weights_left=True)
    for on in (True, False):
        with fixed_order.batch_invariant(on):
            eqns = jax.make_jaxpr(lambda a: quant_matmul_pallas(a, w, config=cfg, interpret=True))(x).jaxpr.eqns
        last = max(i for i, e in enumerate(eqns) if e.primitive.name == "pallas_call")
        reduces = [e.primitive.name for e in eqns[last + 1:] if e.primitive.name.startswith("reduce")]
        assert bool(reduces) == (not on), reduces
    with fixed_order.batch_invariant(True):
        ys = [np.asarray(quant_matmul_pallas(x[:m], w, config=cfg, interpret=True)) for m in (1, 3)]
    assert_close_to_reference(jnp.asarray(ys[1]), x, w, seed)
    assert ys[0].tobytes() == ys[1][:1].tobytes()


# ------------------------------------------------------------------------------------------------ fixed GEMV

FIXED_MS = (1, 2, 3, 5, 8, 17)


# quant_matmul_gemv_fixed in interpret mode under one jit: calls of one shape (the 1-row calls) trace it once
fixed_gemv = jax.jit(lambda x, w: qg.quant_matmul_gemv_fixed(x, w, interpret=True))


def assert_rows_are_their_one_row_calls(x, w, seed, ms=FIXED_MS, run=fixed_gemv):
    """run (quant_matmul_gemv_fixed) on x[:M] for every M in ms: row i bitwise what the 1-row call on x[i:i+1]
    gives. Returns the result at the largest M."""
    alone = [np.asarray(run(x[i:i + 1], w))[0] for i in range(max(ms))]
    for m in ms:
        y = run(x[:m], w)
        assert y.shape == (m, w.n) and y.dtype == x.dtype
        rows = np.asarray(y)
        for i in range(m):
            assert rows[i].tobytes() == alone[i].tobytes(), f"M={m}: row {i} differs from its 1-row call, seed={seed}"
    return y


def test_fixed_gemv_config_is_the_fast_modes_one_token_config():
    for k, n, bits, g in [(8192, 28672, 4, 128), (2560, 248320, 8, 128), (2560, 10240, 6, 64), (10240, 320, 8, 64)]:
        cfg = qg.fixed_gemv_config(k, n, bits, g)
        assert cfg == default_gemv_config(1, k, n, bits, g) and cfg.rows == 16
        check_gemv_config(cfg, 2, k, n, bits, g)  # it tiles the 2-row token tiles too


@pytest.mark.parametrize("bits,group", FORMATS)
def test_fixed_gemv_rows_are_their_one_row_calls_at_every_m(bits, group):
    """Every M from 1 to 17 (odd M: a zero-padded last token tile) gives each row the bits of its 1-row call, and
    the result is the reference's; the split partials are added without an XLA reduce (pairwise_sum's adds)."""
    rng, seed = fresh_rng()
    k, n = GEMV_SHAPES[(bits, group)]
    _, _, w = random_weight(rng, k, n, bits, group, dtype=np.float16 if bits != 8 else jnp.bfloat16)
    assert qg.fixed_gemv_config(k, n, bits, group).splits > 1  # the pairwise sum runs
    x = random_x(rng, max(FIXED_MS), k)
    assert_close_to_reference(assert_rows_are_their_one_row_calls(x, w, seed), x, w, seed)
    eqns = jax.make_jaxpr(lambda a: qg.quant_matmul_gemv_fixed(a, w, interpret=True))(x[:5]).jaxpr.eqns
    last = max(i for i, e in enumerate(eqns) if e.primitive.name == "pallas_call")
    assert not [e for e in eqns[last + 1:] if e.primitive.name.startswith("reduce")]


def test_fixed_gemv_reads_a_layer_slice_in_place_float32():
    """A LayerSlice of stacked weights gives the bits of its layer's own arrays; float32 x and y (no bf16 output
    rounding to hide a difference in the fp32 sums) keep rows invariant and 1e-4 close to the reference."""
    rng, seed = fresh_rng()
    _, _, stack = random_weight(rng, 384, 128, 6, 64, lead=(3,))
    w = ql.LayerSlice(stack, 1)
    x = random_x(rng, 5, 384, jnp.float32)
    y = assert_rows_are_their_one_row_calls(x, w, seed, ms=(1, 2, 5))
    assert np.asarray(y).tobytes() == np.asarray(fixed_gemv(x, w.get())).tobytes()
    assert_close_to_reference(y, x, w.get(), seed, rtol=1e-4)


def test_fixed_gemv_with_one_split_writes_the_rows_in_the_kernel(monkeypatch):
    """One split (lm_head-sized N reaches the program target without split-K): the kernel writes y in x.dtype, the
    padding row of odd M is sliced off; rows still their 1-row calls."""
    rng, seed = fresh_rng()
    _, _, w = random_weight(rng, 256, 128, 4, 128)
    monkeypatch.setattr(qg, "fixed_gemv_config", lambda *a: dataclasses.replace(default_gemv_config(1, *a), splits=1))
    run = jax.jit(lambda a, b: qg.quant_matmul_gemv_fixed(a, b, interpret=True))  # not fixed_gemv's traces
    x = random_x(rng, 5, 256)
    y = assert_rows_are_their_one_row_calls(x, w, seed, ms=(1, 2, 5), run=run)
    eqns = jax.make_jaxpr(lambda a: qg.quant_matmul_gemv_fixed(a, w, interpret=True))(x).jaxpr.eqns
    [call] = [e for e in eqns if e.primitive.name == "pallas_call"]
    assert call.outvars[0].aval.dtype == x.dtype  # one split: no partials
    assert_close_to_reference(y, x, w, seed)


def test_control_the_fast_gemvs_rows_follow_m():
    """The test above can fail: the fast entry point's default config at M = 3 reads 8 plane rows per chunk (16 at
    M = 1), so its rows round differently from the 1-row calls (float32, so that no bf16 rounding absorbs it)."""
    rng, seed = fresh_rng()
    _, _, w = random_weight(rng, 512, 256, 4, 128)
    x = random_x(rng, 3, 512, jnp.float32)
    assert default_gemv_config(3, 512, 256, 4, 128).rows == 8
    fast = np.asarray(quant_matmul_gemv(x, w, interpret=True))
    fixed = np.asarray(fixed_gemv(x, w))
    alone = np.concatenate([np.asarray(fixed_gemv(x[i:i + 1], w)) for i in range(3)])
    assert fixed.tobytes() == alone.tobytes(), f"seed={seed}"
    assert (fast != alone).any(), f"seed={seed}"
    np.testing.assert_allclose(fast, alone, rtol=1e-4, atol=1e-4 * np.abs(alone).max(), err_msg=f"seed={seed}")


def test_quant_matmul_gemv_fixed_path():
    rng, seed = fresh_rng()
    _, _, w = random_weight(rng, 256, 64, 8, 128)
    x = random_x(rng, 9, 256)  # above GEMV_MAX_M: the fixed variant takes any M
    y = jax.jit(lambda a, b: quant_matmul(a, b, impl="interpret", path="gemv_fixed"))(x, w)
    assert np.asarray(y).tobytes() == np.asarray(fixed_gemv(x, w)).tobytes()
    ref = quant_matmul(x, w, impl="reference", path="gemv_fixed")
    assert np.asarray(ref).tobytes() == np.asarray(quant_matmul_reference(x, w)).tobytes()
    with pytest.raises(ValueError, match="no config"):
        quant_matmul(x, w, impl="interpret", path="gemv_fixed", config=GemvConfig())
    _, _, w40 = random_weight(rng, 128, 40, 8, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        quant_matmul(random_x(rng, 3, 128), w40, impl="interpret", path="gemv_fixed")
