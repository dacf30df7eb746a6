"""The hyper-connection read at decode sizes: fused kernels (pallas_kernels/hyper_read.py) vs the XLA + GEMV path.

Real shapes (S = 4 streams of H = 2560, low rank R = 320, int8 g64 mixers as in the INT4-Mixed checkpoint, a bf16
block-inject weight), M = 1 and 2 tokens. `--reads` different weight sets (default 48) are read in one jitted
program, so weights stream from HBM as in the decode step (97 reads per step). Reports the error of each path
against the float32 reference (first weight set) and the device time per read (profiler: every kernel's time).

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 bench/hyper_read.py     # JSON to $OUT or bench/results
  HYPER_BENCH_SMOKE=1 FLASHNEXT_KERNELS=interpret PYTHONPATH=. python3 bench/hyper_read.py   # CPU check
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from bench.quant_matmul import copy_bandwidth, device_time
from flashnext_jax import hyper
from pallas_kernels import quant_layout as ql

SMOKE = bool(os.environ.get("HYPER_BENCH_SMOKE"))
HERE = os.path.dirname(os.path.abspath(__file__))


def random_read(key, s, h, r, bits, group):
    def qw(key, k, n):
        k1, k2 = jax.random.split(key)
        planes = tuple(jax.random.bits(jax.random.fold_in(k1, i), (k * w // 8, n), jnp.uint8).view(
            jnp.int8 if bits == 8 else jnp.uint8) for i, (w, _) in enumerate(ql.PLANE_FORMATS[bits]))
        scales = (jax.random.normal(k2, (k // group, n)) * 2e-3).astype(jnp.bfloat16)
        return ql.QuantizedWeight(planes, scales, bits, group, k, n)

    keys = jax.random.split(key, 4)
    return {"hc_norm": (jax.random.normal(keys[0], (s * h,)) * 0.2).astype(jnp.bfloat16),
            "input_mix_weight_down": qw(keys[1], s * h, r), "input_mix_weight_up": qw(keys[2], r, s * h),
            "block_inject_weight": (jax.random.normal(keys[3], (s, s * h)) * 0.02).astype(jnp.bfloat16)}


def rel_err(got, ref):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-9))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reads", type=int, default=48)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    s, h, r = (4, 128, 64) if SMOKE else (4, 2560, 320)
    reads = 2 if SMOKE else args.reads
    cfg = types.SimpleNamespace(hc_count=s, hidden_size=h, rms_norm_eps=1e-6)
    dev = jax.devices()[0]
    print(f"{dev.device_kind} jax {jax.__version__}", flush=True)
    bw = None if SMOKE else copy_bandwidth()
    params = [random_read(jax.random.key(i), s, h, r, 8, 64) for i in range(reads)]
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params[0]))
    rows = []
    for m in (1, 2):
        x = (jax.random.normal(jax.random.key(100 + m), (m, s * h)) * jnp.repeat(jnp.array([0.5, 1, 3, 8]), h)
             ).astype(jnp.bfloat16)
        p32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 and a.ndim == 1
                                     or a.shape == (s, s * h) else a, params[0])
        u32, g32 = hyper.hyper_read_reference(p32, cfg, x.astype(jnp.float32))
        row = dict(m=m, reads=reads, weight_bytes_per_read=weight_bytes)
        for name, fn in (("fused", hyper.fused_hyper_read), ("xla_gemv", hyper.hyper_read_reference)):
            one = jax.jit(lambda p, x, fn=fn: fn(p, cfg, x))
            u, g = one(params[0], x)
            row[f"{name}_err_u"], row[f"{name}_err_gains"] = rel_err(u, u32), rel_err(g, g32)

            def many(ps, x, fn=fn):
                outs = [fn(p, cfg, x) for p in ps]
                return sum(o[0].astype(jnp.float32) for o in outs), sum(o[1].astype(jnp.float32) for o in outs)

            t, top = device_time(jax.jit(many), params, x, reps=3, top=8)
            if t is not None:
                row[f"{name}_us_per_read"] = t / reads * 1e6
                row[f"{name}_top_us_per_read"] = {k: v / reads * 1e6 for k, v in top.items()}
                if bw:
                    row[f"{name}_frac_copy_bw"] = weight_bytes / (t / reads) / bw
        print(row, flush=True)
        rows.append(row)
    out = dict(device=dev.device_kind, jax_version=jax.__version__, copy_bw_bytes_per_s=bw, smoke=SMOKE,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), rows=rows)
    path = args.out or os.path.join(os.environ.get("OUT") or os.path.join(HERE, "results"), "hyper_read_fused_experiment.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\n{'M':>2} {'path':>9} {'us/read':>8} {'frac bw':>8} {'err u':>8} {'err gains':>9}")
    for row in rows:
        for name in ("fused", "xla_gemv"):
            print(f"{row['m']:2d} {name:>9} {row.get(name + '_us_per_read', float('nan')):8.2f} "
                  f"{row.get(name + '_frac_copy_bw', float('nan')):8.2f} {row[name + '_err_u']:8.1e} "
                  f"{row[name + '_err_gains']:9.1e}")


if __name__ == "__main__":
    main()
