"""Grouped MoE (routed experts over stacked int4 experts): Pallas kernels in interpret mode vs the pure-JAX
reference, odd routings included. Fresh random inputs each run (seed in every failure message)."""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import fixed_order, moe_matmul
from pallas_kernels import quant_layout as ql
from pallas_kernels.quant_gemv import gemv_call_options
from pallas_kernels.moe_matmul import (MoEConfig, MoEGemvConfig, _tile_routing, default_moe_config, num_tiles_for,
                                       routed_experts, routed_experts_gemv, routed_experts_pallas,
                                       routed_experts_reference)

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


def test_prefill_sized_batches_take_64_row_tiles_and_match_the_reference():
    rng, seed = fresh_rng()
    wgu, wd = experts(rng)
    m, k = 160, 2  # 40 routed rows per expert on average: the prefill config
    assert default_moe_config(m, k, E).bm == 64 and default_moe_config(16, k, E).bm == 16
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


@pytest.mark.parametrize("entry", [routed_experts_pallas, routed_experts_gemv])
def test_clear_errors_for_shapes_the_kernels_cannot_take(entry):
    rng, _ = fresh_rng()
    wgu, wd = experts(rng)
    x, wts = inputs(rng, 2, 2)
    ids = jnp.zeros((2, 2), jnp.int32)
    with pytest.raises(ValueError, match="w_down must be"):
        entry(x, ids, wts, wgu, wgu, interpret=True)
    with pytest.raises(ValueError, match="expert_ids"):
        entry(x, ids[:1], wts, wgu, wd, interpret=True)
    with pytest.raises(TypeError, match="QuantizedWeight"):
        entry(x, ids, wts, ql.dequantize(wgu), wd, interpret=True)
    with pytest.raises(ValueError, match="stacked"):
        entry(x, ids, wts, wgu[0], wd, interpret=True)


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


# ------------------------------------------------------------------------------------------------ GEMV decode path

def check_gemv(x, ids, wts, wgu, wd, seed, config=None, fused_glue=True):
    config = dataclasses.replace(config or MoEGemvConfig(), fused_glue=fused_glue)
    got = routed_experts_gemv(x, ids, wts, wgu, wd, config=config, interpret=True)
    ref = routed_experts_reference(x, ids, wts, wgu, wd)
    got, ref = np.asarray(got.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    assert got.shape == (x.shape[0], H) and got.dtype == np.float32
    assert np.isfinite(got).all(), f"NaN / unwritten rows, seed={seed}"
    err = np.abs(got - ref).max() / (np.abs(ref).max() + 1e-6)
    assert err < 2e-2, f"max error {err:.2e}, ids={np.asarray(ids).tolist()}, config={config}, seed={seed}"


# fused (splits_gate_up = 1: silu(g) * u written by the kernel) and split-K partials; asm and jnp fields (the
# interpreter runs the jnp formulas for both, the configs still pick different tilings)
GEMV_CONFIGS = [MoEGemvConfig(),
                MoEGemvConfig(bn_gate_up=64, splits_gate_up=1, bn_down=64, splits_down=1, rows=8, fields="jnp"),
                MoEGemvConfig(bn_gate_up=128, splits_gate_up=2, bn_down=128, splits_down=1, unroll=1)]
# every GEMV test runs both glue modes: fused (the down kernel sums the gate/up splits, applies silu(g) * u and
# the routing weight; one XLA sum after) and the XLA glue between / after the kernels (the A/B baseline)
GLUE = pytest.mark.parametrize("fused_glue", [True, False], ids=["fused_glue", "xla_glue"])


@GLUE
@pytest.mark.parametrize("m,k,ci", [(1, 4, 0), (2, 3, 1), (3, 2, 2), (1, 8, 1)])
def test_gemv_random_routing_matches_reference(m, k, ci, fused_glue):
    rng, seed = fresh_rng()
    wgu, wd = experts(rng)
    x, wts = inputs(rng, m, k)
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(m)]), jnp.int32)
    check_gemv(x, ids, wts, wgu, wd, seed, GEMV_CONFIGS[ci], fused_glue)


@GLUE
def test_gemv_repeated_experts_one_expert_for_all_and_unused_experts(fused_glue):
    rng, seed = fresh_rng()
    wgu, wd = experts(rng)
    x, wts = inputs(rng, 3, 3)
    check_gemv(x, jnp.asarray([[5, 5, 1], [2, 2, 2], [0, 5, 0]], jnp.int32), wts, wgu, wd, seed, None, fused_glue)
    check_gemv(x, jnp.full((3, 3), E - 1, jnp.int32), wts, wgu, wd, seed, GEMV_CONFIGS[1],  # 0..E-2 unused
               fused_glue)
    x2, wts2 = inputs(rng, 2, 2)
    check_gemv(x2, jnp.asarray([[0, E - 1], [E - 1, 0]], jnp.int32), wts2, wgu, wd, seed, GEMV_CONFIGS[2],
               fused_glue)


@GLUE
@pytest.mark.parametrize("bits,m,splits_gate_up", [(4, 3, 1), (6, 2, 0), (8, 1, 0)])
def test_gemv_group64_experts_split_down(bits, m, splits_gate_up, fused_glue):
    """Group 64: the down kernel has two K groups, so its split-K (auto: 2) runs; gate/up auto splits = 4."""
    rng, seed = fresh_rng()
    wgu, wd = experts(rng, bits=bits, group=64)
    x, wts = inputs(rng, m, 2)
    ids = jnp.asarray([[1, 6], [6, 3], [3, 3]][:m], jnp.int32)
    cfg = MoEGemvConfig(bn_gate_up=64, splits_gate_up=splits_gate_up, bn_down=64, rows=8)
    assert moe_matmul.check_moe_gemv(x.shape, ids.shape, wgu, wd, cfg)[3] == 2
    check_gemv(x, ids, wts, wgu, wd, seed, cfg, fused_glue)


@pytest.mark.parametrize("act_splits", [2, 3])
def test_fused_down_loader_rounds_the_activation_like_the_reference(act_splits):
    """The down kernel fed the gate/up fp32 partials must compute bit for bit what it computes from the
    activation the reference formula makes of them (splits summed in order, silu(g) * u, rounded to bf16)."""
    rng, seed = fresh_rng()
    _, wd = experts(rng, bits=8, group=64)
    m, k = 2, 3
    parts = jnp.asarray(rng.standard_normal((act_splits, m * k, 2, I)) * 2, jnp.float32)
    gsum = functools.reduce(jnp.add, list(parts))  # split 0 + split 1 + ..., the loader's order
    act = (jax.nn.silu(gsum[:, 0]) * gsum[:, 1]).astype(jnp.bfloat16)  # as in routed_experts_reference
    ids = jnp.asarray([1, 6, 6, 3, 0, 7], jnp.int32)
    wts = jnp.asarray(rng.uniform(0.1, 1.0, m * k), jnp.float32)
    opts = gemv_call_options(MoEGemvConfig(rows=8), interpret=True)
    fused, plain = (np.asarray(moe_matmul._gemv_down(h, ids, wts, wd, 64, 2, jnp.bfloat16, opts, k=k))
                    for h in (parts, act))
    assert fused.shape == (m, 2 * k, H) and np.isfinite(plain).all()
    np.testing.assert_array_equal(fused, plain, err_msg=f"seed={seed}")


@pytest.mark.parametrize("splits_gate_up", [1, 2])
def test_fused_glue_leaves_one_xla_op_and_none_between_the_kernels(splits_gate_up):
    """The jaxpr of the fused path: the gate/up output goes straight into the down kernel, and after it only
    the sum over (splits, k) and the cast run (no weighting, no dot, no activation)."""
    rng, _ = fresh_rng()
    wgu, wd = experts(rng)
    x, wts = inputs(rng, 2, 3)
    ids = jnp.asarray([[1, 4, 5], [4, 7, 0]], jnp.int32)
    cfg = MoEGemvConfig(splits_gate_up=splits_gate_up, fused_glue=True)
    eqns = jax.make_jaxpr(lambda *a: routed_experts_gemv(*a, config=cfg, interpret=True))(
        x, ids, wts, wgu, wd).jaxpr.eqns
    calls = [i for i, e in enumerate(eqns) if e.primitive.name == "pallas_call"]
    assert len(calls) == 2
    gate_up, down = eqns[calls[0]], eqns[calls[1]]
    assert down.invars[1] is gate_up.outvars[0]
    assert [e.primitive.name for e in eqns[calls[1] + 1:]] == ["reduce_sum", "convert_element_type"]


@pytest.fixture
def fast_dispatch():
    """The shape-dependent dispatch (a batch-invariant trace, the CPU's default, takes one path: tested below)."""
    with fixed_order.batch_invariant(False):
        yield


def test_batch_invariant_traces_take_the_tiles_path_at_every_token_count(monkeypatch):
    rng, seed = fresh_rng()
    wgu, wd = experts(rng)
    x, wts = inputs(rng, 3, 2)
    ids = jnp.asarray([[1, 4], [4, 7], [0, 7]], jnp.int32)
    configs = []
    real = moe_matmul.routed_experts_pallas
    monkeypatch.setattr(moe_matmul, "routed_experts_pallas",
                        lambda *a, **k: configs.append(k["config"]) or real(*a, **k))
    monkeypatch.setattr(moe_matmul, "routed_experts_gemv", lambda *a, **k: pytest.fail("GEMV path"))
    with fixed_order.batch_invariant(True):
        ys = [np.asarray(routed_experts(x[:m], ids[:m], wts[:m], wgu, wd, impl="interpret")) for m in (1, 2, 3)]
    assert configs == [MoEConfig()] * 3
    ref = np.asarray(routed_experts_reference(x, ids, wts, wgu, wd), np.float32)
    np.testing.assert_allclose(ys[-1].astype(np.float32), ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max(),
                               err_msg=f"seed={seed}")
    for m, y in zip((1, 2), ys):  # each token's row does not depend on the others (interpreted kernels)
        assert y.tobytes() == ys[-1][:m].tobytes(), m


def test_auto_path_takes_gemv_for_few_pairs_and_tiles_above(monkeypatch, fast_dispatch):
    rng, seed = fresh_rng()
    wgu, wd = experts(rng)
    x, wts = inputs(rng, 2, 2)
    ids = jnp.asarray([[1, 4], [4, 7]], jnp.int32)
    calls = []
    real_gemv, real_tiles = moe_matmul.routed_experts_gemv, moe_matmul.routed_experts_pallas
    monkeypatch.setattr(moe_matmul, "routed_experts_gemv", lambda *a, **k: calls.append("gemv") or real_gemv(*a, **k))
    monkeypatch.setattr(moe_matmul, "routed_experts_pallas",
                        lambda *a, **k: calls.append("tiles") or real_tiles(*a, **k))
    ref = np.asarray(routed_experts_reference(x, ids, wts, wgu, wd), np.float32)
    for path, want in [("auto", "gemv"), ("tiles", "tiles"), ("gemv", "gemv")]:
        got = np.asarray(routed_experts(x, ids, wts, wgu, wd, impl="interpret", path=path), np.float32)
        assert calls[-1] == want
        np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max(), err_msg=f"seed={seed}")
    monkeypatch.setattr(moe_matmul, "MOE_GEMV_MAX_PAIRS", 3)  # 4 pairs: above the threshold
    routed_experts(x, ids, wts, wgu, wd, impl="interpret")
    assert calls[-1] == "tiles"
    with pytest.raises(ValueError, match="path"):
        routed_experts(x, ids, wts, wgu, wd, impl="interpret", path="nope")


def test_auto_path_falls_back_for_shapes_the_kernels_cannot_take(monkeypatch):
    """int4 in groups of 16 (8 rows per plane slot): neither kernel takes it; auto runs the reference (as the
    small demo model needs), an explicit path raises."""
    rng, seed = fresh_rng()
    wgu, wd = experts(rng, group=16)
    x, wts = inputs(rng, 2, 2)
    ids = jnp.asarray([[1, 4], [4, 7]], jnp.int32)
    ref = np.asarray(routed_experts_reference(x, ids, wts, wgu, wd), np.float32)
    got = np.asarray(routed_experts(x, ids, wts, wgu, wd, impl="interpret"), np.float32)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max(), err_msg=f"seed={seed}")
    for path in ("gemv", "tiles"):
        with pytest.raises(ValueError):
            routed_experts(x, ids, wts, wgu, wd, impl="interpret", path=path)


def test_gemv_clear_errors():
    rng, _ = fresh_rng()
    wgu, wd = experts(rng)
    x, wts = inputs(rng, 2, 2)
    ids = jnp.zeros((2, 2), jnp.int32)
    with pytest.raises(ValueError, match="splits=3"):
        routed_experts_gemv(x, ids, wts, wgu, wd, config=MoEGemvConfig(splits_gate_up=3), interpret=True)
    with pytest.raises(ValueError, match="rows=128"):
        routed_experts_gemv(x, ids, wts, wgu, wd, config=MoEGemvConfig(rows=128), interpret=True)


def test_batch_invariant_tiles_add_the_k_experts_without_a_dot_or_reduce():
    """In a batch-invariant trace the tiles path combines the k expert outputs as a fixed tree of elementwise adds:
    no dot_general or reduce after the kernels, whose split of the fp32 sum XLA could choose by the row count."""
    rng, _ = fresh_rng()
    wgu, wd = experts(rng)
    x, wts = inputs(rng, 3, 2)
    ids = jnp.asarray([[1, 4], [4, 7], [0, 7]], jnp.int32)
    for on, want_dot in ((True, False), (False, True)):
        with fixed_order.batch_invariant(on):
            eqns = jax.make_jaxpr(lambda *a: moe_matmul.routed_experts_pallas(*a, config=MoEConfig(), interpret=True))(
                x, ids, wts, wgu, wd).jaxpr.eqns
        last = max(i for i, e in enumerate(eqns) if e.primitive.name == "pallas_call")
        after = {e.primitive.name for e in eqns[last + 1:]}
        assert ("dot_general" in after) == want_dot, after
        if on:
            assert not any(n.startswith("reduce") for n in after), after


# ------------------------------------------------------------------------------------------------ fixed GEMV path

# routed_experts_gemv_fixed in interpret mode under one jit: calls of one shape (the 1-token calls) trace it once
gemv_fixed = jax.jit(lambda *a: moe_matmul.routed_experts_gemv_fixed(*a, interpret=True))


def routing(rng, m, k):
    x, wts = inputs(rng, m, k)
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(m)]), jnp.int32)
    return x, ids, wts


def token_calls(run, x, ids, wts, wgu, wd):
    """run on each token alone: [M, H]."""
    return np.concatenate([np.asarray(run(x[i:i + 1], ids[i:i + 1], wts[i:i + 1], wgu, wd)) for i in range(len(x))])


def assert_tokens_are_their_one_token_calls(x, ids, wts, wgu, wd, seed, ms=(1, 2, 3, 6), run=gemv_fixed):
    """run (routed_experts_gemv_fixed) on the first M tokens for every M in ms: token m's row bitwise its 1-token
    call's. Returns the result at the largest M."""
    alone = token_calls(run, x, ids, wts, wgu, wd)
    for m in ms:
        y = run(x[:m], ids[:m], wts[:m], wgu, wd)
        assert y.shape == (m, H) and y.dtype == x.dtype
        rows = np.asarray(y)
        for i in range(m):
            assert rows[i].tobytes() == alone[i].tobytes(), \
                f"M={m}: token {i} differs from its 1-token call, ids={np.asarray(ids).tolist()}, seed={seed}"
    return y


def assert_close_to_moe_reference(y, x, ids, wts, wgu, wd, seed, rtol=2e-2):
    ref = np.asarray(routed_experts_reference(x, ids, wts, wgu, wd), np.float32)
    got = np.asarray(y, np.float32)
    assert np.isfinite(got).all(), f"NaN / unwritten rows, seed={seed}"
    err = np.abs(got - ref).max() / (np.abs(ref).max() + 1e-6)
    assert err < rtol, f"max error {err:.2e}, ids={np.asarray(ids).tolist()}, seed={seed}"


@pytest.mark.parametrize("bits,group,k", [(4, 128, 2), (4, 128, 4), (6, 64, 3)])
def test_gemv_fixed_tokens_are_their_one_token_calls_at_every_m(bits, group, k):
    """Token m's output at M = 1, 2, 3, 6 is bitwise its 1-token call's (the splits are one token's: int4 g128
    gate/up 2 and down 1, int6 g64 gate/up 4 and down 2, whatever M) and the reference's; after the kernels no
    XLA reduce or dot adds anything (the pairwise trees' elementwise adds)."""
    rng, seed = fresh_rng()
    wgu, wd = experts(rng, bits, group)
    x, ids, wts = routing(rng, 6, k)
    splits = moe_matmul.check_moe_gemv((1, H), (1, k), wgu, wd, MoEGemvConfig())[1::2]
    assert splits == ((2, 1) if bits == 4 else (4, 2))
    assert_close_to_moe_reference(assert_tokens_are_their_one_token_calls(x, ids, wts, wgu, wd, seed),
                                  x, ids, wts, wgu, wd, seed)
    eqns = jax.make_jaxpr(lambda *a: moe_matmul.routed_experts_gemv_fixed(*a, interpret=True))(
        x, ids, wts, wgu, wd).jaxpr.eqns
    calls = [i for i, e in enumerate(eqns) if e.primitive.name == "pallas_call"]
    assert len(calls) == 2
    after = {e.primitive.name for e in eqns[calls[0] + 1:]}
    assert "dot_general" not in after and not any(n.startswith("reduce") for n in after), after


def test_gemv_fixed_reads_layer_slices_in_place_float32(monkeypatch):
    """Experts stacked over layers: the LayerSlice gives the bits of its layer's own arrays; float32 x (no bf16
    rounding of the activation or the output to hide a difference in the fp32 sums) keeps tokens invariant. A
    program target of 8 keeps these small shapes from saturating the splits, so that splits following M would
    show here (one token: 4 gate/up splits, three tokens: 2; the control below)."""
    rng, seed = fresh_rng()
    layers = [experts(rng, 6, 64) for _ in range(2)]
    wgu, wd = (ql.LayerSlice(jax.tree.map(lambda *a: jnp.stack(a), *ws), 1) for ws in zip(*layers))
    x, ids, wts = routing(rng, 3, 2)
    x = x.astype(jnp.float32)
    cfg = MoEGemvConfig(target_programs=8)
    assert [moe_matmul.check_moe_gemv((m, H), (m, 2), wgu, wd, cfg)[1] for m in (1, 3)] == [4, 2]
    monkeypatch.setattr(moe_matmul, "GEMV_FIXED_CONFIG", cfg)
    run = jax.jit(lambda *a: moe_matmul.routed_experts_gemv_fixed(*a, interpret=True))  # not gemv_fixed's traces
    y = assert_tokens_are_their_one_token_calls(x, ids, wts, wgu, wd, seed, ms=(1, 3), run=run)
    assert np.asarray(y).tobytes() == np.asarray(run(x, ids, wts, *layers[1])).tobytes()
    assert_close_to_moe_reference(y, x, ids, wts, wgu.get(), wd.get(), seed, rtol=1e-4)


def test_control_the_fast_gemv_paths_tokens_follow_m():
    """The tests above can fail: the decode path's auto splits follow the number of pairs (here 4 gate/up splits
    for one token, 1 for six), and its tokens then round differently from their 1-token calls (float32)."""
    rng, seed = fresh_rng()
    wgu, wd = experts(rng, 6, 64)
    x, ids, wts = routing(rng, 6, 2)
    x = x.astype(jnp.float32)
    cfg = MoEGemvConfig(target_programs=8)
    assert [moe_matmul.check_moe_gemv((m, H), (m, 2), wgu, wd, cfg)[1] for m in (1, 6)] == [4, 1]
    fast = jax.jit(lambda *a: routed_experts_gemv(*a, config=cfg, interpret=True))
    together, alone = np.asarray(fast(x, ids, wts, wgu, wd)), token_calls(fast, x, ids, wts, wgu, wd)
    assert (together != alone).any(), f"seed={seed}"
    np.testing.assert_allclose(together, alone, rtol=1e-4, atol=1e-4 * np.abs(alone).max(), err_msg=f"seed={seed}")
    assert np.asarray(gemv_fixed(x, ids, wts, wgu, wd)).tobytes() == token_calls(gemv_fixed, x, ids, wts, wgu,
                                                                                wd).tobytes()


def test_routed_experts_gemv_fixed_path():
    rng, seed = fresh_rng()
    wgu, wd = experts(rng)
    x, ids, wts = routing(rng, 3, 2)
    y = routed_experts(x, ids, wts, wgu, wd, impl="interpret", path="gemv_fixed")
    assert np.asarray(y).tobytes() == np.asarray(gemv_fixed(x, ids, wts, wgu, wd)).tobytes()
    ref = routed_experts(x, ids, wts, wgu, wd, impl="reference", path="gemv_fixed")
    assert np.asarray(ref).tobytes() == np.asarray(routed_experts_reference(x, ids, wts, wgu, wd)).tobytes()
    with pytest.raises(ValueError, match="no config"):
        routed_experts(x, ids, wts, wgu, wd, impl="interpret", path="gemv_fixed", config=MoEGemvConfig())
    with pytest.raises(ValueError, match="expert_ids"):
        routed_experts(x, ids[:1], wts, wgu, wd, impl="interpret", path="gemv_fixed")
