"""Where a benchmark's JSON goes and the metadata every result carries (device, versions, switches, date)."""

from __future__ import annotations

import datetime
import json
import os

import jax

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def save_result(name: str, rows: list, out: str | None = None, **extra) -> str:
    """Writes {device, jax_version, kernels, xla_flags, the allocator settings, date, **extra, rows} to `out`,
    else $OUT/name, else bench/results/name; returns the path."""
    allocator = {k.lower(): os.environ.get(f"XLA_PYTHON_CLIENT_{k}", "default")
                 for k in ("ALLOCATOR", "MEM_FRACTION", "PREALLOCATE")}
    result = dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                  kernels=os.environ.get("FLASHNEXT_KERNELS", "auto"), xla_flags=os.environ.get("XLA_FLAGS", ""),
                  jax_memory=allocator,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **extra, rows=rows)
    path = out or os.path.join(os.environ.get("OUT") or RESULTS, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path
