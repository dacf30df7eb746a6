"""Does launching a jitted GPU program block while the same program's previous launch still runs? (issue 16)

The async engine launches decode step n + 1 while step n runs; at 48 layers on the H100 that launch spends ~7.4 ms
inside jax's call (bench/results/async_probe_48layers_async_h100.*) against 1.3 ms for the plain engine, whose
launches find the device idle. XLA runs a step as a CUDA graph (command buffer) and updates the graph when the
step's buffers moved (new input and output arrays every step: `CommandBufferThunk::ExecuteOnStream` re-records
the commands). This probe times back-to-back, non-blocking launches of one program of ~`--ops` small kernels:

* same:      one executable, new input arrays every call (what the async engine does)
* stable:    one executable, the same input arrays every call (nothing to update but the outputs)
* alternate: two executables of the same program (two jitted functions), used in turn: each one's graph is idle
             when it is updated
* twin:      `alternate` with the second executable made by serializing the first and loading it again
             (jax.experimental.serialize_executable: no second compile), as an engine would
* no_graph:  `same` with XLA's command buffers off (its own process: XLA_FLAGS is read once)

If `same` blocks for about a program's device time and `alternate` does not, the engine should keep two
executables per decode step and alternate them in async mode.

    PYTHONPATH=. python3 tools/cmdbuf_probe.py --out $OUT/cmdbuf_probe.json        (~1 min on an H100)
    JAX_PLATFORMS=cpu PYTHONPATH=. python3 tools/cmdbuf_probe.py --ops 50 --calls 5   (CPU check of the script)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental import serialize_executable


def program(ops: int, width: int):
    """A chain of `ops` small matmul + nonlinearity kernels on a [8, width] state, with a donated [4M] buffer
    updated in place (as the engine's store) -> a function (x, store, w) -> (y, store)."""

    def f(x, store, w):
        h = x
        for i in range(ops):
            h = jnp.tanh(h @ w[i % w.shape[0]] + i * 1e-3)
        store = store.at[:8].add(h[:, 0])
        return h.sum(axis=1), store

    return f


def time_launches(calls, n: int, fresh_inputs: bool, x0, store, w):
    """Back-to-back launches of calls[i % len(calls)], never blocking in between; host ms per launch."""
    xs = [x0 + i for i in range(n)] if fresh_inputs else [x0] * n
    jax.block_until_ready(xs)
    out = []
    times = []
    t_all = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        y, store = calls[i % len(calls)](xs[i], store, w)
        times.append((time.perf_counter() - t0) * 1e3)
        out.append(y)
    jax.block_until_ready((out, store))
    wall = (time.perf_counter() - t_all) * 1e3 / n
    return dict(launch_ms_median=statistics.median(times[2:]), launch_ms_max=max(times[2:]), wall_ms_per_call=wall), store


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=1500)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--only", default=None, help="run one case in this process (used for no_graph)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    f = program(a.ops, a.width)
    key = jax.random.key(0)
    w = jax.random.normal(key, (8, a.width, a.width), jnp.float32) / a.width ** 0.5
    x0 = jnp.ones((8, a.width), jnp.float32)
    store = jnp.zeros((1 << 22,), jnp.float32)
    one = jax.jit(f, donate_argnums=1)
    other = jax.jit(lambda x, s, w: f(x, s, w), donate_argnums=1)  # another function: its own executable
    compiled = jax.jit(f, donate_argnums=1).lower(x0, store, w).compile()
    twin = serialize_executable.deserialize_and_load(*serialize_executable.serialize(compiled))
    t0 = time.perf_counter()
    for g in (one, other, compiled, twin):
        _, store = g(x0, store, w)
        _, store = g(x0 + 1, store, w)  # a first update after the warm-up launch
    jax.block_until_ready(store)
    compile_s = time.perf_counter() - t0
    # device time of one launch, the device idle before it
    y, store = one(x0, store, w)
    jax.block_until_ready((y, store))
    t0 = time.perf_counter()
    y, store = one(x0 + 2, store, w)
    jax.block_until_ready((y, store))
    device_ms = (time.perf_counter() - t0) * 1e3
    cases = {"same": ([one], True), "stable": ([one], False), "alternate": ([one, other], True),
             "twin": ([compiled, twin], True)}
    if a.only:
        cases = {a.only: cases["same"]}
    res = {}
    for name, (calls, fresh) in cases.items():
        res[name], store = time_launches(calls, a.calls, fresh, x0, store, w)
    out = dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__, ops=a.ops, width=a.width,
               calls=a.calls, compile_s=compile_s, one_launch_idle_ms=device_ms,
               xla_flags=os.environ.get("XLA_FLAGS", ""), cases=res)
    if not a.only and jax.default_backend() == "gpu":  # command buffers off: its own process
        env = dict(os.environ, XLA_FLAGS="--xla_gpu_enable_command_buffer=")
        run = subprocess.run([sys.executable, __file__, "--ops", str(a.ops), "--width", str(a.width), "--calls",
                              str(a.calls), "--only", "no_graph"], capture_output=True, text=True, env=env)
        try:
            out["cases"]["no_graph"] = json.loads(run.stdout.strip().splitlines()[-1])["cases"]["no_graph"]
        except (IndexError, ValueError, KeyError):
            out["no_graph_error"] = (run.stdout + run.stderr)[-2000:]
    print(json.dumps(out))
    if not a.only:
        print(f"{out['device']}: {a.ops} ops, one launch on an idle device {device_ms:.2f} ms (wall)")
        print(f"{'case':10} {'launch ms':>10} {'max':>8} {'wall ms/call':>13}")
        for name, r in out["cases"].items():
            print(f"{name:10} {r['launch_ms_median']:10.3f} {r['launch_ms_max']:8.3f} {r['wall_ms_per_call']:13.3f}")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
