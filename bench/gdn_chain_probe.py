"""What one chunk step of the GDN prefill's sequential kernel (K2) costs, taken apart (issue 5's prefill target).

K2 walks a sequence's 64-token chunks in order with the [Dk, BV] fp32 state S in registers; at T = 16K it takes
~1.0 ms for 256 steps, ~3.9 us per step with 192 programs at B = 1 (docs/kernels-gdn.md). Earlier probes changed
one thing at a time (a third of the instructions, 1-2 pipeline stages, BV 16-64) and none moved it, which leaves
open whether the step waits on its loads or on its own dependent dots. These synthetic kernels have K2's grid
(Hv, Dv / BV), step count and tile shapes, and add one part at a time:

* `dots`:    the S chain alone, its tiles loaded once before the loop: v' = u - w S; S = d S + k~^T v'
             (two dependent bf16 tensor-core dots per step, S converted to bf16 for the first);
* `chain`:   the same with w, k~, u and the chunk decay d loaded per chunk (what an FLA-style state kernel does);
* `chain_o`: `chain` plus the outputs K2 also computes: q, A loaded, o = q S + A v' stored per chunk;
* `k2`:      the real K2 (pallas_kernels/gdn_prefill.py `_state_kernel`) from a whole prefill at the same T,
             its kernel time read from the profiler.

Each at 1-3 pipeline stages (Triton's software pipelining of the in-loop loads). Per-step time = kernel device
time / chunks. If `dots` alone costs most of K2's step, the dependent tensor-core chain as Triton emits it is the
bound and only a different kernel (Mosaic GPU, wgmma with S in registers) can shorten it; if `chain` costs much
more than `dots`, the loads are not hidden and a load schedule can.

  PYTHONPATH=. python3 bench/gdn_chain_probe.py [--out $OUT/gdn_chain_probe.json]
  GDN_BENCH_SMOKE=1 JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/gdn_chain_probe.py   # CPU check (interpret)
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

from bench.quant_matmul import device_time
from bench.results_io import save_result

SMOKE = bool(os.environ.get("GDN_BENCH_SMOKE"))
HV, D, BV = (2, 32, 16) if SMOKE else (48, 128, 32)
C = 64
T = 4 * C if SMOKE else 16384
MODES = ("dots", "chain", "chain_o")


def _chain_kernel(w_ref, kt_ref, u_ref, q_ref, a_ref, d_ref, o_ref, s_ref, *, mode):
    h, jv = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(jv * BV, BV)
    nch = w_ref.shape[1] // C
    dt = jnp.bfloat16

    def tiles(c):
        rows = pl.ds(c * C, C)
        return w_ref[h, rows, :], kt_ref[h, rows, :], u_ref[h, rows, cols].astype(jnp.float32), d_ref[h, c]

    fixed = tiles(0)

    def body(c, S):
        w, kt, u, d = fixed if mode == "dots" else tiles(c)
        vnew = u - jnp.dot(w, S.astype(dt), preferred_element_type=jnp.float32)
        if mode == "chain_o":
            rows = pl.ds(c * C, C)
            o = (jnp.dot(q_ref[h, rows, :], S.astype(dt), preferred_element_type=jnp.float32)
                 + jnp.dot(a_ref[h, rows, :], vnew.astype(dt), preferred_element_type=jnp.float32))
            o_ref[h, rows, cols] = o.astype(o_ref.dtype)
        return S * d + jnp.dot(kt.T, vnew.astype(dt), preferred_element_type=jnp.float32)

    S = jax.lax.fori_loop(0, nch, body, jnp.zeros((D, BV), jnp.float32))
    s_ref[h, :, cols] = S


@functools.partial(jax.jit, static_argnames=("mode", "num_stages"))
def chain(w, kt, u, q, a, d, *, mode, num_stages):
    kw = {}
    if not SMOKE:
        from jax.experimental.pallas import triton as pltriton
        kw["compiler_params"] = pltriton.CompilerParams(num_warps=4, num_stages=num_stages)
    return pl.pallas_call(
        functools.partial(_chain_kernel, mode=mode), grid=(HV, D // BV),
        out_shape=(jax.ShapeDtypeStruct(u.shape, jnp.bfloat16), jax.ShapeDtypeStruct((HV, D, D), jnp.float32)),
        interpret=SMOKE, name=f"chain_{mode}", **kw)(w, kt, u, q, a, d)


def synthetic_inputs():
    ks = jax.random.split(jax.random.key(0), 6)
    nch = T // C
    scaled = lambda k, shape, s: (jax.random.normal(k, shape, jnp.float32) * s).astype(jnp.bfloat16)  # noqa: E731
    w = scaled(ks[0], (HV, T, D), 0.05)
    kt = scaled(ks[1], (HV, T, D), 0.05)
    u = scaled(ks[2], (HV, T, D), 1.0)
    q = scaled(ks[3], (HV, T, D), 0.05)
    a = scaled(ks[4], (HV, T, C), 0.05)
    d = jax.random.uniform(ks[5], (HV, nch), jnp.float32, 0.5, 1.0)
    return w, kt, u, q, a, d


def reference(w, kt, u, q, a, d, *, mode):
    """The same recurrence in plain JAX (fp32), to check what a probe kernel computes."""
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    split = lambda x: f32(x).reshape(HV, T // C, C, -1).swapaxes(0, 1)  # noqa: E731
    W, K, U, Q, A = (split(t) for t in (w, kt, u, q, a))
    if mode == "dots":
        W, K, U = (jnp.broadcast_to(t[:1], t.shape) for t in (W, K, U))

    def step(S, xs):
        w_, k_, u_, q_, a_, d_ = xs
        vnew = u_ - w_ @ S
        o = q_ @ S + a_ @ vnew
        return S * d_[:, None, None] + k_.swapaxes(1, 2) @ vnew, o
    d = d if mode != "dots" else jnp.broadcast_to(d[:, :1], d.shape)
    S, o = jax.lax.scan(step, jnp.zeros((HV, D, D), jnp.float32), (W, K, U, Q, A, d.T))
    return o.swapaxes(0, 1).reshape(HV, T, D), S


def real_k2_us_per_step():
    """The real K2's kernel time per chunk step in a B=1 prefill of T tokens (bench/gdn.py's inputs and tuning)."""
    from bench import gdn_probe
    once = gdn_probe.prefill_once([T], dict(block_v=32, num_warps=4, num_stages=None, wy_warps=4), False)
    _, top = device_time(once, reps=3, top=8)
    k2 = {name: t for name, t in top.items() if "state" in name}
    return sum(k2.values()) / (T // C) * 1e6, {k: v * 1e3 for k, v in top.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    x = synthetic_inputs()
    rows = []
    for mode in MODES:
        for stages in (1, 2, 3):
            run = functools.partial(chain, *x, mode=mode, num_stages=stages)
            o, S = run()
            o_ref, S_ref = reference(*x, mode=mode)
            err = float(jnp.max(jnp.abs(S - S_ref)) / jnp.max(jnp.abs(S_ref)))
            if mode == "chain_o":
                err = max(err, float(jnp.max(jnp.abs(o.astype(jnp.float32) - o_ref)) / jnp.max(jnp.abs(o_ref))))
            assert err < 0.05, (mode, stages, err)  # bf16 dot operands
            if SMOKE:
                print(f"{mode} stages {stages}: ran (smoke)", flush=True)
                continue
            dev, _ = device_time(run, reps=5, top=2)
            row = dict(mode=mode, num_stages=stages, rel_err=err, kernel_ms=dev * 1e3, us_per_step=dev / (T // C) * 1e6)
            rows.append(row)
            print(row, flush=True)
    if SMOKE:
        return
    k2_step, k2_top = real_k2_us_per_step()
    rows.append(dict(mode="k2", num_stages="default", us_per_step=k2_step, top_kernels_ms=k2_top))
    save_result("gdn_chain_probe.json", rows, args.out, T=T, chunks=T // C, programs=HV * (D // BV), block_v=BV,
                num_warps=4)
    print(f"\n{'mode':8s} {'stages':>7} {'us/step':>8}")
    for r in rows:
        print(f"{r['mode']:8s} {str(r['num_stages']):>7} {r['us_per_step']:8.2f}")


if __name__ == "__main__":
    main()
