"""Sparse QSA over the paged store (qsa_paged.py) equals the dense oracle (qsa.qsa_forward) where the budget binds.

Tiny config with budget 16 and ratio 4 (dense only while <= 19 tokens are visible), fp32, prompts of 150-2,000
tokens processed in chunks whose boundaries fall inside blocks and pages, page sizes 4, 16 and 64, pages of a row
scattered over the pool, several rows in one batch. Every chunk's outputs must equal the dense one-shot forward.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashnext_jax.qsa import qsa_forward
from flashnext_jax.qsa_paged import PagedKV, qsa_paged_forward
from flashnext_jax.weights import random_params
from tiny_configs import tiny_config

CFG = tiny_config(indexer_budget=16, indexer_n_heads=8)
PARAMS = jax.tree.map(lambda x: x * 30, random_params(CFG, 0, jnp.float32)["layers"][CFG.qsa_layers[0]]["self_attn"])
N_QSA, LAYER = 2, 1  # the pools hold two QSA layers; this one is the second


def dense(u, cfg=CFG, params=PARAMS):
    t = u.shape[1]
    L = -(-t // 4) * 4
    cache = (jnp.zeros((u.shape[0], L, CFG.num_key_value_heads, CFG.head_dim)),) * 2 + (jnp.zeros((u.shape[0], L, 16)),)
    pos = jnp.broadcast_to(jnp.arange(t), u.shape[:2])
    y, _ = jax.jit(qsa_forward, static_argnums=1)(params, cfg, u, pos, jnp.ones(u.shape[:2], bool), cache)
    return np.asarray(y)


@functools.partial(jax.jit, static_argnames=("cfg", "layer", "score_elements", "query_tile"))
def paged_step(params, cfg, kp, vp, ip, bp, page_table, u, positions, valid, layer, score_elements, query_tile):
    kv = PagedKV(kp, vp, ip, bp, page_table, valid, layer, score_elements)
    y, kv = qsa_paged_forward(params, cfg, u, positions, valid, kv, query_tile=query_tile)
    return y, kv.k, kv.v, kv.index, kv.block_keys


def pools(n_pages, page_size):
    """K, V, raw index key and block-key pools (one block key per 4 tokens), all poisoned: nothing unwritten may
    be read."""
    nan = lambda rows, *s: jnp.full((n_pages + 1, rows, N_QSA, *s), jnp.nan, jnp.float32)
    kv = (CFG.num_key_value_heads, CFG.head_dim)
    return nan(page_size, *kv), nan(page_size, *kv), nan(page_size, 16), nan(page_size // 4, 16)


def run_paged(u, lengths, chunks, page_size, score_elements=1 << 24, query_tile=128, seed=0, cfg=CFG,
              params=PARAMS):
    """Rows of u [B, T, H] with lengths[b] real tokens, fed in chunk sizes `chunks` (the last repeats)."""
    b, t, _ = u.shape
    per_row = -(-t // page_size)
    mp = 1 << (per_row - 1).bit_length()
    rng = np.random.default_rng(seed)
    ids = rng.permutation(b * per_row + 3)[: b * per_row].reshape(b, per_row)  # rows' pages scattered
    table = np.full((b, mp), -1, np.int32)
    table[:, :per_row] = ids
    kp, vp, ip, bp = pools(b * per_row + 3, page_size)
    out = np.zeros(u.shape[:2] + (u.shape[2],), np.float32)
    start, i = 0, 0
    while start < max(lengths):
        c = chunks[min(i, len(chunks) - 1)]
        pos = start + jnp.arange(c)[None, :].repeat(b, 0)
        valid = pos < jnp.asarray(lengths)[:, None]
        piece = jnp.take(u, jnp.minimum(pos, t - 1), axis=1)[0] if b == 1 else jnp.stack(
            [u[r, jnp.minimum(pos[r], t - 1)] for r in range(b)])
        piece = piece.reshape(b, c, -1)
        y, kp, vp, ip, bp = paged_step(params, cfg, kp, vp, ip, bp, jnp.asarray(table), piece, pos, valid, LAYER,
                                       score_elements, query_tile)
        y = np.asarray(y)
        for r in range(b):
            n = int(np.clip(lengths[r] - start, 0, c))
            out[r, start : start + n] = y[r, :n]
        start += c
        i += 1
    return out


def u_of(b, t, seed=1):
    return jax.random.normal(jax.random.key(seed), (b, t, CFG.hidden_size))


def rel(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


def test_budget_binds_so_sparse_differs_from_dense_attention():
    u = u_of(1, 150)
    full = dense(u)
    no_budget = dataclasses.replace(CFG, indexer_budget=None)
    cache = (jnp.zeros((1, 152, 2, 16)),) * 2 + (jnp.zeros((1, 152, 16)),)
    y, _ = qsa_forward(PARAMS, no_budget, u, jnp.arange(150)[None], jnp.ones((1, 150), bool), cache)
    assert rel(np.asarray(y), full) > 1e-2  # the comparison below would be vacuous otherwise


@pytest.mark.parametrize("page_size,chunks,t", [(4, [37, 1, 1, 50], 150), (16, [61, 7, 1], 222), (64, [150], 150)])
def test_paged_chunks_equal_dense_one_shot(page_size, chunks, t):
    u = u_of(1, t)
    got = run_paged(u, [t], chunks, page_size, score_elements=8 * 64 * 32)  # several scoring tiles per chunk
    assert rel(got[0], dense(u)[0]) <= 1e-5


def test_rows_of_different_lengths_in_one_batch():
    u = u_of(3, 160, seed=4)
    lengths = [160, 97, 131]
    got = run_paged(u, lengths, [45, 3], 16, score_elements=3 * 45 * 8 * 16, query_tile=16)
    for r, n in enumerate(lengths):
        want = dense(u[r : r + 1, :n])[0]
        assert rel(got[r, :n], want) <= 1e-5, r


def test_chunked_prefill_equals_one_shot_paged():
    u = u_of(1, 300, seed=5)
    one = run_paged(u, [300], [300], 16)
    chunked = run_paged(u, [300], [77, 1, 2, 64], 16, score_elements=4096)
    assert rel(chunked, one) <= 1e-5


@pytest.mark.slow
def test_two_thousand_tokens_page_64():
    u = u_of(1, 2000, seed=6)
    got = run_paged(u, [2000], [509, 1, 1, 777], 64, score_elements=1 << 16)
    assert rel(got[0], dense(u)[0]) <= 1e-5


@pytest.mark.parametrize("score_elements", [53 * 8, 1 << 24])
def test_ties_go_to_the_lowest_block_as_in_the_oracle(score_elements):
    """One index head: every block whose score is negative relus to exactly 0, so the top-k boundary is full of
    exact ties; the tiled running top-k (a small score budget: prefill chunks merge tile by tile) and the one
    top-k over the whole width (a large one: every step) must resolve them like the oracle's single top_k."""
    from flashnext_jax.qsa import block_keys, block_scores, project

    cfg = tiny_config(indexer_budget=96, indexer_n_heads=1)  # 24 of up to 40 blocks: about half score 0
    params = random_params(cfg, 3, jnp.float32)["layers"][cfg.qsa_layers[0]]["self_attn"]
    params = jax.tree.map(lambda x: x * 30, params)
    t = 160
    u = u_of(1, t, seed=8)
    _, _, _, _, q_index, raw = project(params, cfg, u, jnp.arange(t)[None])
    keys = block_keys(params["indexer"], cfg, raw.reshape(1, t // 4, 4, -1), jnp.arange(t // 4))
    scores = np.asarray(block_scores(q_index, keys))[0]  # [T, blocks]
    k = cfg.block_topk
    tied = [p for p in range(4 * k + 3, t) if (np.sort(scores[p, : (p + 1) // 4])[::-1][k - 1 : k + 1] == 0).all()]
    assert len(tied) > 20, len(tied)  # queries whose last chosen block ties with an unchosen one
    got = run_paged(u, [t], [53, 1, 9], 16, score_elements=score_elements, cfg=cfg, params=params)
    assert rel(got[0], dense(u, cfg, params)[0]) <= 1e-5
