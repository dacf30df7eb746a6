"""The indexer's block selection of one decode step at the real size: what each way of scoring the width costs.

A decode step's QSA layers (12 at the real config) each score the row's complete blocks and take the top 512.
The variants, each over all 12 layers of one step, wall time per step (the host wait included, as the engine sees
it):
  full     the whole page-table width scored in one pass, block keys recomputed from the raw keys;
  cached   `qsa_paged.select_blocks` as the engine runs it: one pass from the block-key page leaf (1/4 of the raw
           keys' rows, written as each block completes).
The tile loop with a dynamic trip count that preceded both (its while loop copies its predicate to the host every
iteration on a GPU: 1.67 ms at 4K -> 7.48 ms at 262K) is measured in bench/results/select_decode.json, commit
85219bb. Both variants here must pick the same blocks when the block-key pool holds the raw keys' block keys.

  PYTHONPATH=. python3 bench/select_decode.py --out $OUT/select_decode_cached.json
  SELECT_BENCH_SMOKE=1 JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/select_decode.py   # CPU check of this script
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from bench import decode_step
from bench.results_io import save_result
from flashnext_jax.config import from_hf_config
from flashnext_jax.qsa import block_keys
from flashnext_jax.qsa_paged import PagedKV, select_blocks
from pallas_kernels import qsa_sparse

SMOKE = bool(os.environ.get("SELECT_BENCH_SMOKE"))
CONFIG = decode_step.REAL_CONFIG


def full_width(p, cfg, q_index, kv: PagedKV, positions):
    """Every block of the width scored at once from the raw keys (no loop), then one top-k."""
    b = positions.shape[0]
    ratio, page = cfg.indexer_compress_ratio, kv.index.shape[1]
    n_blocks = kv.page_table.shape[1] * page // ratio
    raw = kv.index[kv.page_table, :, kv.layer].reshape(b, n_blocks, ratio, -1)  # [B, MP, page, dI] -> blocks
    keys = block_keys(p, cfg, raw, jnp.arange(n_blocks))
    scores = qsa_sparse.indexer_scores(q_index, keys, (positions + 1) // ratio, 0)
    vals, idx = jax.lax.top_k(scores, cfg.block_topk)
    return idx, jnp.isfinite(vals)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="512,1024" if SMOKE else "4096,32768,131072,262000")
    ap.add_argument("--width-pages", type=int, default=64 if SMOKE else 4096)
    ap.add_argument("--batch", default="1,2")
    ap.add_argument("--iters", type=int, default=3 if SMOKE else 50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with open(CONFIG) as f:
        cfg = from_hf_config(json.load(f))
    page, ratio, di = 64, cfg.indexer_compress_ratio, cfg.indexer_head_dim
    n_qsa = 2 if SMOKE else sum(1 for t in cfg.layer_types if t != "linear_attention")
    width = args.width_pages
    rng = np.random.default_rng(0)
    dt = jnp.bfloat16
    n_pages = max(int(b) for b in args.batch.split(",")) * width + 1
    index = jnp.asarray(rng.standard_normal((n_pages, page, n_qsa, di), np.float32), dt)
    p = {"k_layernorm": jnp.ones((di,), dt)}
    # the block keys the engine would have written: each block's key from its raw keys (row b's page i holds
    # its blocks 16i .. 16i + 15: the page tables below are b * width + i)
    raw = index.reshape(n_pages, page // ratio, ratio, n_qsa, di).transpose(0, 3, 1, 2, 4)
    blocks_of_page = (jnp.arange(n_pages) % width)[:, None] * (page // ratio) + jnp.arange(page // ratio)
    block_pool = jax.jit(lambda r: jax.vmap(lambda rl: block_keys(p, cfg, rl, blocks_of_page), 1, 2)(r))(raw)
    empty = jnp.zeros((n_pages, page, n_qsa, 1, 1), dt)

    def step(variant, q_index, index, block_pool, page_table, positions):
        out = []
        for layer in range(n_qsa):
            kv = PagedKV(empty, empty, index, block_pool, page_table, jnp.ones(positions.shape, bool), layer)
            if variant == "full":
                idx, _ = full_width(p, cfg, q_index, kv, positions)
            else:
                idx, _ = select_blocks(cfg, q_index, kv, positions)
            out.append(idx)
        return jnp.stack(out)

    jitted = {v: jax.jit(lambda *a, v=v: step(v, *a)) for v in ("full", "cached")}
    rows = []
    for bsz in (int(b) for b in args.batch.split(",")):
        page_table = jnp.asarray(np.arange(bsz * width, dtype=np.int32).reshape(bsz, width))
        q_index = jnp.asarray(rng.standard_normal((bsz, 1, cfg.indexer_n_heads, di), np.float32), dt)
        for ctx in (int(c) for c in args.contexts.split(",")):
            positions = jnp.full((bsz, 1), min(ctx, width * page) - 1, jnp.int32)
            picked = {}
            for variant, fn in jitted.items():
                t0 = time.perf_counter()
                picked[variant] = np.asarray(fn(q_index, index, block_pool, page_table, positions))
                first = time.perf_counter() - t0
                times = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    fn(q_index, index, block_pool, page_table, positions).block_until_ready()
                    times.append(time.perf_counter() - t0)
                ms = 1e3 * float(np.median(times))
                same = None if variant == "full" else bool(  # the same blocks as recomputing (as sets)
                    (np.sort(picked[variant], -1) == np.sort(picked["full"], -1)).all())
                rows.append(dict(variant=variant, batch=bsz, context=ctx, width_pages=width, layers=n_qsa,
                                 ms_per_step=ms, first_s=first, same_blocks_as_full=same))
                print(f"B={bsz} ctx={ctx:>7} {variant:>7}: {ms:7.3f} ms per step ({n_qsa} layers)", flush=True)
    summary = {f"B{r['batch']}_{r['context']}_{r['variant']}_ms": round(r["ms_per_step"], 3) for r in rows}
    path = save_result("select_decode_cached.json", rows, args.out, summary=summary)
    print("\n| B | context | " + " | ".join(jitted) + " |")
    for bsz in sorted({r["batch"] for r in rows}):
        for ctx in sorted({r["context"] for r in rows}):
            cells = [f"{summary[f'B{bsz}_{ctx}_{v}_ms']:.3f}" for v in jitted]
            print(f"| {bsz} | {ctx} | " + " | ".join(cells) + " |")
    print("wrote", path)


if __name__ == "__main__":
    main()
