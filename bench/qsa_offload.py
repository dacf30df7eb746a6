"""What QSA K/V host offload (`--qsa-kv-offload`, flashnext_jax/qsa_offload.py) costs per decode step at a long
context (issue 14 item 6): the engine's model step (`RealRunner.step`, B = 1, one token) at position `--context`
- 1 with the K/V pages on the device, then in pinned host memory, on the same weights and the same page table.

The real config with random INT4-Mixed weights as bench/long_context.py builds them (`decode_step.build`), page
size 64, the page table one row of `--context` tokens in pages scattered over the pool (whose values are random:
a decode step's work does not depend on them), padded to a power of two as the engine's one width. No prefill
runs: the step's cost depends on the context only through its page table and position. Prints a table and
writes qsa_offload.json (`--out`, else $OUT/, else bench/results/) with a "summary": context, step_ms_offload,
step_ms_device, cost_ratio (offload / device), device_bytes_saved (the K/V pool that moved to the host).

  PYTHONPATH=. python3 bench/qsa_offload.py                     # one GPU, 128K (--experts 256 on an H100)
  JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/qsa_offload.py --tiny --out /tmp/qsa_offload.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from bench import decode_step
from bench.engine_step import RandomPleRunner
from bench.results_io import save_result
from flashnext_jax import api
from flashnext_jax.config import from_hf_config
from flashnext_jax.model_runner import Batch
from flashnext_jax.state_store import StoreDims, StoreLedger, _bucket


def filled_store(runner, num_pages: int, page_size: int):
    """A ledger's store (leaves where the runner's spec puts them) with one allocated slot (0) and random pages."""
    ledger = StoreLedger(runner.store_spec(), StoreDims(2, num_pages, page_size, 1, 1), debug=False)
    ledger.allocate_slot("bench")
    ledger.flush()
    store = ledger.store
    page = {}
    for i, (name, a) in enumerate(sorted(store.page.items())):
        x = jax.random.normal(jax.random.key(i), a.shape, jnp.float32).astype(a.dtype)
        page[name] = jax.device_put(x, a.sharding)  # the host leaves go back to pinned host memory
        del x
    return dataclasses.replace(store, page=page)


def time_decode(runner, params, context: int, num_pages: int, page_size: int, steps: int) -> dict:
    """Median ms of the jitted model step (store donated, as the engine runs it) decoding position context - 1."""
    store = filled_store(runner, num_pages, page_size)
    used = -(-context // page_size)
    width = _bucket(used)
    table = np.full((1, width), -1, np.int32)
    table[0, :used] = np.random.default_rng(0).permutation(num_pages)[:used]
    batch = Batch(slot=jnp.array([0], jnp.int32), gen=jnp.array([1], jnp.int32), tokens=jnp.array([[7]], jnp.int32),
                  n_valid=jnp.array([1], jnp.int32), start=jnp.array([context - 1], jnp.int32),
                  page_table=jnp.asarray(table), host={k: jnp.asarray(v) for k, v in runner.host_prepare([None], 1).items()})
    compiled = jax.jit(runner.step, donate_argnums=(1,)).lower(params, store, batch).compile()
    memory = compiled.memory_analysis()
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        store, out = compiled(params, store, batch)
        jax.block_until_ready(out["logits"])
        if i >= 2:  # the first runs load the program
            times.append(time.perf_counter() - t0)
    where = {n: a.sharding.memory_kind for n, a in store.page.items()}
    host_bytes = sum(a.nbytes for a in store.page.values() if a.sharding.memory_kind != "device")
    return dict(step_ms=statistics.median(times) * 1e3, step_ms_min=min(times) * 1e3, steps=len(times),
                page_memory=where, host_bytes=host_bytes, kv_bytes=store.page["qsa_k"].nbytes + store.page["qsa_v"].nbytes,
                temp_bytes=getattr(memory, "temp_size_in_bytes", None), page_table_width=width)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=131072, help="tokens of context at the decoded position")
    ap.add_argument("--experts", type=int, default=512, help="routed experts kept (real: 512; an H100 fits ~256)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per mode")
    ap.add_argument("--tiny", action="store_true", help="the demo config at a 512-token context (CPU: shapes only)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.context, args.page_size, args.steps = 512, 16, 2
    with open(decode_step.DEMO_CONFIG if args.tiny else decode_step.REAL_CONFIG) as f:
        cfg = from_hf_config(json.load(f))
    cfg = dataclasses.replace(cfg, num_experts=min(args.experts, cfg.num_experts))
    print(f"{jax.devices()[0].device_kind} jax {jax.__version__} experts={cfg.num_experts} context={args.context}",
          flush=True)
    params, _, _ = decode_step.build(cfg, jax.random.key(0))
    model = api.Model(cfg, params, table=None, dtype=jnp.bfloat16)
    device = RandomPleRunner(model, 0)
    num_pages = -(-args.context // args.page_size) + 8
    rows = []
    for name, runner in (("device", device), ("offload", device.with_qsa_kv_offload())):
        row = dict(mode=name) | time_decode(runner, params, args.context, num_pages, args.page_size, args.steps)
        print(row, flush=True)
        rows.append(row)
    dev, off = rows
    summary = dict(context=args.context, step_ms_offload=off["step_ms"], step_ms_device=dev["step_ms"],
                   cost_ratio=off["step_ms"] / dev["step_ms"], device_bytes_saved=off["host_bytes"],
                   device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                   date=time.strftime("%Y-%m-%d", time.gmtime()))
    path = save_result("qsa_offload.json", rows, args.out, summary=summary, tiny=args.tiny, experts=cfg.num_experts,
                       page_size=args.page_size, num_pages=num_pages)
    print(f"wrote {path}\n{'mode':>8} {'ms/step':>8} {'min ms':>8} {'K/V GiB':>8} {'K/V in':>12} {'temp MiB':>9}")
    for r in rows:
        temp = "-" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.1f}"
        print(f"{r['mode']:>8} {r['step_ms']:8.2f} {r['step_ms_min']:8.2f} {r['kv_bytes'] / 2**30:8.2f} "
              f"{r['page_memory']['qsa_k']:>12} {temp:>9}")
    print(f"cost ratio {summary['cost_ratio']:.2f}x at {args.context} tokens; "
          f"{summary['device_bytes_saved'] / 2**30:.2f} GiB of K/V off the device")
    return summary


if __name__ == "__main__":
    main()
