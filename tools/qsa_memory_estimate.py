#!/usr/bin/env python
"""Peak temporaries of one real-size QSA layer over the paged store, from XLA's memory analysis (shapes only).

Compiles `qsa_paged_forward` (reference path) for the real config (24 heads, 2 KV heads x 256, indexer 4 x 128,
budget 2048; K, V, raw index and block-key pools) for a C-token chunk against page tables of L tokens, bf16, page size 64, and prints
temp_size_in_bytes per (C, L). Nothing is allocated (lower() on ShapeDtypeStructs), so it runs on CPU:

  JAX_PLATFORMS=cpu PYTHONPATH=. python tools/qsa_memory_estimate.py --chunks 1,8192 --contexts 4096,32768,262144
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from flashnext_jax.config import from_hf_config
from flashnext_jax.qsa_paged import PagedKV, qsa_paged_forward
from flashnext_jax.weights import _lists, _set, expected_tensors, param_path

HERE = os.path.dirname(os.path.abspath(__file__))
REAL_CONFIG = os.path.join(HERE, "..", "flashnext_jax", "reference", "qwen38_text_config.json")


def layer_params(cfg, dtype):
    layer = cfg.qsa_layers[0]
    tree = {}
    for name, shape in expected_tensors(cfg, with_mtp=False).items():
        prefix = f"layers.{layer}.self_attn."
        if name.startswith(prefix):
            _set(tree, param_path(name[len(prefix):]), jax.ShapeDtypeStruct(shape, dtype))
    return _lists(tree)


def temp_bytes(cfg, params, chunk: int, context: int, page: int = 64, dtype=jnp.bfloat16) -> int:
    width = context // page
    n_qsa, kv, hd, di = len(cfg.qsa_layers), cfg.num_key_value_heads, cfg.head_dim, cfg.indexer_head_dim
    s = jax.ShapeDtypeStruct
    ratio = cfg.indexer_compress_ratio
    pools = (s((width + 2, page, n_qsa, kv, hd), dtype), s((width + 2, page, n_qsa, kv, hd), dtype),
             s((width + 2, page, n_qsa, di), dtype), s((width + 2, page // ratio, n_qsa, di), dtype))

    def step(p, k, v, index, blocks, table, u, positions, valid):
        y, kv_ = qsa_paged_forward(p, cfg, u, positions, valid, PagedKV(k, v, index, blocks, table, valid, 0))
        return y, kv_.k, kv_.v, kv_.index, kv_.block_keys

    args = (params, *pools, s((1, width), jnp.int32), s((1, chunk, cfg.hidden_size), dtype),
            s((1, chunk), jnp.int32), s((1, chunk), jnp.bool_))
    compiled = jax.jit(step, donate_argnums=(1, 2, 3, 4)).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", default="1,8192")
    ap.add_argument("--contexts", default="4096,32768,262144")
    args = ap.parse_args()
    with open(REAL_CONFIG) as f:
        cfg = from_hf_config(json.load(f))
    params = layer_params(cfg, jnp.bfloat16)
    rows = []
    for c in (int(x) for x in args.chunks.split(",")):
        for n in (int(x) for x in args.contexts.split(",")):
            rows.append(dict(chunk=c, context=n, temp_gib=temp_bytes(cfg, params, c, n) / 2**30))
            print(rows[-1], flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
