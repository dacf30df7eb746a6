"""The routed-expert kernels (sorted tiles, pallas_kernels/moe_matmul.py) at prefill sizes: which tile config.

The 32K long-context profile (bench/results/long_context_profile.json) spends ~60% of its GPU time in
moe_gate_up_w4 / moe_down_w4 at the default MoEConfig (16 token rows per tile): an 8,192-token chunk routes
81,920 (token, expert) pairs, ~160 per expert, so each expert's weights are read ~10 times in 16-row dots.
Here: the real MoE shape (512 experts of H 2560, I 640, 10 per token, INT4 groups of 128, bf16 activations),
M tokens, each config's GPU time per call (bench.quant_matmul.device_time: every kernel of the call, the XLA
routing glue included) and its relative error against routed_experts_reference on the first 64 tokens (the
reference dequantizes per token: too big for all M). Writes moe_prefill.json ($OUT or bench/results).

  PYTHONPATH=. python3 bench/moe_prefill.py [--ms 2048,8192]                 # one H200
  MOE_BENCH_SMOKE=1 JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/moe_prefill.py --out /tmp/m.json  # CPU check
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from bench.quant_matmul import device_time, moe_routing, random_qweight
from bench.results_io import save_result
from pallas_kernels.moe_matmul import MoEConfig, routed_experts_pallas, routed_experts_reference

SMOKE = bool(os.environ.get("MOE_BENCH_SMOKE"))
# stop 28's sweep (bench/results/moe_prefill.json): 64-row tiles won; gate/up was fastest at 64 columns, down at 128
SWEEP_STOP28 = [MoEConfig(), MoEConfig(bm=32), MoEConfig(bm=64), MoEConfig(bm=128),
                MoEConfig(bm=64, num_warps=8), MoEConfig(bm=128, num_warps=8),
                MoEConfig(bm=64, bn_gate_up=64, bn_down=64), MoEConfig(bm=64, num_stages=4),
                MoEConfig(bm=128, bn_gate_up=64, bn_down=64, num_warps=8)]
# around the 64-row tiles: each kernel's own column width, warps and pipeline stages (the breakdown per kernel,
# "kernels_us", tells the gate/up kernel's best from the down kernel's, as both share warps and stages here)
SWEEP_TILES64 = [MoEConfig(), MoEConfig(bm=64, bn_gate_up=64, bn_down=64), MoEConfig(bm=64, bn_gate_up=64),
                 MoEConfig(bm=64, bn_gate_up=32), MoEConfig(bm=64, bn_gate_up=32, num_warps=2),
                 MoEConfig(bm=64, bn_gate_up=64, num_stages=2), MoEConfig(bm=64, bn_gate_up=32, num_stages=4),
                 MoEConfig(bm=64, bn_gate_up=64, num_warps=8), MoEConfig(bm=32, bn_gate_up=64),
                 MoEConfig(bm=128, bn_gate_up=32, bn_down=64, num_warps=8), MoEConfig(bm=64, bn_gate_up=16)]
SWEEPS = {"stop28": SWEEP_STOP28, "tiles64": SWEEP_TILES64}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="16,64" if SMOKE else "2048,8192")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sweep", choices=sorted(SWEEPS), default="tiles64")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    e, h, inter, k, bits, g = (16, 256, 128, 4, 4, 128) if SMOKE else (512, 2560, 640, 10, 4, 128)
    key = jax.random.key(7)
    wgu = random_qweight(jax.random.fold_in(key, 1), (e,), h, 2 * inter, bits, g)
    wd = random_qweight(jax.random.fold_in(key, 2), (e,), inter, h, bits, g)
    checked = 64
    rows = []
    for m in (int(x) for x in args.ms.split(",")):
        ids, wts = moe_routing(jax.random.fold_in(key, m), m, e, k)
        x = jax.random.normal(jax.random.fold_in(key, 3), (m, h), jnp.float32).astype(jnp.bfloat16)
        want = np.asarray(jax.jit(routed_experts_reference)(x[:checked], ids[:checked], wts[:checked], wgu, wd),
                          np.float32)
        for cfg in SWEEPS[args.sweep] if not SMOKE else SWEEPS[args.sweep][:3]:
            row = dict(M=m, config=dataclasses.asdict(cfg))
            try:
                fn = jax.jit(lambda x, i, w, a, b, cfg=cfg: routed_experts_pallas(x, i, w, a, b, config=cfg,
                                                                                   interpret=SMOKE))
                got = np.asarray(fn(x, ids, wts, wgu, wd)[:checked], np.float32)
                row["rel_err"] = float(np.abs(got - want).max() / np.abs(want).max())
                if SMOKE:
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(x, ids, wts, wgu, wd))
                    row["us"] = (time.perf_counter() - t0) * 1e6
                else:
                    secs, kernels = device_time(fn, x, ids, wts, wgu, wd, reps=args.reps)
                    row["us"], row["kernels_us"] = secs * 1e6, {n: v * 1e6 for n, v in kernels.items()}
            except Exception as ex:  # noqa: BLE001  (a config that does not compile must not hide the others)
                row["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
            rows.append(row)
            print({k_: v for k_, v in row.items() if k_ != "kernels_us"}, flush=True)
    ok = [r for r in rows if "us" in r and r["rel_err"] < 1e-2]
    summary = {}
    for m in sorted({r["M"] for r in rows}):
        at = [r for r in ok if r["M"] == m]
        default = next((r for r in at if r["config"] == dataclasses.asdict(MoEConfig())), None)
        best = min(at, key=lambda r: r["us"]) if at else None
        summary[f"M{m}_bm16_us"] = default and default["us"]
        summary[f"M{m}_best_us"] = best and best["us"]
        summary[f"M{m}_best_config"] = best and best["config"]
        for kernel in ("moe_gate_up_w4", "moe_down_w4"):  # each kernel's own best (they share warps and stages)
            timed = [r for r in at if kernel in r.get("kernels_us", {})]
            fastest = min(timed, key=lambda r: r["kernels_us"][kernel]) if timed else None
            summary[f"M{m}_best_{kernel}_us"] = fastest and fastest["kernels_us"][kernel]
            summary[f"M{m}_best_{kernel}_config"] = fastest and fastest["config"]
    summary |= dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                    date=time.strftime("%Y-%m-%d", time.gmtime()))
    path = save_result("moe_prefill.json", rows, args.out, summary=summary, smoke=SMOKE, sweep=args.sweep)
    print(f"wrote {path}\n{'M':>5} {'bm':>4} {'bn':>4} {'bn dn':>5} {'warps':>5} {'stages':>6} {'us':>10} {'rel err':>8}")
    for r in rows:
        c = r["config"]
        res = f"{r['us']:10.1f} {r['rel_err']:8.1e}" if "us" in r else r.get("error", "")[:60]
        print(f"{r['M']:5d} {c['bm']:4d} {c['bn_gate_up']:4d} {c['bn_down']:5d} {c['num_warps']:5d} {c['num_stages']:6d} {res}")


if __name__ == "__main__":
    main()
