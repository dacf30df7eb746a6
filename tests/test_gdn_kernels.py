"""Gated delta rule: references and Pallas kernels (interpret mode) against a float64 numpy recurrence."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gdn_kernels, gdn_layout, gdn_reference

jax.config.update("jax_enable_x64", False)

HK, HV, DK, DV = 2, 6, 32, 32  # Hv = 3 Hk like the real model, scaled-down head dims
SCALE = DK ** -0.5


# ---------------------------------------------------------------------------------------------------------
# float64 numpy oracle
# ---------------------------------------------------------------------------------------------------------
def np_l2(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def np_recurrence(q, k, v, g, beta, S0, scale, l2):
    """One sequence. q,k [T,Hk,Dk]; v [T,Hv,Dv]; g,beta [T,Hv]; S0 [Hv,Dk,Dv]. Returns o, states after each."""
    q, k, v, g, beta, S = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, S0))
    if l2:
        q, k = np_l2(q), np_l2(k)
    q = q * scale
    r = v.shape[1] // q.shape[1]
    q, k = np.repeat(q, r, 1), np.repeat(k, r, 1)
    os_, states = [], []
    for t in range(q.shape[0]):
        S = S * np.exp(g[t])[:, None, None]
        kv = np.einsum("hk,hkv->hv", k[t], S)
        S = S + k[t][:, :, None] * (beta[t][:, None] * (v[t] - kv))[:, None, :]
        os_.append(np.einsum("hk,hkv->hv", q[t], S))
        states.append(S.copy())
    return np.array(os_).reshape(-1, *v.shape[1:]), np.array(states).reshape(-1, *S.shape)


def make_inputs(rng, B, T, decay="mixed", beta_mode="mixed", dtype=np.float32):
    q = rng.standard_normal((B, T, HK, DK)).astype(np.float32)
    k = rng.standard_normal((B, T, HK, DK)).astype(np.float32)
    v = rng.standard_normal((B, T, HV, DV)).astype(np.float32)
    if decay == "none":
        g = -rng.uniform(0, 1e-4, (B, T, HV))
    elif decay == "strong":
        g = -rng.uniform(1.0, 6.0, (B, T, HV))
    else:  # per head: from ~0 to strong
        g = -np.exp(rng.uniform(-9, 1.5, (1, 1, HV))) * rng.uniform(0.5, 1.0, (B, T, HV))
    if beta_mode == "ends":
        beta = np.where(rng.random((B, T, HV)) < 0.5, rng.uniform(0, 1e-3, (B, T, HV)),
                        1 - rng.uniform(0, 1e-3, (B, T, HV)))
    else:
        beta = rng.uniform(0, 1, (B, T, HV))
    return q, k, v, g.astype(np.float32), beta.astype(np.float32)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite output"
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


# ---------------------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("decay,beta_mode,l2", [("mixed", "mixed", True), ("none", "ends", True),
                                                  ("strong", "ends", True), ("mixed", "mixed", False)])
def test_reference_chunk_and_recurrent(decay, beta_mode, l2):
    rng = np.random.default_rng(0)
    B, T = 2, 150
    q, k, v, g, beta = make_inputs(rng, B, T, decay, beta_mode)
    if not l2:  # keep the unnormalised recurrence bounded
        q, k = np_l2(q) * 0.9, np_l2(k) * 0.9
    S0 = rng.standard_normal((B, HV, DK, DV)).astype(np.float32)
    o_c, S_c = gdn_reference.chunk_gated_delta_rule(q, k, v, g, beta, scale=SCALE, initial_state=S0,
                                                    use_qk_l2norm=l2)
    o_r, S_r = gdn_reference.recurrent_gated_delta_rule(q, k, v, g, beta, scale=SCALE, initial_state=S0,
                                                        use_qk_l2norm=l2)
    for b in range(B):
        o64, st64 = np_recurrence(q[b], k[b], v[b], g[b], beta[b], S0[b], SCALE, l2)
        assert rel_err(o_c[b], o64) < 1e-4
        assert rel_err(S_c[b], st64[-1]) < 1e-4
        assert rel_err(o_r[b], o64) < 1e-5
        assert rel_err(S_r[b], st64[-1]) < 1e-5


LENS = [1, 63, 64, 65, 300]


def varlen_case(rng, lens=LENS, num_slots=11, k1=2, extra_tokens=3):
    N = len(lens)
    T = sum(lens) + extra_tokens
    q, k, v, g, beta = make_inputs(rng, 1, T)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    slots = rng.permutation(num_slots)[:N].astype(np.int32)
    slots[2] = -1  # one padding sequence
    read_col = rng.integers(0, k1, N).astype(np.int32)
    has_init = np.array([True, False, True, True, True])[:N]
    state = rng.standard_normal((num_slots, k1, HV, DK, DV)).astype(np.float32)
    used = {int(s) for s in slots if s >= 0}
    for s in range(num_slots):
        if s not in used:
            state[s] = np.nan  # poisoned unused slots
    return dict(q=q, k=k, v=v, g=g, beta=beta, cu=cu, slots=slots, read_col=read_col, has_init=has_init,
                state=state)


def check_varlen(c, o, new_state, tol):
    o, new_state = np.asarray(o), np.asarray(new_state)
    state = c["state"]
    cu, slots = c["cu"], c["slots"]
    expect = state.copy()
    for n in range(len(slots)):
        a, b = cu[n], cu[n + 1]
        s = slots[n]
        if s < 0:
            S0 = np.zeros((HV, DK, DV))
        else:
            S0 = state[s, c["read_col"][n]] if c["has_init"][n] else np.zeros((HV, DK, DV))
        o64, st64 = np_recurrence(c["q"][0, a:b], c["k"][0, a:b], c["v"][0, a:b], c["g"][0, a:b],
                                  c["beta"][0, a:b], S0, SCALE, True)
        assert rel_err(o[0, a:b], o64) < tol, n
        if s >= 0:
            expect[s, 0] = st64[-1]
    # written columns match, everything else bit-identical (NaN poison included)
    assert np.array_equal(np.isnan(new_state), np.isnan(expect))
    for s in range(state.shape[0]):
        for col in range(state.shape[1]):
            if s in set(slots.tolist()) and col == 0:
                assert rel_err(new_state[s, col], expect[s, col]) < tol
            else:
                np.testing.assert_array_equal(new_state[s, col], state[s, col])
    assert np.all(o[0, cu[-1]:] == 0)


def test_reference_varlen_slots():
    c = varlen_case(np.random.default_rng(1))
    o, st = gdn_reference.chunk_gated_delta_rule_varlen(
        c["q"], c["k"], c["v"], c["g"], c["beta"], cu_seqlens=jnp.asarray(c["cu"]), state=jnp.asarray(c["state"]),
        slots=jnp.asarray(c["slots"]), read_col=jnp.asarray(c["read_col"]),
        has_initial_state=jnp.asarray(c["has_init"]), scale=SCALE, use_qk_l2norm=True)
    check_varlen(c, o, st, 1e-4)


def decode_case(rng, B=5, T=2, k1=3, num_slots=9):
    q, k, v, g, beta = make_inputs(rng, B, T, beta_mode="ends")
    slots = rng.permutation(num_slots)[:B].astype(np.int32)
    slots[1] = -1
    read_col = rng.integers(0, k1, B).astype(np.int32)
    state = rng.standard_normal((num_slots, k1, HV, DK, DV)).astype(np.float32)
    for s in set(range(num_slots)) - {int(x) for x in slots}:
        state[s] = np.nan
    return dict(q=q, k=k, v=v, g=g, beta=beta, slots=slots, read_col=read_col, state=state)


def check_decode(c, o, new_state, tol):
    o, new_state = np.asarray(o), np.asarray(new_state)
    state, slots = c["state"], c["slots"]
    T = c["q"].shape[1]
    expect = state.copy()
    for b, s in enumerate(slots):
        if s < 0:
            assert np.all(o[b] == 0)
            continue
        o64, st64 = np_recurrence(c["q"][b], c["k"][b], c["v"][b], c["g"][b], c["beta"][b],
                                  state[s, c["read_col"][b]], SCALE, True)
        assert rel_err(o[b], o64) < tol
        for t in range(T):
            assert rel_err(new_state[s, t], st64[t]) < tol  # checkpoint after token t
            expect[s, t] = new_state[s, t]
    np.testing.assert_array_equal(new_state, expect)  # untouched elsewhere, NaN poison kept


@pytest.mark.parametrize("T", [1, 2, 3])
def test_reference_decode_slots(T):
    c = decode_case(np.random.default_rng(2 + T), T=T)
    o, st = gdn_reference.recurrent_gated_delta_rule_slots(
        c["q"], c["k"], c["v"], c["g"], c["beta"], state=jnp.asarray(c["state"]), slots=jnp.asarray(c["slots"]),
        read_col=jnp.asarray(c["read_col"]), scale=SCALE, use_qk_l2norm=True)
    check_decode(c, o, st, 1e-5)


# ---------------------------------------------------------------------------------------------------------
# Pallas kernels in interpret mode
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,k1", [(1, 1), (2, 2), (3, 4)])
def test_decode_kernel_interpret(T, k1):
    from pallas_kernels.gdn_decode import recurrent_gated_delta_rule_slots_pallas
    c = decode_case(np.random.default_rng(10 + T), T=T, k1=k1)
    st = jnp.asarray(c["state"])
    if k1 == 1:
        st = st[:, 0]
    o, st = recurrent_gated_delta_rule_slots_pallas(
        jnp.asarray(c["q"], jnp.bfloat16).astype(jnp.float32), c["k"], c["v"], c["g"], c["beta"], state=st,
        slots=jnp.asarray(c["slots"]), read_col=jnp.asarray(c["read_col"]), scale=SCALE, use_qk_l2norm=True,
        interpret=True, block_v=16)
    c["q"] = np.asarray(jnp.asarray(c["q"], jnp.bfloat16).astype(jnp.float32))
    st = np.asarray(st)
    if k1 == 1:
        st = st[:, None]
    check_decode(c, o, st, 1e-5)


PREFILL_VARIANTS = ["wide", "base"]  # gdn_prefill.VARIANTS, the default first


@pytest.mark.parametrize("variant", PREFILL_VARIANTS)
def test_prefill_kernel_varlen_interpret(variant):
    from pallas_kernels.gdn_prefill import chunk_gated_delta_rule_varlen_pallas
    c = varlen_case(np.random.default_rng(20))
    o, st = chunk_gated_delta_rule_varlen_pallas(
        c["q"], c["k"], c["v"], c["g"], c["beta"], cu_seqlens=jnp.asarray(c["cu"]), state=jnp.asarray(c["state"]),
        slots=jnp.asarray(c["slots"]), read_col=jnp.asarray(c["read_col"]),
        has_initial_state=jnp.asarray(c["has_init"]), scale=SCALE, use_qk_l2norm=True, interpret=True,
        block_v=16, variant=variant)
    o = np.array(o)
    o[0, c["cu"][-1]:] = 0  # unspecified past the last sequence in the Pallas path
    check_varlen(c, o, st, 2e-4)


@pytest.mark.parametrize("variant", PREFILL_VARIANTS)
@pytest.mark.parametrize("decay,beta_mode", [("none", "ends"), ("strong", "mixed")])
def test_prefill_kernel_batch_interpret(decay, beta_mode, variant):
    from pallas_kernels.gdn_prefill import chunk_gated_delta_rule_pallas
    rng = np.random.default_rng(30)
    B, T = 2, 130
    q, k, v, g, beta = make_inputs(rng, B, T, decay, beta_mode)
    S0 = rng.standard_normal((B, HV, DK, DV)).astype(np.float32)
    if variant == PREFILL_VARIANTS[0]:  # the default, through the public switch
        o, S = gdn_kernels.chunk_gated_delta_rule(q, k, v, g, beta, scale=SCALE, initial_state=jnp.asarray(S0),
                                                  use_qk_l2norm=True, impl="interpret")
    else:
        o, S = chunk_gated_delta_rule_pallas(q, k, v, g, beta, scale=SCALE, initial_state=jnp.asarray(S0),
                                             use_qk_l2norm=True, interpret=True, variant=variant)
    for b in range(B):
        o64, st64 = np_recurrence(q[b], k[b], v[b], g[b], beta[b], S0[b], SCALE, True)
        assert rel_err(o[b], o64) < 2e-4
        assert rel_err(S[b], st64[-1]) < 2e-4


# ---------------------------------------------------------------------------------------------------------
# the engine store's layout: one [num_slots, K1, L, Hv, Dk, Dv] leaf for all GDN layers, addressed in place
# ---------------------------------------------------------------------------------------------------------
def in_store(rng, state, layer, n_layers=3):
    """Embed a [ns, K1, Hv, Dk, Dv] case as layer `layer` of an all-layer leaf; other layers random + NaN."""
    full = rng.standard_normal(state.shape[:2] + (n_layers,) + state.shape[2:]).astype(np.float32)
    full[::2, :, :] = np.nan  # poison some slots of every layer
    full[:, :, layer] = state
    return full


def check_other_layers(full_in, full_out, layer):
    keep = [i for i in range(full_in.shape[2]) if i != layer]
    np.testing.assert_array_equal(np.asarray(full_out)[:, :, keep], full_in[:, :, keep])


@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_decode_addresses_one_layer_of_the_store_leaf(impl):
    rng = np.random.default_rng(40)
    c = decode_case(rng, T=2, k1=3)
    layer = 1
    full = in_store(rng, c["state"], layer)
    o, st = gdn_kernels.recurrent_gated_delta_rule_slots(
        c["q"], c["k"], c["v"], c["g"], c["beta"], state=jnp.asarray(full), slots=jnp.asarray(c["slots"]),
        read_col=jnp.asarray(c["read_col"]), scale=SCALE, use_qk_l2norm=True, impl=impl, layer=layer)
    check_decode(c, o, np.asarray(st)[:, :, layer], 1e-5)
    check_other_layers(full, st, layer)


@pytest.mark.parametrize("impl", ["reference", "interpret"] + [f"interpret:{v}" for v in PREFILL_VARIANTS[1:]])
def test_prefill_addresses_one_layer_of_the_store_leaf(impl):
    from pallas_kernels.gdn_prefill import chunk_gated_delta_rule_varlen_pallas
    rng = np.random.default_rng(41)
    c = varlen_case(rng, lens=[1, 65, 7], k1=2)
    layer = 2
    full = in_store(rng, c["state"], layer)
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"])
    kw = dict(cu_seqlens=jnp.asarray(c["cu"]), state=jnp.asarray(full), slots=jnp.asarray(c["slots"]),
              read_col=jnp.asarray(c["read_col"]), has_initial_state=jnp.asarray(c["has_init"]), scale=SCALE,
              use_qk_l2norm=True, layer=layer)
    if impl.startswith("interpret:"):  # a non-default kernel variant, called directly
        o, st = chunk_gated_delta_rule_varlen_pallas(*args, interpret=True, variant=impl.split(":")[1], **kw)
    else:
        o, st = gdn_kernels.chunk_gated_delta_rule_varlen(*args, impl=impl, **kw)
    o = np.array(o)
    o[0, c["cu"][-1]:] = 0  # unspecified past the last sequence in the Pallas path
    check_varlen(c, o, np.asarray(st)[:, :, layer], 2e-4)
    check_other_layers(full, st, layer)


def test_layer_needs_the_all_layer_leaf():
    with pytest.raises(ValueError, match="num_slots, K1, L"):
        gdn_layout.flat_state(jnp.zeros((2, 1, 4, 8, 8)), layer=0)
    with pytest.raises(ValueError, match="out of range"):
        gdn_layout.flat_state(jnp.zeros((2, 1, 3, 4, 8, 8)), layer=3)


# ---------------------------------------------------------------------------------------------------------
# causal conv1d (kernel 4) + SiLU
# ---------------------------------------------------------------------------------------------------------
def np_conv(x, w, init):
    """One sequence: x [L, C], w [C, W], init [W-1, C] -> y [L, C] (silu), windows after each token."""
    W = w.shape[1]
    buf = np.concatenate([init, x]).astype(np.float64)
    ys, wins = [], []
    for t in range(x.shape[0]):
        seg = buf[t:t + W]  # [W, C]
        y = (seg * w.T).sum(0)
        ys.append(y / (1 + np.exp(-y)))
        wins.append(buf[t + 1:t + W].copy())
    return np.array(ys).reshape(-1, x.shape[1]), wins


def test_conv_varlen_reference():
    from pallas_kernels.causal_conv1d import causal_conv1d_varlen
    rng = np.random.default_rng(40)
    Cch, W, k1, ns = 24, 4, 2, 7
    lens = [1, 2, 3, 5, 70]
    T = sum(lens) + 2
    x = rng.standard_normal((T, Cch)).astype(np.float32)
    w = rng.standard_normal((Cch, W)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    slots = rng.permutation(ns)[:len(lens)].astype(np.int32)
    slots[3] = -1
    rc = rng.integers(0, k1, len(lens)).astype(np.int32)
    hinit = np.array([True, True, False, True, True])
    st = rng.standard_normal((ns, k1, W - 1, Cch)).astype(np.float32)
    y, new = causal_conv1d_varlen(jnp.asarray(x), jnp.asarray(w), cu_seqlens=jnp.asarray(cu),
                                  conv_state=jnp.asarray(st), slots=jnp.asarray(slots), read_col=jnp.asarray(rc),
                                  has_initial_state=jnp.asarray(hinit))
    y, new = np.asarray(y), np.asarray(new)
    expect = st.copy()
    for n, L in enumerate(lens):
        s = slots[n]
        init = st[s, rc[n]] if (s >= 0 and hinit[n]) else np.zeros((W - 1, Cch))
        y64, wins = np_conv(x[cu[n]:cu[n + 1]], w, init)
        assert rel_err(y[cu[n]:cu[n + 1]], y64) < 1e-5
        if s >= 0:
            expect[s, 0] = wins[-1]
    np.testing.assert_allclose(new, expect, rtol=1e-6)
    assert np.all(y[cu[-1]:] == 0)


@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_conv_update(impl):
    from pallas_kernels.causal_conv1d import causal_conv1d_update
    rng = np.random.default_rng(41)
    B, T, Cch, W, k1, ns = 4, 2, 64, 4, 2, 9
    x = rng.standard_normal((B, T, Cch)).astype(np.float32)
    w = rng.standard_normal((Cch, W)).astype(np.float32)
    slots = rng.permutation(ns)[:B].astype(np.int32)
    slots[2] = -1
    rc = rng.integers(0, k1, B).astype(np.int32)
    st = rng.standard_normal((ns, k1, W - 1, Cch)).astype(np.float32)
    for s in set(range(ns)) - {int(a) for a in slots}:
        st[s] = np.nan
    y, new = causal_conv1d_update(jnp.asarray(x), jnp.asarray(w), conv_state=jnp.asarray(st),
                                  slots=jnp.asarray(slots), read_col=jnp.asarray(rc), impl=impl)
    y, new = np.asarray(y), np.asarray(new)
    expect = st.copy()
    for b, s in enumerate(slots):
        if s < 0:
            assert np.all(y[b] == 0)
            continue
        y64, wins = np_conv(x[b], w, st[s, rc[b]])
        assert rel_err(y[b], y64) < 1e-5
        for t in range(T):
            expect[s, t] = wins[t]
    np.testing.assert_allclose(new, expect, rtol=1e-6)
    assert np.array_equal(np.isnan(new), np.isnan(expect))
