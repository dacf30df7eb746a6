"""Does the engine step update the store in place? Prints, per engine step, whether each page leaf of the store
kept its device buffer (donated and aliased) or moved (copied: twice the leaf's memory at that moment).

The H200 run of bench/long_context.py (stop 25) failed allocating exactly one QSA pool leaf (22.12 GiB) in the
step although XLA's memory analysis said the store is donated in place: this finds out on which device and path.

  PYTHONPATH=. python3 tools/donation_probe.py                   # demo model, bf16 (the kernels on a GPU)
  FLASHNEXT_KERNELS=reference PYTHONPATH=. python3 tools/donation_probe.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax

import flashnext_jax as fj
from flashnext_jax.engine import Engine, EngineConfig
from flashnext_jax.runner import RealRunner
from flashnext_jax.sampling import SamplingParams


def main():
    model = fj.load(dtype="bfloat16")
    eng = Engine(RealRunner(model, 0), EngineConfig(max_num_seqs=1, max_num_batched_tokens=32, max_model_len=256,
                                                    page_size=16, compile_ahead=False))

    def ptrs():
        leaves = {**{f"page.{k}": v for k, v in eng.ledger.store.page.items()},
                  **{f"slot.{k}": v for k, v in eng.ledger.store.slot.items()}}
        return {k: v.unsafe_buffer_pointer() for k, v in leaves.items()}

    print(jax.devices()[0].device_kind, "kernels", os.environ.get("FLASHNEXT_KERNELS", "auto"), flush=True)
    eng.add_request("r", list(range(1, 70)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    prev = ptrs()
    print("distinct buffers:", len(set(prev.values())) == len(prev), flush=True)
    while eng.has_unfinished():
        eng.step()
        now = ptrs()
        moved = [k for k in now if now[k] != prev[k]]
        print(f"step {eng.step_id}: moved {moved or 'nothing'}", flush=True)
        prev = now


if __name__ == "__main__":
    main()
