"""The sparse QSA kernels on the GPU at the real shapes: do they compile, equal their references, and how fast.

Real config: 4 indexer heads of 128, 2 KV heads of 256 with 12 query heads each, block ratio 4, 512 blocks + the
tail per query, page size 64, 12 QSA layers in the pools. Cases: decode (T = 1) and a prefill chunk (T = 8192)
against a 262,144-token row (4,096 pages). Per case and implementation: median ms over `--reps` calls of the
jitted function (block_until_ready each), and the kernel's max relative error against the reference (bf16 K/V,
fp32 accumulation in both). Writes qsa_kernels.json ($OUT or bench/results) with a `summary`.

  PYTHONPATH=. python3 bench/qsa_kernels.py                                   # one H200
  QSA_BENCH_SMOKE=1 JAX_PLATFORMS=cpu FLASHNEXT_KERNELS=interpret PYTHONPATH=. python3 bench/qsa_kernels.py --out /tmp/q.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from bench.results_io import save_result
from pallas_kernels import qsa_sparse
from pallas_kernels import qsa_sparse_reference as ref

SMOKE = bool(os.environ.get("QSA_BENCH_SMOKE"))


def timed(fn, *args, reps: int) -> tuple[float, jax.Array]:
    out = jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    fin = np.isfinite(b)
    if not np.array_equal(np.isfinite(a), fin):
        return float("inf")
    return float(np.abs(a[fin] - b[fin]).max() / max(np.abs(b[fin]).max(), 1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    mode = "interpret" if SMOKE else "pallas"
    ratio, page, layers, kv, g, hd, ni, di, top = 4, 64, 12, 2, 12, 256, 4, 128, 512
    context = 2048 if SMOKE else 262144
    prefill = 64 if SMOKE else 8192
    tile_blocks = 64 if SMOKE else 512
    pages = context // page
    ks = jax.random.split(jax.random.key(0), 8)
    k_pool = jax.random.normal(ks[0], (pages + 1, page, layers, kv, hd), jnp.bfloat16)
    v_pool = jax.random.normal(ks[1], (pages + 1, page, layers, kv, hd), jnp.bfloat16)
    rows = []
    for name, t, n in [("decode", 1, context // ratio), ("prefill", prefill, tile_blocks)]:
        q_index = jax.random.normal(ks[2], (1, t, ni, di), jnp.bfloat16)
        keys = jax.random.normal(ks[3], (1, n, di), jnp.bfloat16)
        n_complete = jnp.full((1, t), n, jnp.int32) - jnp.arange(t)[None] % 7
        fns = {"reference": jax.jit(lambda q, k, c: ref.indexer_scores(q, k, c, 0)),
               "kernel": jax.jit(lambda q, k, c: qsa_sparse.indexer_scores(q, k, c, 0, impl=mode))}
        res = {}
        for impl, fn in fns.items():
            res[impl] = timed(fn, q_index, keys, n_complete, reps=args.reps)
        rows.append(dict(op="indexer_scores", case=name, T=t, blocks=n, ref_ms=res["reference"][0],
                         kernel_ms=res["kernel"][0], rel_err=rel_err(res["kernel"][1], res["reference"][1])))
        print(rows[-1], flush=True)

        j = top + 1
        q = jax.random.normal(ks[4], (1, t, kv, g, hd), jnp.bfloat16)
        blk = jax.random.randint(ks[5], (1, t, j), 0, context // ratio)
        blk_page, blk_off = blk * ratio // page, blk * ratio % page
        blk_len = jnp.where(jax.random.uniform(ks[6], (1, t, j)) < 0.95, ratio, 0).astype(jnp.int32)
        fns = {"reference": jax.jit(lambda q, kp, vp, *a: ref.sparse_attention(q, kp, vp, 5, *a, ratio=ratio)),
               "kernel": jax.jit(lambda q, kp, vp, *a: qsa_sparse.sparse_attention(q, kp, vp, 5, *a, ratio=ratio,
                                                                                     impl=mode))}
        res = {impl: timed(fn, q, k_pool, v_pool, blk_page, blk_off, blk_len, reps=args.reps)
               for impl, fn in fns.items()}
        rows.append(dict(op="sparse_attention", case=name, T=t, blocks=j, ref_ms=res["reference"][0],
                         kernel_ms=res["kernel"][0], rel_err=rel_err(res["kernel"][1], res["reference"][1])))
        print(rows[-1], flush=True)

    by = {(r["op"], r["case"]): r for r in rows}
    summary = {f"{op}_{case}_{k}": by[(op, case)][k] for op in ("indexer_scores", "sparse_attention")
               for case in ("decode", "prefill") for k in ("ref_ms", "kernel_ms", "rel_err")}
    summary |= dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                    date=time.strftime("%Y-%m-%d", time.gmtime()))
    path = save_result("qsa_kernels.json", rows, args.out, summary=summary, smoke=SMOKE, context=context)
    print(f"wrote {path}\n{'op':>17} {'case':>8} {'T':>5} {'ref ms':>8} {'kernel ms':>9} {'rel err':>8}")
    for r in rows:
        print(f"{r['op']:>17} {r['case']:>8} {r['T']:5d} {r['ref_ms']:8.3f} {r['kernel_ms']:9.3f} {r['rel_err']:8.1e}")


if __name__ == "__main__":
    main()
