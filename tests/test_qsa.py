"""QSA equals dense causal attention while at most budget + ratio - 1 tokens are visible, and differs beyond."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flashnext_jax.qsa import qsa_forward as _qsa_forward
from flashnext_jax.weights import random_params
from tiny_configs import tiny_config

qsa_forward = jax.jit(_qsa_forward, static_argnums=1)


def test_qsa_is_dense_below_budget_and_sparse_beyond():
    cfg = tiny_config()  # budget 8, ratio 4: dense while <= 11 tokens are visible
    params = random_params(cfg, 0, jnp.float32)
    layer = params["layers"][cfg.qsa_layers[0]]["self_attn"]
    layer = jax.tree.map(lambda x: x * 30, layer)  # sharp scores so sparse and dense differ clearly
    t = 40
    u = jax.random.normal(jax.random.key(1), (1, t, cfg.hidden_size))
    positions = jnp.arange(t)[None]
    valid = jnp.ones((1, t), bool)
    cache = (jnp.zeros((1, t, cfg.num_key_value_heads, cfg.head_dim)),) * 2 + (jnp.zeros((1, t, 16)),)
    sparse, _ = qsa_forward(layer, cfg, u, positions, valid, cache)
    dense_cfg = dataclasses.replace(cfg, indexer_budget=None)
    dense, _ = qsa_forward(layer, dense_cfg, u, positions, valid, cache)
    sparse, dense = np.asarray(sparse[0]), np.asarray(dense[0])
    limit = cfg.indexer_budget + cfg.indexer_compress_ratio - 1
    np.testing.assert_allclose(sparse[:limit], dense[:limit], rtol=1e-5, atol=2e-5)
    diff = np.abs(sparse[limit:] - dense[limit:]).max(axis=-1)
    assert (diff > 1e-3).mean() > 0.5, diff


def test_qsa_incremental_decode_equals_prefill():
    cfg = tiny_config()
    params = random_params(cfg, 2, jnp.float32)
    layer = jax.tree.map(lambda x: x * 30, params["layers"][cfg.qsa_layers[0]]["self_attn"])
    t = 30
    u = jax.random.normal(jax.random.key(3), (1, t, cfg.hidden_size))
    empty = (jnp.zeros((1, 32, cfg.num_key_value_heads, cfg.head_dim)),) * 2 + (jnp.zeros((1, 32, 16)),)
    full, _ = qsa_forward(layer, cfg, u, jnp.arange(t)[None], jnp.ones((1, t), bool), empty)
    cache = empty
    _, cache = qsa_forward(layer, cfg, u[:, :10], jnp.arange(10)[None], jnp.ones((1, 10), bool), cache)
    for p in range(10, t):
        y, cache = qsa_forward(layer, cfg, u[:, p : p + 1], jnp.array([[p]]), jnp.ones((1, 1), bool), cache)
        np.testing.assert_allclose(np.asarray(y[0, 0]), np.asarray(full[0, p]), rtol=1e-5, atol=2e-5)
