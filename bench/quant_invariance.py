"""Can one tensor-core kernel configuration serve every row count M with M-independent rounding, and at what cost?
(issue 19, the GPU matmuls)

The auto dispatch (`quant_matmul.dispatch_path`, `default_config`) changes the path (GEMV, kernel, XLA dequant +
dot) and, inside the kernel, the tile rows, the split-K factor and the groups per loop iteration with M, so a row's
rounding depends on its step (bench/results/invariance_probe_h100.json). Here each candidate fixed configuration of
the Pallas kernel (`quant_matmul_pallas(config=...)`: split-K 1, so each output accumulates K in one order) runs at
every M; row i of the M-row call is compared bitwise with row i of the M = 1 call, and each call is timed against
the auto dispatch at the same M.

    H200:  PYTHONPATH=. python3 bench/quant_invariance.py --out $OUT/quant_invariance.json     (~2-3 min)
    CPU:   JAX_PLATFORMS=cpu FLASHNEXT_KERNELS=interpret PYTHONPATH=. python3 bench/quant_invariance.py --quick
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.quant_matmul import random_qweight  # noqa: E402
from pallas_kernels.kernel_switch import resolve_impl  # noqa: E402
from pallas_kernels.quant_matmul import DenseConfig, quant_matmul, quant_matmul_pallas  # noqa: E402

H = 2560


def weights(key):
    k = jax.random.split(key, 3)
    return {"int4_2560x4096": random_qweight(k[0], (), H, 4096, 4, 128),
            "int4_4096x2560": random_qweight(k[1], (), 4096, H, 4, 128),
            "int8_2560x1280": random_qweight(k[2], (), H, 1280, 8, 128)}


def candidates(bits: int, sweep: str) -> dict[str, DenseConfig]:
    """Fixed configurations. "tiles": split-K 1, small tiles with the weights on the left (decode's layout) and
    the prefill tile (weights on the right). "splits": weights on the left, the tile rows of every M, with a
    fixed split-K factor (its partial sums added in a fixed order) and groups per iteration: does the rounding
    stay the same across tile rows, and does a fixed split keep decode fast?"""
    stages = 1 if bits == 8 else 3
    bn = 64 if bits == 4 else 128
    if sweep == "tiles":
        return {f"bm16_bn{bn}_wl": DenseConfig(bm=16, bn=bn, splits=1, groups_per_iter=1, num_stages=stages,
                                               weights_left=True),
                f"bm64_bn{bn}_wl": DenseConfig(bm=64, bn=bn, splits=1, groups_per_iter=1, num_stages=stages,
                                               weights_left=True),
                "bm128_bn128": DenseConfig(bm=128, bn=128, splits=1, groups_per_iter=1, num_warps=8, num_stages=3)}
    out = {}
    for splits in (1, 4):
        for bm in (16, 64, 128):
            for gpi in (1, 2):
                out[f"bm{bm}_bn{bn}_s{splits}_g{gpi}_wl"] = DenseConfig(
                    bm=bm, bn=bn, splits=splits, groups_per_iter=gpi, num_warps=4 if bm < 128 else 8,
                    num_stages=stages, weights_left=True)
    return out


def timed(fn, *args, reps: int) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="few row counts, no timing (CPU interpret check)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", default="tiles", choices=("tiles", "splits"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ms = [1, 2, 3, 17] if args.quick else [1, 2, 3, 8, 16, 17, 32, 64, 128, 256, 1024, 8192]
    if args.sweep == "splits" and not args.quick:
        ms = [1, 2, 8, 32, 256, 8192]
    interpret = resolve_impl(None) == "interpret"
    key = jax.random.PRNGKey(0)
    rows = []
    for name, w in weights(key).items():
        x_all = jax.random.normal(jax.random.fold_in(key, 7), (max(ms), w.k), jnp.float32).astype(jnp.bfloat16)
        auto = jax.jit(lambda x, w=w: quant_matmul(x, w))
        first = None  # the first candidate's M = 1 row: do two configurations agree with each other?
        for cname, cfg in candidates(w.bits, args.sweep).items():
            try:
                fixed = jax.jit(lambda x, w=w, cfg=cfg: quant_matmul_pallas(x, w, config=cfg, interpret=interpret))
                solo = np.asarray(fixed(x_all[:1]))
                first = solo if first is None else first
            except Exception as e:  # a configuration the kernel cannot tile: recorded, not fatal
                rows.append(dict(op=name, config=cname, error=str(e)[:200]))
                print(f"{name:16s} {cname:16s} cannot run: {str(e)[:120]}", flush=True)
                continue
            for m in ms:
                x = x_all[:m]
                y = np.asarray(fixed(x))
                equal = y[0].tobytes() == solo[0].tobytes()
                row = dict(op=name, config=cname, m=m, equal_to_m1=bool(equal),
                           equal_to_first_config=y[0].tobytes() == first[0].tobytes(),
                           max_abs_diff=float(np.max(np.abs(y[0].astype(np.float32) - solo[0].astype(np.float32)))))
                if not args.quick:
                    row["ms_fixed"] = timed(fixed, x, reps=args.reps)
                    row["ms_auto"] = timed(auto, x, reps=args.reps)
                    row["fixed_over_auto"] = row["ms_fixed"] / row["ms_auto"]
                rows.append(row)
                cost = f"  {row['ms_fixed']:.4f} ms vs auto {row['ms_auto']:.4f} ({row['fixed_over_auto']:.2f}x)" \
                    if "ms_fixed" in row else ""
                print(f"{name:16s} {cname:16s} M={m:5d} {'EQUAL' if equal else 'differs'}{cost}", flush=True)
    summary = {}
    for r in rows:
        if "m" not in r:
            continue
        s = summary.setdefault(f"{r['op']}/{r['config']}", {"row_counts_that_differ": [],
                                                            "differs_from_first_config_at": [], "fixed_over_auto": {}})
        if not r["equal_to_m1"]:
            s["row_counts_that_differ"].append(r["m"])
        if not r["equal_to_first_config"]:
            s["differs_from_first_config_at"].append(r["m"])
        if "fixed_over_auto" in r:
            s["fixed_over_auto"][str(r["m"])] = round(r["fixed_over_auto"], 3)
    dev = jax.devices()[0]
    out = args.out or os.path.join(os.environ.get("OUT", "bench/results"), "quant_invariance.json")
    with open(out, "w") as f:
        json.dump(dict(device=getattr(dev, "device_kind", str(dev)), jax_version=jax.__version__,
                       date=datetime.date.today().isoformat(), rows=rows, summary=summary), f, indent=1)
    print("\nper op / fixed config: row counts whose row 0 differs from M = 1; cost over auto at M = 1, 2, 8192")
    for k, s in summary.items():
        c = s["fixed_over_auto"]
        print(f"{k:34s} differ: {s['row_counts_that_differ']} vs first config: "
              f"{s['differs_from_first_config_at']}  cost: "
              + " ".join(f"M={m}:{c[m]}" for m in ("1", "2", "8", "32", "8192") if m in c))
    print("wrote", out)


if __name__ == "__main__":
    main()
