"""Does the engine step update the store in place? Prints, per engine step, whether each page leaf of the store
kept its device buffer (donated and aliased) or moved (copied: twice the leaf's memory at that moment).

The H200 run of bench/long_context.py (stop 25) failed allocating exactly one QSA pool leaf (22.12 GiB) in the
step although XLA's memory analysis said the store is donated in place: this finds out on which device and path.

  PYTHONPATH=. python3 tools/donation_probe.py                   # demo model, bf16 (the kernels on a GPU)
  FLASHNEXT_KERNELS=reference PYTHONPATH=. python3 tools/donation_probe.py
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

import flashnext_jax as fj
from flashnext_jax.engine import Engine, EngineConfig
from flashnext_jax.runner import RealRunner
from flashnext_jax.sampling import SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--leaf-gib", type=float, default=0.0,
                    help="size the pool so its largest page leaf holds about this many GiB (0: the default pool); "
                         "a copied leaf then shows as that much extra peak device memory in a step")
    args = ap.parse_args()
    model = fj.load(dtype="bfloat16")
    runner = RealRunner(model, 0)
    num_pages = None
    if args.leaf_gib:
        page = runner.store_spec().page
        per_page = max(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize * 16 for leaf in page.values())
        num_pages = int(args.leaf_gib * 2**30 / per_page)
    eng = Engine(runner, EngineConfig(max_num_seqs=1, max_num_batched_tokens=32, max_model_len=256,
                                      page_size=16, compile_ahead=False, num_pages=num_pages))
    leaf_bytes = max(v.nbytes for v in eng.ledger.store.page.values())

    def ptrs():
        leaves = {**{f"page.{k}": v for k, v in eng.ledger.store.page.items()},
                  **{f"slot.{k}": v for k, v in eng.ledger.store.slot.items()},
                  **{f"snap.{k}": v for k, v in eng.ledger.store.snap.items()}}
        return {k: v.unsafe_buffer_pointer() for k, v in leaves.items()}

    print(jax.devices()[0].device_kind, "kernels", os.environ.get("FLASHNEXT_KERNELS", "auto"), flush=True)
    eng.add_request("r", list(range(1, 70)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    prev = ptrs()
    print("distinct buffers:", len(set(prev.values())) == len(prev), flush=True)
    stats = jax.devices()[0].memory_stats  # None on backends without statistics (the CPU)
    print(f"largest page leaf {leaf_bytes / 2**30:.3f} GiB", flush=True)
    while eng.has_unfinished():
        before = stats() if stats() else {}
        eng.step()
        jax.block_until_ready(eng.ledger.store)
        now = ptrs()
        moved = [k for k in now if now[k] != prev[k]]
        after = stats() if stats() else {}
        mem = ""
        if after:  # peak is monotone: a step that raises it above the store + weights shows how much it needed
            mem = (f"; in use {after['bytes_in_use'] / 2**30:.3f} GiB, peak {after['peak_bytes_in_use'] / 2**30:.3f}"
                   f" GiB (+{(after['peak_bytes_in_use'] - before['bytes_in_use']) / 2**30:.3f} over the start)")
        print(f"step {eng.step_id}: moved {moved or 'nothing'}{mem}", flush=True)
        prev = now


if __name__ == "__main__":
    main()
