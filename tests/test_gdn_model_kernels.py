"""gdn_forward through the GDN Pallas kernels (interpret mode on CPU) against its pure-JAX reference path.

The mode is read from FLASHNEXT_KERNELS when gdn_forward traces, so every call here is un-jitted (the kernel entry
points jit themselves with `interpret` static, so a reference trace is never reused for a kernel run).
"""

import jax.numpy as jnp
import numpy as np
import pytest

from tiny_configs import tiny_config

from flashnext_jax import gdn
from flashnext_jax.config import GDN
from flashnext_jax.weights import random_params
from pallas_kernels import fixed_order, gdn_kernels

CFG = tiny_config()
KERNEL_ENTRY_POINTS = ("chunk_gated_delta_rule", "recurrent_gated_delta_rule_slots", "chunk_gated_delta_rule_varlen")


def _gdn_params(dtype=jnp.float32):
    params = random_params(CFG, seed=3, dtype=dtype, scale=0.3, with_mtp=False)
    return params["layers"][CFG.layer_types.index(GDN)]["linear_attn"]


P32 = _gdn_params()


def make_inputs(seed, n_valid, t, dtype=jnp.float32):
    """u [B, T, H], non-zero conv/rec states, right-padded rows with n_valid valid tokens."""
    b = len(n_valid)
    rng = np.random.default_rng(seed)
    conv_dim = CFG.gdn_conv_dim
    u = rng.standard_normal((b, t, CFG.hidden_size), np.float32)
    conv = rng.standard_normal((b, CFG.linear_conv_kernel_dim - 1, conv_dim), np.float32)
    rec = 0.5 * rng.standard_normal(
        (b, CFG.linear_num_value_heads, CFG.linear_key_head_dim, CFG.linear_value_head_dim), np.float32)
    n_valid = jnp.asarray(n_valid, jnp.int32)
    valid = jnp.arange(t)[None, :] < n_valid[:, None]
    return jnp.asarray(u, dtype), jnp.asarray(conv, dtype), jnp.asarray(rec), valid, n_valid


def run(monkeypatch, mode, p, inputs, ends=None):
    monkeypatch.setenv("FLASHNEXT_KERNELS", mode)
    return gdn.gdn_forward(p, CFG, *inputs, ends=ends)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def assert_close(got, want, tol, n_valid=None):
    """Outputs compared at each row's valid tokens when n_valid is given: a padding token's output is never read,
    and the two paths compute it from different states (the reference: after the row's last token)."""
    if n_valid is not None:
        mask = (np.arange(got[0].shape[1])[None, :] < np.asarray(n_valid)[:, None])[..., None]
        got, want = (np.where(mask, got[0], 0),) + tuple(got[1:]), (np.where(mask, want[0], 0),) + tuple(want[1:])
    for name, a, b in zip(("y", "conv", "rec"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        assert np.all(np.isfinite(np.asarray(a, np.float32))), name
        err = rel_err(a, b)
        assert err <= tol, (name, err)


def runner_ends(n_valid, k1):
    """The engine's checkpoint columns (runner.step): token counts base+1 .. base+K1, base = max(n_valid - K1, 0)."""
    base = jnp.maximum(n_valid - k1, 0)
    return base[:, None] + 1 + jnp.arange(k1)[None, :]


# fp32 interpret: the kernels compute in fp32, so only summation order differs (observed max 3e-7 on these inputs)
TOL = 3e-6


@pytest.mark.parametrize("t,n_valid", [(1, [1, 0, 1]), (2, [2, 1, 0]), (5, [5, 3, 1]), (70, [70, 65, 13])])
def test_dense_state_path_matches_reference(monkeypatch, t, n_valid):
    inputs = make_inputs(t, n_valid, t)
    want = run(monkeypatch, "reference", P32, inputs)
    got = run(monkeypatch, "interpret", P32, inputs)
    assert_close(got, want, TOL, inputs[4])
    # padding rows keep the state of their last valid token: a row with no valid token keeps its state exactly
    # up to the kernels' arithmetic, and rec moved for rows that saw tokens
    rec0 = np.asarray(inputs[2])
    for b, n in enumerate(n_valid):
        moved = rel_err(got[2][b], rec0[b])
        assert (moved <= TOL) if n == 0 else (moved > 1e-2), (b, n, moved)


@pytest.mark.parametrize("t,k1,n_valid", [(2, 2, [2, 1, 0]), (3, 3, [3, 2, 1]), (5, 2, [5, 1, 3]),
                                          (70, 3, [70, 2, 40])])
def test_checkpoint_columns_match_reference(monkeypatch, t, k1, n_valid):
    inputs = make_inputs(100 + t, n_valid, t)
    ends = runner_ends(inputs[4], k1)
    want = run(monkeypatch, "reference", P32, inputs, ends)
    got = run(monkeypatch, "interpret", P32, inputs, ends)
    assert got[2].shape == (len(n_valid), k1) + inputs[2].shape[1:]
    assert_close(got, want, TOL, inputs[4])
    # the columns are distinct states (a mix-up of columns would be caught by the comparison above, not hidden)
    b0 = int(np.argmax(n_valid))
    assert rel_err(got[2][b0, 0], got[2][b0, k1 - 1]) > 1e-2


def test_checkpoint_columns_with_arbitrary_bases(monkeypatch):
    """Bases other than the runner's (any base with base + K1 <= T): head through the chunked kernel, tail decode.
    (Same shapes as the T=70, K1=3 case above, so no new kernel compiles.)"""
    t, k1 = 70, 3
    # each row's valid tokens end at base + K1 (as the runner's) or before it (row 2: a tail of identity tokens);
    # columns before a row's last whole 64-token chunk ends are not defined (gdn.delta_rule_absolute)
    inputs = make_inputs(7, [53, 3, 60], t)
    base = jnp.asarray([50, 0, 67], jnp.int32)
    ends = base[:, None] + 1 + jnp.arange(k1)[None, :]
    want = run(monkeypatch, "reference", P32, inputs, ends)
    got = run(monkeypatch, "interpret", P32, inputs, ends)
    assert_close(got, want, TOL, inputs[4])


def test_bf16_activations_through_the_kernels(monkeypatch):
    """bf16 activations (the GPU case): the kernel path returns bf16 outputs and agrees with the reference to bf16
    rounding. Checkpoint columns with head tokens, so both kernels run."""
    p16 = _gdn_params(jnp.bfloat16)
    inputs = make_inputs(11, [5, 2, 4], 5, jnp.bfloat16)
    ends = runner_ends(inputs[4], 2)
    want = run(monkeypatch, "reference", p16, inputs, ends)
    got = run(monkeypatch, "interpret", p16, inputs, ends)
    assert got[0].dtype == jnp.bfloat16 and got[2].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32))  # XLA conv
    assert rel_err(got[2], want[2]) <= 1e-5  # fp32 states from the same bf16 q/k/v
    valid = inputs[3][..., None]  # a padding token's output is never read
    assert rel_err(jnp.where(valid, got[0], 0), jnp.where(valid, want[0], 0)) <= 1e-2  # a bf16 rounding apart


class KernelCalled(Exception):
    pass


def forbid_kernels(monkeypatch):
    def boom(*args, **kwargs):
        raise KernelCalled
    for name in KERNEL_ENTRY_POINTS:
        monkeypatch.setattr(gdn_kernels, name, boom)


@pytest.mark.parametrize("t,k1", [(2, None), (70, None), (5, 2)])
def test_fp32_stays_bit_identical_on_the_reference_path(monkeypatch, t, k1):
    """fp32 activations under "pallas" (bf16 tensor-core kernels would break the fp32 parity with transformers)
    run the pure-JAX path of "reference" bit for bit and never touch a kernel entry point."""
    forbid_kernels(monkeypatch)
    inputs = make_inputs(200 + t, [t, t - 1], t)
    ends = None if k1 is None else runner_ends(inputs[4], k1)
    want = run(monkeypatch, "reference", P32, inputs, ends)
    got = run(monkeypatch, "pallas", P32, inputs, ends)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("t,k1,entry", [(70, None, "chunk_gated_delta_rule"), (1, None, "recurrent_gated_delta_rule_slots"),
                                        (2, 2, "recurrent_gated_delta_rule_slots"),
                                        (5, 2, "chunk_gated_delta_rule_varlen")])  # head tokens: the store path
def test_pallas_with_bf16_activations_uses_the_kernels(monkeypatch, t, k1, entry):
    """On GPU ("pallas", bf16) the delta rule must go to the kernels: the first entry point reached is `entry`."""
    forbid_kernels(monkeypatch)
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("impl"))
        raise KernelCalled

    monkeypatch.setattr(gdn_kernels, entry, spy)
    p16 = _gdn_params(jnp.bfloat16)
    inputs = make_inputs(300 + t, [t], t, jnp.bfloat16)
    ends = None if k1 is None else runner_ends(inputs[4], k1)
    # batch invariance off (as `--no-batch-invariant`); on, the projections would
    # take the Pallas dense_matmul, which this CPU cannot run un-interpreted
    with fixed_order.batch_invariant(False), pytest.raises(KernelCalled):
        run(monkeypatch, "pallas", p16, inputs, ends)
    assert seen == ["pallas"]
