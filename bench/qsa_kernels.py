"""The sparse QSA kernels on the GPU at the real shapes: do they compile, equal their references, and how fast.

Real config: 4 indexer heads of 128, 2 KV heads of 256 with 12 query heads each, block ratio 4, 512 blocks + the
tail per query, page size 64, 12 QSA layers in the pools, a 262,144-token pool. indexer_scores: decode (T = 1)
and a prefill chunk (T = 8192). sparse_attention: decode and an 8,192-token chunk with blocks drawn from the
whole 262K row (little reuse in the caches) and from its first 32K tokens; implementations: the reference, a
kv-head-major variant of it (`kv_major_reference`, a candidate) and the kernel at 32 / 64 / 128 keys per step.
Per case: median ms over `--reps` calls of the jitted function (block_until_ready each) and the relative error
against the reference (bf16 K/V, fp32 accumulation in both). Writes qsa_kernels.json ($OUT or bench/results).

  PYTHONPATH=. python3 bench/qsa_kernels.py                                   # one H200
  QSA_BENCH_SMOKE=1 JAX_PLATFORMS=cpu FLASHNEXT_KERNELS=interpret PYTHONPATH=. python3 bench/qsa_kernels.py --out /tmp/q.json
"""

from __future__ import annotations

import argparse
import functools
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
PAGE = 64


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


def kv_major_reference(q, k_pool, v_pool, layer, blk_page, blk_off, blk_len, *, ratio, query_tile=128):
    """The reference's computation with the keys gathered kv-head-major ([kv, B, tile, S, hd]) so that both dots
    have their batch axes leading (a candidate against the reference's transposes; the same numbers)."""
    b, t, kv = q.shape[:3]
    tile = min(query_tile, t)
    n_tiles = -(-t // tile)
    pad = n_tiles * tile - t
    padq = lambda a: jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))  # noqa: E731
    q, blk_page, blk_off, blk_len = (padq(a) for a in (q, blk_page, blk_off, blk_len))
    split = lambda a: jnp.moveaxis(a.reshape(b, n_tiles, tile, *a.shape[2:]), 1, 0)  # noqa: E731
    heads = jnp.arange(kv)[:, None, None, None, None]

    def one_tile(args):
        qt, page, off, n = args
        rows = jnp.minimum(off[..., None] + jnp.arange(ratio), k_pool.shape[1] - 1)  # [B, tile, J, r]
        on = (jnp.arange(ratio) < n[..., None]).reshape(b, tile, -1)  # [B, tile, S]
        take = lambda pool: pool[page[None, ..., None], rows[None], layer, heads].reshape(kv, b, tile, -1,  # noqa
                                                                                         pool.shape[-1])
        k = jnp.where(on[None, ..., None], take(k_pool), 0).astype(qt.dtype)  # [kv, B, tile, S, hd]
        v = jnp.where(on[None, ..., None], take(v_pool), 0).astype(qt.dtype)
        qk = jnp.moveaxis(qt, 2, 0)  # [kv, B, tile, G, hd]
        s = jnp.einsum("kbtgd,kbtsd->kbtgs", qk, k, preferred_element_type=jnp.float32)
        s = jnp.where(on[None, :, :, None], s * (qt.shape[-1] ** -0.5), -jnp.inf)
        p = jnp.where(on[None, :, :, None], jax.nn.softmax(s, axis=-1), 0.0).astype(qt.dtype)
        out = jnp.einsum("kbtgs,kbtsd->kbtgd", p, v, preferred_element_type=jnp.float32).astype(qt.dtype)
        return jnp.moveaxis(out, 0, 2)

    out = jax.lax.map(one_tile, tuple(split(a) for a in (q, blk_page, blk_off, blk_len)))
    return jnp.moveaxis(out, 0, 1).reshape(b, n_tiles * tile, *q.shape[2:])[:, :t]


def attention_rows(args, mode, ks, k_pool, v_pool, ratio, kv, g, hd, top, context, cases):
    """sparse_attention per case: the reference, the kv-major candidate and the kernel at several keys per step."""
    rows = []
    for name, t, ctx in cases:
        j = top + 1
        q = jax.random.normal(ks[4], (1, t, kv, g, hd), jnp.bfloat16)
        blk = jax.random.randint(ks[5], (1, t, j), 0, ctx // ratio)
        blk_page, blk_off = blk * ratio // PAGE, blk * ratio % PAGE
        blk_len = jnp.where(jax.random.uniform(ks[6], (1, t, j)) < 0.95, ratio, 0).astype(jnp.int32)
        fns = {"reference": jax.jit(lambda q, kp, vp, *a: ref.sparse_attention(q, kp, vp, 5, *a, ratio=ratio)),
               "kv_major": jax.jit(lambda q, kp, vp, *a: kv_major_reference(q, kp, vp, 5, *a, ratio=ratio))}
        for s in (32, 64, 128):
            fns[f"kernel_s{s}"] = jax.jit(functools.partial(
                lambda q, kp, vp, *a, s: qsa_sparse.sparse_attention_pallas(
                    q, kp, vp, *a, layer=5, ratio=ratio, keys_per_step=s, interpret=mode == "interpret"), s=s))
        for p in args.splits:  # flash-decoding splits of the key list (the batch-invariant path's form)
            fns[f"kernel_s64_p{p}"] = jax.jit(functools.partial(
                lambda q, kp, vp, *a, p: qsa_sparse.sparse_attention_pallas(
                    q, kp, vp, *a, layer=5, ratio=ratio, keys_per_step=64, kv_splits=p,
                    interpret=mode == "interpret"), p=p))
        res = {impl: timed(fn, q, k_pool, v_pool, blk_page, blk_off, blk_len, reps=args.reps)
               for impl, fn in fns.items()}
        row = dict(op="sparse_attention", case=name, T=t, context=ctx, blocks=j, ref_ms=res["reference"][0])
        for impl, (ms, out) in res.items():
            if impl != "reference":
                row[f"{impl}_ms"], row[f"{impl}_rel_err"] = ms, rel_err(out, res["reference"][1])
        rows.append(row)
        print(row, flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--splits", default="4,8,16", help="kv_splits of the split kernel rows")
    args = ap.parse_args()
    args.splits = [int(p) for p in args.splits.split(",") if p]
    mode = "interpret" if SMOKE else "pallas"
    ratio, layers, kv, g, hd, ni, di, top = 4, 12, 2, 12, 256, 4, 128, 512
    context = 2048 if SMOKE else 262144
    prefill = 64 if SMOKE else 8192
    tile_blocks = 64 if SMOKE else 512
    pages = context // PAGE
    ks = jax.random.split(jax.random.key(0), 8)
    k_pool = jax.random.normal(ks[0], (pages + 1, PAGE, layers, kv, hd), jnp.bfloat16)
    v_pool = jax.random.normal(ks[1], (pages + 1, PAGE, layers, kv, hd), jnp.bfloat16)
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
    # the keys drawn from the whole row (262K: no reuse in the caches) or from its first 32K tokens
    cases = [("decode", 1, context), ("prefill", prefill, context), ("prefill_32k", prefill, context // 8)]
    rows += attention_rows(args, mode, ks, k_pool, v_pool, ratio, kv, g, hd, top, context, cases)

    by = {(r["op"], r["case"]): r for r in rows}
    summary = {f"indexer_scores_{case}_{k}": by[("indexer_scores", case)][k] for case in ("decode", "prefill")
               for k in ("ref_ms", "kernel_ms", "rel_err")}
    for case in ("decode", "prefill", "prefill_32k"):
        r = by[("sparse_attention", case)]
        summary |= {f"sparse_attention_{case}_{k}": v for k, v in r.items() if k.endswith(("_ms", "_err"))}
    summary |= dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                    date=time.strftime("%Y-%m-%d", time.gmtime()))
    path = save_result("qsa_kernels.json", rows, args.out, summary=summary, smoke=SMOKE, context=context)
    for r in rows:
        if r["op"] == "sparse_attention":
            print(r["case"], {k: round(v, 4) for k, v in r.items() if "_p" in k})
    print(f"wrote {path}\n{'op':>17} {'case':>12} {'T':>5} {'ref ms':>8} {'kv-major':>8} {'k s32':>8} {'k s64':>8} "
          f"{'k s128':>8} {'err s64':>8}")
    for r in rows:
        if r["op"] == "indexer_scores":
            print(f"{r['op']:>17} {r['case']:>12} {r['T']:5d} {r['ref_ms']:8.3f} {'':>8} {r['kernel_ms']:8.3f}")
        else:
            print(f"{r['op']:>17} {r['case']:>12} {r['T']:5d} {r['ref_ms']:8.3f} {r['kv_major_ms']:8.3f} "
                  f"{r['kernel_s32_ms']:8.3f} {r['kernel_s64_ms']:8.3f} {r['kernel_s128_ms']:8.3f} "
                  f"{r['kernel_s64_rel_err']:8.1e}")


if __name__ == "__main__":
    main()
