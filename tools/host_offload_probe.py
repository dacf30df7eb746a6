"""Which host-memory patterns does this JAX/XLA backend compile, and do they give the right values? A pool of
pages lives in pinned host memory (memory_kind="pinned_host"); a jitted program fetches some of its pages to
the device, or writes new entries into it in place. Prints one table row per pattern: compiled or not (the error's
first line), values equal to numpy, the output's memory kind, XLA's temporaries (a whole-pool copy to the device
shows up there) and the median time per call.

Why: issue 14 item 6 (QSA KV host offload, docs/long-context.md "Host offload") needs the QSA K/V pages on the
host and only the selected blocks on the device; which of these a GPU backend lowers decides the design.

  JAX_PLATFORMS=cpu PYTHONPATH=. python tools/host_offload_probe.py --pages 64            # CPU, seconds
  PYTHONPATH=. python3 tools/host_offload_probe.py                                      # GPU: 128K tokens of a layer
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.results_io import save_result  # noqa: E402

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


def patterns(n_units: int, unit: int):
    """name -> (what it does, fn(pool, idx, new) -> output, donate pool?, expected(pool, idx, new) in numpy).
    pool [P, R, D] in pinned host memory; idx [n_units] int32 (page, row) pairs flattened as page * R + row, with
    `unit` rows fetched from each; new [n_units, unit, D] entries to write."""

    def rows(pool, i):  # `unit` rows starting at flat row i, as [unit, D]
        p, r = i // pool.shape[1], i % pool.shape[1]
        return jax.lax.dynamic_slice(pool, (p, r, 0), (1, unit, pool.shape[2]))[0]

    def ref_rows(pool, idx):
        R = pool.shape[1]
        return np.stack([pool[i // R, i % R: i % R + unit] for i in idx])

    def ref_write(pool, idx, new):
        out = pool.copy()
        R = pool.shape[1]
        for i, v in zip(idx, new):
            out[i // R, i % R: i % R + unit] = v
        return out

    def whole(pool, idx, new):  # the whole pool to the device, then a gather: correct, but no memory saved
        d = jax.device_put(pool, DEVICE)
        return jax.vmap(lambda i: rows(d, i))(idx)

    def take(pool, idx, new):  # a gather on the host operand, the result moved to the device
        R = pool.shape[1]
        flat_rows = (idx // R)[:, None] * R + idx[:, None] % R + jnp.arange(unit)
        g = jnp.take(pool.reshape(-1, pool.shape[2]), flat_rows.reshape(-1), axis=0)
        return jax.device_put(g, DEVICE).reshape(n_units, unit, -1)

    def loop(pool, idx, new):  # one dynamic_slice per unit from the host, moved to the device, into a device buffer
        def body(j, out):
            return jax.lax.dynamic_update_slice(out, jax.device_put(rows(pool, idx[j]), DEVICE)[None], (j, 0, 0))
        return jax.lax.fori_loop(0, n_units, body, jnp.zeros((n_units, unit, pool.shape[2]), pool.dtype))

    def scan(pool, idx, new):  # the same as a scan over the indices (the documented parameter-streaming shape)
        return jax.lax.scan(lambda c, i: (c, jax.device_put(rows(pool, i), DEVICE)), 0, idx)[1]

    def page_scan(pool, idx, new):  # whole pages to the device, the unit's rows cut there
        R = pool.shape[1]

        def body(c, i):
            page = jax.device_put(jax.lax.dynamic_index_in_dim(pool, i // R, 0, False), DEVICE)
            return c, jax.lax.dynamic_slice_in_dim(page, i % R, unit)
        return jax.lax.scan(body, 0, idx)[1]

    def take_host_idx(pool, idx, new):  # the gather with its indices moved to the host too
        R = pool.shape[1]
        flat_rows = (idx // R)[:, None] * R + idx[:, None] % R + jnp.arange(unit)
        g = jnp.take(pool.reshape(-1, pool.shape[2]), jax.device_put(flat_rows.reshape(-1), HOST), axis=0)
        return jax.device_put(g, DEVICE).reshape(n_units, unit, -1)

    def write_loop(pool, idx, new):  # in-place writes: dynamic_update_slice of the host pool, donated
        R = pool.shape[1]

        def body(j, pool):
            v = jax.device_put(new[j], HOST)[None]
            return jax.lax.dynamic_update_slice(pool, v, (idx[j] // R, idx[j] % R, 0))
        return jax.lax.fori_loop(0, n_units, body, pool)

    def write_scatter(pool, idx, new):  # in-place writes: one scatter into the host pool, donated
        R = pool.shape[1]
        rows_ = idx[:, None] % R + jnp.arange(unit)
        return pool.at[(idx // R)[:, None], rows_].set(jax.device_put(new, HOST))

    def write_on_host(pool, idx, new):  # the scatter computed on the host (compute_on "device_host")
        from jax.experimental.compute_on import compute_on
        R = pool.shape[1]
        rows_ = idx[:, None] % R + jnp.arange(unit)
        fn = compute_on(compute_type="device_host", out_memory_spaces=HOST)(
            lambda p, a, b, v: p.at[a, b].set(v))
        return fn(pool, jax.device_put((idx // R)[:, None], HOST), jax.device_put(rows_, HOST),
                  jax.device_put(new, HOST))

    def take_on_host(pool, idx, new):  # the gather computed on the host, then moved to the device
        from jax.experimental.compute_on import compute_on
        R = pool.shape[1]
        rows_ = idx[:, None] % R + jnp.arange(unit)
        fn = compute_on(compute_type="device_host", out_memory_spaces=HOST)(lambda p, a, b: p[a, b])
        g = fn(pool, jax.device_put((idx // R)[:, None], HOST), jax.device_put(rows_, HOST))
        return jax.device_put(g, DEVICE)

    fetch = lambda p, i, n: ref_rows(p, i)  # noqa: E731
    write = ref_write
    return {
        "whole_pool_to_device": ("device_put(pool) then gather", whole, False, fetch),
        "take_host": ("jnp.take on the host pool, device_put result", take, False, fetch),
        "take_host_idx": ("jnp.take, pool and indices on the host", take_host_idx, False, fetch),
        "fori_dslice": ("fori_loop: dynamic_slice host -> device_put -> DUS device", loop, False, fetch),
        "scan_dslice": ("scan over idx: dynamic_slice host -> device_put", scan, False, fetch),
        "scan_page": ("scan over idx: whole page host -> device_put", page_scan, False, fetch),
        "take_compute_on_host": ("compute_on(device_host) gather, device_put result", take_on_host, False, fetch),
        "write_fori_dus": ("fori_loop: device_put(new, Host) -> DUS host pool (donated)", write_loop, True, write),
        "write_scatter": ("scatter into host pool (donated)", write_scatter, True, write),
        "write_compute_on_host": ("compute_on(device_host) scatter (donated)", write_on_host, True, write),
    }


def run_one(name, fn, donate, expected, pool_np, idx_np, new_np, host_sharding, dev_sharding, repeats):
    row = dict(pattern=name, compiles=False, correct=None, out_memory_kind=None, temp_bytes=None, ms=None, error="")
    out_sh = host_sharding if donate else dev_sharding
    try:
        jitted = jax.jit(fn, donate_argnums=(0,) if donate else (), out_shardings=out_sh)
        args = lambda: (jax.device_put(pool_np, host_sharding), jnp.asarray(idx_np), jnp.asarray(new_np))  # noqa: E731
        a = args()
        compiled = jitted.lower(*a).compile()
        row["compiles"] = True
        m = compiled.memory_analysis()
        row["temp_bytes"] = int(m.temp_size_in_bytes) if m is not None else None
        row["host_annotations"] = compiled.as_text().count("S(5)")
        out = compiled(*a)
        row["out_memory_kind"] = out.sharding.memory_kind
        got = np.asarray(jax.device_get(out)).astype(np.float32)
        row["correct"] = bool(np.array_equal(got, expected(pool_np, idx_np, new_np).astype(np.float32)))
        times = []
        for _ in range(repeats):
            a = args() if donate else a
            jax.block_until_ready(a)
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*a))
            times.append(time.perf_counter() - t0)
        row["ms"] = 1e3 * float(np.median(times))
    except Exception as e:  # noqa: BLE001 - the point is to record what fails
        row["error"] = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        if os.environ.get("PROBE_TRACEBACK"):
            traceback.print_exc()
    return row


def device_baseline(pool_np, idx_np, unit, dev_sharding, repeats):
    """The same fetch from a pool in device memory (what the on-device engine does): ms per call."""
    pool = jax.device_put(pool_np, dev_sharding)
    R = pool.shape[1]
    f = jax.jit(lambda p, i: jax.vmap(lambda j: jax.lax.dynamic_slice(p, (j // R, j % R, 0), (1, unit, p.shape[2]))[0])(i))
    idx = jnp.asarray(idx_np)
    jax.block_until_ready(f(pool, idx))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(pool, idx))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=2048, help="pages in the pool (2,048 x 64 = 128K tokens)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--width", type=int, default=2 * 256, help="entries per token (kv heads x head dim)")
    ap.add_argument("--units", type=int, default=513, help="fetches per call (512 blocks + the tail)")
    ap.add_argument("--unit", type=int, default=4, help="rows per fetch (one QSA block: 4 tokens)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/host_offload_probe.json if $OUT is set)")
    args = ap.parse_args()

    dev = jax.devices()[0]
    kinds = [m.kind for m in dev.addressable_memories()]
    print(f"device {dev.device_kind} ({dev.platform}), jax {jax.__version__}, memories {kinds}", flush=True)
    host_sh = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    dev_sh = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    rng = np.random.default_rng(0)
    dtype = jnp.dtype(args.dtype)
    pool_np = rng.standard_normal((args.pages, args.page_size, args.width), np.float32).astype(dtype)
    R = args.page_size
    idx_np = (rng.integers(0, args.pages, args.units) * R + rng.integers(0, R // args.unit, args.units) * args.unit
              ).astype(np.int32)
    idx_np = np.unique(idx_np)  # distinct destinations (the writes' expected value is then order-free)
    new_np = rng.standard_normal((len(idx_np), args.unit, args.width), np.float32).astype(dtype)

    rows = []
    for name, (what, fn, donate, expected) in patterns(len(idx_np), args.unit).items():
        row = run_one(name, fn, donate, expected, pool_np, idx_np, new_np, host_sh, dev_sh, args.repeats)
        row["what"] = what
        rows.append(row)
        print(f"  {name}: {'ok' if row['correct'] else row['error'] or 'WRONG'}", flush=True)
    base = device_baseline(pool_np, idx_np, args.unit, dev_sh, args.repeats)

    pool_bytes = pool_np.nbytes
    print(f"\npool {pool_bytes / 2**20:.1f} MiB in pinned_host; {len(idx_np)} fetches of {args.unit} rows; "
          f"the same fetch from a device pool: {base:.3f} ms")
    print(f"{'pattern':24s} {'compiles':8s} {'correct':7s} {'out kind':12s} {'temp MiB':>9s} {'ms':>9s}  error")
    for r in rows:
        temp = "-" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.1f}"
        ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
        print(f"{r['pattern']:24s} {str(r['compiles']):8s} {str(r['correct']):7s} {str(r['out_memory_kind']):12s} "
              f"{temp:>9s} {ms:>9s}  {r['error']}")
    if args.out or os.environ.get("OUT"):
        print("wrote", save_result("host_offload_probe.json", rows, args.out, platform=dev.platform, memories=kinds,
                                   pool_bytes=pool_bytes, fetches=len(idx_np), unit=args.unit, device_fetch_ms=base))


if __name__ == "__main__":
    main()
