"""Tuning probe for the GDN kernels on the GPU (not a report): prefill kernel variants (gdn_prefill.VARIANTS:
K1 alone and the whole prefill, wall and profiler device time, T=16K and 64K), prefill tilings at T=16K (K1/K2
split) and the decode kernel inside one jitted program of 36 layers x 4 steps without a while loop: wall time per
layer vs the kernels' own device time from the profiler, under XLA's default command-buffer flags and with every
command type (CUDA graphs) on. Prints a table last; JSON to $OUT/gdn_probe.json. Results so far:
docs/kernels-gdn.md.

  PYTHONPATH=. python3 bench/gdn_probe.py            # everything
  PYTHONPATH=. python3 bench/gdn_probe.py --only-prefill-variants   # just the variant table (~2 min)
  PYTHONPATH=. python3 bench/gdn_probe.py --decode-child   # (internal) decode timing under the current XLA_FLAGS
  GDN_BENCH_SMOKE=1 JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/gdn_probe.py --only-prefill-variants  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

import bench.gdn as gb
from bench.quant_matmul import device_time
from pallas_kernels.gdn_decode import recurrent_gated_delta_rule_slots_pallas
from pallas_kernels.gdn_prefill import VARIANTS

RESULTS = []


def log(*a):
    print(*a, flush=True)


def prefill_variants(T):
    base = dict(block_v=32, num_warps=4, num_stages=2, wy_warps=4)
    variants = [dict(base), dict(base, num_warps=8, num_stages=3), dict(base, block_v=64, num_warps=8)]
    for tune in variants:
        row = dict(kind="prefill", T=T, tune=tune)
        try:
            _, err = gb.time_jax_prefill([1000, 64, 1, 3031], tune, 1, check=True)
            row["rel_err_o_state"] = err
            t, _ = gb.time_jax_prefill([T], tune, 10)
            tw, _ = gb.time_jax_prefill([T], tune, 10, stop=True)
            row.update(ms=t * 1e3, k1_ms=tw * 1e3, k2_ms=(t - tw) * 1e3)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["error"] = repr(e)[:300]
        log(row)
        RESULTS.append(row)


def prefill_kernel_variants(Ts=(16384, 65536)):
    """Each prefill kernel variant side by side, B=1, real heads, use_qk_l2norm: error vs the pure-JAX reference
    on a small varlen case, then per T the wall time (bench_host) and the profiler's device time (sum of kernel
    durations: no launch gaps) of K1 alone (stop_after_wy) and of the whole prefill, with the top kernels."""
    base = dict(block_v=32, num_warps=4, num_stages=None, wy_warps=4)  # None: the variant default
    tunes = [dict(base, variant=v) for v in VARIANTS]
    if gb.SMOKE:
        Ts = tuple(gb.sz(T) * 2 for T in Ts)
    for tune in tunes:
        try:
            _, err = gb.time_jax_prefill([1000, 64, 1, 3031] if not gb.SMOKE else [17, 64, 1, 70], tune, 1,
                                         check=True)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            err = repr(e)[:300]
        for T in Ts:
            row = dict(kind="prefill_variant", T=T, tune=tune, rel_err_o_state=err)
            try:
                for stop in (True, False):
                    wall, _ = gb.time_jax_prefill([T], tune, 3 if gb.SMOKE else 10, stop=stop)
                    dev, top = device_time(prefill_once([T], tune, stop), reps=2 if gb.SMOKE else 5)
                    key = "k1" if stop else "all"
                    row[key + "_wall_ms"] = wall * 1e3
                    row[key + "_dev_ms"] = dev * 1e3 if dev else None
                    row[key + "_top_ms"] = {k: v * 1e3 for k, v in top.items()}
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row["error"] = repr(e)[:300]
            log(row)
            RESULTS.append(row)


def prefill_once(lens, tune, stop):
    """A zero-argument callable running one prefill (state donated and carried), for device_time."""
    T = int(sum(lens))
    q, k, v, g, beta = gb.inputs(jax.random.PRNGKey(T), 1, T)
    run, _, _ = gb.jax_prefill_fn(lens, tune)
    box = [jax.random.normal(jax.random.PRNGKey(1), (len(lens), gb.HV, gb.D, gb.D), jnp.float32) * 0.1]

    def once():
        out, box[0] = run(q, k, v, g, beta, box[0], stop)
        return out
    return once


def decode_child(B, T, unrolled):
    """Per-layer time of 36 decode kernels: wall (back-to-back calls) and summed kernel device time."""
    L, reps = 36, 4
    tune = dict(block_v=16, num_warps=2) if B < 16 else dict(block_v=64, num_warps=4)
    if gb.SMOKE:
        tune = dict(tune, interpret=True, block_v=16)
    if not unrolled:
        t, _ = gb.time_jax_decode(L, B, T, tune)
        return dict(wall_us_per_layer=t * 1e6)
    states, xs, slots, rc = gb.decode_setup(L, B, T)

    def step(states, xs, slots, rc):  # `reps` steps of L layers unrolled: no while loop in the program
        acc = jnp.float32(0)
        for _ in range(reps):
            new = []
            for l in range(L):
                q, k, v, g, beta = xs[l]
                o, s = recurrent_gated_delta_rule_slots_pallas(q, k, v, g, beta, state=states[l], slots=slots,
                                                               read_col=rc, scale=gb.SCALE, use_qk_l2norm=True,
                                                               **tune)
                acc = acc + o[..., 0].astype(jnp.float32).sum()
                new.append(s)
            states = new
        return states, acc

    f = jax.jit(step, donate_argnums=(0,))
    box = [states]

    def once():
        box[0], acc = f(box[0], xs, slots, rc)
        return acc
    jax.block_until_ready(once())
    wall = gb.bench_host(once, 10, reps=3) / (L * reps)
    dev, top = device_time(lambda: once(), reps=3)
    return dict(wall_us_per_layer=wall * 1e6, device_us_per_layer=(dev / (L * reps) * 1e6) if dev else None,
                top_kernels_us_per_layer={k: v / (L * reps) * 1e6 for k, v in top.items()})


FLAG_SETS = {
    "default": "",
    "cmd_buffer_all": ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,CUBLAS,CUBLASLT,WHILE,CONDITIONAL "
                       "--xla_gpu_graph_min_graph_size=1"),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode-child", default=None, help="B,T,unrolled")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--only-prefill-variants", action="store_true")
    ap.add_argument("--prefill-T", default="16384,65536", help="comma-separated T for the variant table")
    args = ap.parse_args()
    if args.decode_child:
        B, T, u = (int(x) for x in args.decode_child.split(","))
        try:
            print("RESULT " + json.dumps(decode_child(B, T, bool(u))), flush=True)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            print("RESULT " + json.dumps(dict(error=repr(e)[:300])), flush=True)
        return
    log("device:", jax.devices()[0].device_kind, "jax", jax.__version__)
    if not args.skip_prefill:
        prefill_kernel_variants(tuple(int(x) for x in args.prefill_T.split(",")))
    for name, flags in (() if args.only_prefill_variants else FLAG_SETS.items()):
        for B, T, u in [(1, 1, 1), (2, 1, 1)]:
            env = dict(os.environ, XLA_FLAGS=flags)
            p = subprocess.run([sys.executable, __file__, "--decode-child", f"{B},{T},{u}"], env=env,
                               capture_output=True, text=True, timeout=300)
            res = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            row = dict(kind="decode", flags=name, B=B, T=T, unrolled=bool(u),
                       **(json.loads(res[-1][7:]) if res else dict(error=p.stderr[-400:])))
            log(row)
            RESULTS.append(row)
    if not args.skip_prefill and not args.only_prefill_variants:
        prefill_variants(16384)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gdn_probe.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    log("\n| probe | result |")
    for r in RESULTS:
        if r["kind"] == "decode":
            log(f"| decode {r['flags']} B={r['B']} T={r['T']} unrolled={r['unrolled']} | wall "
                f"{r.get('wall_us_per_layer', float('nan')):.2f} us/layer, device {r.get('device_us_per_layer')} |")
        elif r["kind"] == "prefill_variant":
            f = lambda key: "n/a" if r.get(key) is None else f"{r[key]:.3f}"  # noqa: E731
            t = r["tune"]
            log(f"| prefill variant={t['variant']} BV={t['block_v']} nw={t['num_warps']} ns={t['num_stages']} "
                f"T={r['T']} | K1 dev "
                f"{f('k1_dev_ms')} ms (wall {f('k1_wall_ms')}), all dev {f('all_dev_ms')} ms (wall "
                f"{f('all_wall_ms')}) err {r.get('rel_err_o_state')} {r.get('error', '')} |")
        else:
            log(f"| prefill {r['tune']} | {r.get('ms', float('nan')):.3f} ms (K1 {r.get('k1_ms', float('nan')):.3f}, "
                f"K2 {r.get('k2_ms', float('nan')):.3f}) err {r.get('rel_err_o_state')} |")


if __name__ == "__main__":
    main()
