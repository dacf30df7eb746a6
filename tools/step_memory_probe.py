"""XLA's memory analysis of the real-size engine step, from shapes only (nothing is allocated).

Compiles `RealRunner.step` (the real config, random INT4-Mixed weight shapes, `--experts` routed experts) for one
prefill chunk of `--tokens` against a page table of `--width` pages, with pools of `--pages` pages, the store
donated as the engine does, and prints argument / output / alias / temporary bytes. Two pool sizes tell whether a
step copies a pool (temporaries that grow with --pages) rather than updating it in place.

  JAX_PLATFORMS=cpu PYTHONPATH=. python3 tools/step_memory_probe.py --pages 512,4096
  PYTHONPATH=. python3 tools/step_memory_probe.py --experts 512 --pages 1024,16384   # on the GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from bench import decode_step
from flashnext_jax import api
from flashnext_jax.config import from_hf_config
from flashnext_jax.model_runner import Batch
from flashnext_jax.runner import RealRunner
from flashnext_jax.state_store import StoreDims, init_store


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--width", type=int, default=64, help="page-table width (pages)")
    ap.add_argument("--pages", default="512,4096", help="pool sizes to compare")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (per-layer cost)")
    ap.add_argument("--biggest", type=int, default=0, help="print the N largest arrays of the compiled HLO")
    args = ap.parse_args()
    with open(decode_step.REAL_CONFIG) as f:
        cfg = dataclasses.replace(from_hf_config(json.load(f)), num_experts=args.experts)
    if args.layers:
        cfg = decode_step.cut_config(cfg, args.layers)
    params = decode_step.abstract_params(cfg)
    model = api.Model(cfg, params, table=None, dtype=jnp.bfloat16)
    runner = RealRunner(model)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    t = args.tokens
    host = {"ple_rows": jax.ShapeDtypeStruct((1, t, cfg.ple_embed_dim), jnp.float32)}  # RandomPleRunner's
    batch = Batch(slot=i32(1), gen=i32(1), tokens=i32(1, t), n_valid=i32(1), start=i32(1),
                  page_table=i32(1, args.width), host=host)
    for pages in (int(p) for p in args.pages.split(",")):
        dims = StoreDims(num_slots=1, num_pages=pages, page_size=args.page_size, num_snaps=1, num_columns=1)
        store = jax.eval_shape(lambda: init_store(runner.store_spec(), dims))
        t0 = time.perf_counter()
        compiled = jax.jit(runner.step, donate_argnums=(1,)).lower(params, store, batch).compile()
        m = compiled.memory_analysis()
        gb = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
        print(f"{jax.devices()[0].device_kind} experts={args.experts} T={t} width={args.width} pages={pages}: "
              f"args {gb(m.argument_size_in_bytes)} GiB, out {gb(m.output_size_in_bytes)}, alias "
              f"{gb(m.alias_size_in_bytes)}, temp {gb(m.temp_size_in_bytes)} (compiled in "
              f"{time.perf_counter() - t0:.0f} s)", flush=True)
        if args.biggest:
            for size, line in biggest_arrays(compiled.as_text(), args.biggest):
                print(f"  {size / 2**30:8.2f} GiB  {line[:220]}")


def biggest_arrays(hlo: str, n: int):
    """The n instructions of the compiled HLO with the largest result arrays (bytes, the instruction line)."""
    import re

    itemsize = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8, "f64": 8}
    found = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.-]+ = (\w+)\[([\d,]*)\]", line)
        if not m or m.group(1) not in itemsize:
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        size = itemsize[m.group(1)] * (int(np.prod(dims)) if dims else 1)
        found.setdefault(line.strip()[:300], size)
    return sorted(((s, l) for l, s in found.items()), reverse=True)[:n]


if __name__ == "__main__":
    main()
