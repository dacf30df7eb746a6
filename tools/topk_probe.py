"""What does the indexer's block selection cost on this device? Times `lax.top_k(k=512)` at the shapes of
`qsa_paged.select_blocks` (one decode query: a running top-k merged with each 4,096-block tile, 16 tiles at 262K;
one top-k over all 65,536 blocks; an 8K-token prefill chunk's tile merge) and a full sort for comparison.

  PYTHONPATH=. python3 tools/topk_probe.py [--out topk.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp


def timed(fn, *args, reps=30):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def merge_chain(n_tiles: int, tile: int, top: int):
    """The decode pattern: a running [rows, top] merged with n_tiles tiles of scores, in a fori_loop."""
    @jax.jit
    def run(scores):  # [rows, n_tiles * tile]
        rows = scores.shape[0]

        def body(i, carry):
            vals, idx = carry
            s = jax.lax.dynamic_slice_in_dim(scores, i * tile, tile, axis=1)
            v, pick = jax.lax.top_k(jnp.concatenate([vals, s], -1), top)
            blocks = jnp.broadcast_to(i * tile + jnp.arange(tile), (rows, tile))
            return v, jnp.take_along_axis(jnp.concatenate([idx, blocks], -1), pick, -1)
        init = (jnp.full((rows, top), -jnp.inf), jnp.zeros((rows, top), jnp.int32))
        return jax.lax.fori_loop(0, n_tiles, body, init)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    key = jax.random.key(0)
    rows = []
    for label, r, n, how in [("decode: 1 tile merge (4K ctx)", 1, 4096, "chain1"),
                             ("decode: 16 tile merges (262K ctx)", 1, 65536, "chain16"),
                             ("decode: one top_k over 65,536 blocks", 1, 65536, "top_k"),
                             ("decode: sort of 65,536 blocks", 1, 65536, "sort"),
                             ("prefill 8K: one tile merge (8,192 x [512 | 1,024])", 8192, 1024, "chain1"),
                             ("prefill 8K: one top_k over 8,192 x 8,192 blocks (32K ctx)", 8192, 8192, "top_k")]:
        x = jax.random.normal(key, (r, n), jnp.float32)
        if how.startswith("chain"):
            tiles = int(how[5:])
            ms = timed(merge_chain(tiles, n // tiles, 512), x)
        elif how == "top_k":
            ms = timed(jax.jit(lambda s: jax.lax.top_k(s, 512)), x)
        else:
            ms = timed(jax.jit(lambda s: jnp.sort(s, axis=-1)), x)
        rows.append(dict(case=label, rows=r, blocks=n, ms=ms))
        print(f"{label:60s} {ms:8.3f} ms", flush=True)
    result = dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                  date=time.strftime("%Y-%m-%d", time.gmtime()), rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
