"""Gated delta rule: the chunked (WY) form and the recurrent form against a float64 numpy loop."""

import jax
import numpy as np
import pytest

from flashnext_jax.gdn import delta_rule_chunked, delta_rule_recurrent, l2_normalize


def numpy_delta_rule(q, k, v, g, beta, state):
    q, k, v, g, beta, s = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, state))
    b, t, h, _ = q.shape
    out = np.zeros((b, t, h, v.shape[-1]))
    s = s.copy()
    for i in range(t):
        s = s * np.exp(g[:, i])[..., None, None]
        mem = np.einsum("bhkv,bhk->bhv", s, k[:, i])
        s = s + k[:, i][..., None] * ((v[:, i] - mem) * beta[:, i][..., None])[..., None, :]
        out[:, i] = np.einsum("bhkv,bhk->bhv", s, q[:, i])
    return out, s


def random_inputs(key, b, t, h, dk, dv, decay_scale):
    ks = jax.random.split(key, 6)
    q = l2_normalize(jax.random.normal(ks[0], (b, t, h, dk))) * dk**-0.5
    k = l2_normalize(jax.random.normal(ks[1], (b, t, h, dk)))
    v = jax.random.normal(ks[2], (b, t, h, dv))
    g = -decay_scale * jax.random.uniform(ks[3], (b, t, h))
    beta = jax.random.uniform(ks[4], (b, t, h))
    s0 = jax.random.normal(ks[5], (b, h, dk, dv)) * 0.5
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("t", [1, 63, 64, 65, 150])
@pytest.mark.parametrize("decay_scale", [1e-3, 8.0])
def test_chunked_and_recurrent_equal_sequential(t, decay_scale):
    args = random_inputs(jax.random.key(t), 2, t, 3, 16, 8, decay_scale)
    ref_o, ref_s = numpy_delta_rule(*args)
    for rule in (delta_rule_recurrent, delta_rule_chunked):
        o, s = jax.jit(rule)(*args)
        np.testing.assert_allclose(np.asarray(o), ref_o, rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(np.asarray(s), ref_s, rtol=2e-4, atol=2e-5)


def test_padding_tokens_with_zero_decay_and_beta_leave_the_state_unchanged():
    q, k, v, g, beta, s0 = random_inputs(jax.random.key(7), 1, 70, 2, 8, 8, 1.0)
    g = g.at[:, 50:].set(0.0)
    beta = beta.at[:, 50:].set(0.0)
    _, s_full = delta_rule_chunked(q, k, v, g, beta, s0)
    _, s_50 = delta_rule_recurrent(q[:, :50], k[:, :50], v[:, :50], g[:, :50], beta[:, :50], s0)
    np.testing.assert_allclose(np.asarray(s_full), np.asarray(s_50), rtol=1e-5, atol=1e-6)
