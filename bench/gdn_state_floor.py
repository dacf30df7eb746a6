"""What the decode state traffic alone costs on the GPU (issue 5's decode target): kernels that only read and write
one layer's fp32 recurrent state of B sequences in place, timed like bench/gdn.py's decode (one jit, a fori_loop of
steps x L layers with distinct states per layer, profiler device time per layer).

* `xla`: one in-place XLA fusion per layer: the B rows of the state times 1.0001 written back
  (dynamic_slice + dynamic_update_slice on a donated buffer);
* `pallas_bvN`: a Pallas kernel with the decode kernel's grid (B, Hv, Dv / BV) that loads each [Dk, BV] state
  block by slot and stores it scaled, in place (input_output_aliases): the decode kernel minus its math;
* `decode_kernel`: the real decode kernel (pallas_kernels/gdn_decode.py, default config, T = 1), in the same run,
  timed by bench/gdn.py's own function (its kernel device time per layer).

The issue's floor (1.5x of which is the target) is the state's bytes at the copy bandwidth of a 2 GiB copy; these
rows say how far a single kernel of this size gets from that floor before any math.

  PYTHONPATH=. python3 bench/gdn_state_floor.py [--out $OUT/gdn_state_floor.json]
  GDN_BENCH_SMOKE=1 JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/gdn_state_floor.py   # CPU check (interpret)
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from bench.quant_matmul import copy_bandwidth, device_time
from bench.results_io import save_result

SMOKE = bool(os.environ.get("GDN_BENCH_SMOKE"))
HV, D = (4, 32) if SMOKE else (48, 128)
L = 2 if SMOKE else 36
REPS = 2 if SMOKE else 20


def _copy_kernel(slots_ref, s_in_ref, s_out_ref, *, bv):
    del s_in_ref  # aliased with s_out_ref
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * bv, bv)
    row = slots_ref[b]
    s_out_ref[row, h, :, cols] = s_out_ref[row, h, :, cols] * 1.0001


def pallas_state_pass(state, slots, bv, num_warps):
    """state [rows, Hv, Dk, Dv] fp32: rows `slots` read and written in place, nothing else touched."""
    kw = {}
    if not SMOKE:
        from jax.experimental.pallas import triton as pltriton
        kw["compiler_params"] = pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
    return pl.pallas_call(
        functools.partial(_copy_kernel, bv=bv), grid=(slots.shape[0], HV, D // bv),
        out_shape=jax.ShapeDtypeStruct(state.shape, state.dtype), input_output_aliases={1: 0},
        interpret=SMOKE, name=f"state_pass_bv{bv}", **kw)(slots, state)


def xla_state_pass(state, row0, b):
    rows = jax.lax.dynamic_slice_in_dim(state, row0, b, axis=0)
    return jax.lax.dynamic_update_slice_in_dim(state, rows * 1.0001, row0, axis=0)


def time_variant(b, variant, layers=L):
    ns = 2 * b + 1
    states = [jax.random.normal(jax.random.key(l), (ns, HV, D, D), jnp.float32) for l in range(layers)]
    slots = jnp.arange(1, b + 1, dtype=jnp.int32)  # contiguous rows (the XLA variant takes one slice)

    def layer(s):
        if variant == "xla":
            return xla_state_pass(s, 1, b)
        bv, nw = {"pallas_bv32": (32, 4), "pallas_bv16": (16, 2), "pallas_bv64": (64, 4)}[variant]
        return pallas_state_pass(s, slots, min(bv, D), nw)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(states):
        return jax.lax.fori_loop(0, REPS, lambda i, st: [layer(s) for s in st], states)

    box = [step(states)]

    def once():
        box[0] = step(box[0])
        return box[0]
    jax.block_until_ready(once())
    if SMOKE:
        return None
    dev, top = device_time(once, reps=2, top=4)
    return dev / (layers * REPS), top


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = None if SMOKE else copy_bandwidth()
    rows = []
    for b in (1, 2, 16):
        floor = None if SMOKE else 2 * b * HV * D * D * 4 / bw
        for variant in ("xla", "pallas_bv32", "pallas_bv16", "pallas_bv64", "decode_kernel",
                        "pallas_bv32_l2_resident", "decode_kernel_l2_resident"):
            # *_l2_resident: one layer's state passed REPS times in a row, so it stays in the 50 MB L2 (what a
            # prefetch of the state into L2 while the previous layer runs could give at best)
            layers = 1 if variant.endswith("_l2_resident") else L
            if variant.startswith("decode_kernel"):
                from bench import gdn
                if SMOKE:
                    continue
                _, t_kernel = gdn.time_jax_decode(layers, b, 1, {})
                res = (t_kernel, {})
            else:
                res = time_variant(b, variant.removesuffix("_l2_resident"), layers)
            if res is None:
                print(f"B={b} {variant}: ran (smoke)", flush=True)
                continue
            t, top = res
            row = dict(B=b, variant=variant, us_per_layer=t * 1e6, floor_us=floor * 1e6, over_floor=t / floor,
                       top_kernels_us={k: v * 1e6 / (layers * REPS) for k, v in top.items()})
            rows.append(row)
            print(f"B={b:2d} {variant:25s} {t * 1e6:6.2f} us/layer  floor {floor * 1e6:5.2f} us  "
                  f"{t / floor:4.2f}x floor", flush=True)
    if SMOKE:
        return
    save_result("gdn_state_floor.json", rows, args.out, copy_bandwidth_tb_s=bw / 1e12, layers=L, steps=REPS,
                floor="2 x B x Hv x Dk x Dv x 4 bytes at the copy bandwidth (issue 5's state-traffic floor)")
    print(f"\n{'B':>3} {'variant':25s} {'us/layer':>8} {'x floor':>7}")
    for r in rows:
        print(f"{r['B']:3d} {r['variant']:25s} {r['us_per_layer']:8.2f} {r['over_floor']:7.2f}")


if __name__ == "__main__":
    main()
