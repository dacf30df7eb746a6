"""layers.linear on plain weights: the small-M multiply + reduce path and the dot path agree with float64."""

import jax.numpy as jnp
import numpy as np
import pytest

from flashnext_jax import layers


@pytest.mark.parametrize("lead,out_features", [((1,), 33), ((2, 1), 96), ((8,), 4), ((9,), 33), ((2,), 600)])
def test_plain_linear_matches_float64(lead, out_features, monkeypatch):
    monkeypatch.setattr(layers, "SMALL_DOT_MAX_WEIGHTS", 40_000)  # 600 x 256 takes the dot path
    rng = np.random.default_rng(sum(lead) + out_features)
    x = jnp.asarray(rng.standard_normal((*lead, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((out_features, 256)) * 0.05, jnp.bfloat16)  # [out, in]
    y = layers.linear(x, w)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    assert y.dtype == x.dtype and y.shape == (*lead, out_features)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=5e-3, atol=1e-4)
