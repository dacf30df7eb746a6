"""How many KV pages the engine's store gets: sized from the device memory left after the weights, like vLLM's
`gpu_memory_utilization`.

On a device that reports memory statistics (GPU, TPU): the pool takes `utilization` of the device's memory limit
(jax's allocator limit: XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75, of the physical memory)
minus what is in use already (the weights, the runtime), minus the slot and snapshot pools; activations of a step
must fit in the rest (1 - utilization). On the CPU (no statistics) the pool is what max_num_seqs sequences of
max_model_len tokens need, capped at CPU_POOL_FRACTION of the host's available memory and at CPU_POOL_CAP_BYTES:
a laptop or a test run does not reserve gigabytes for contexts it will not use.

Page leaves kept in pinned host memory (the QSA K/V with --qsa-kv-offload, qsa_offload.py) do not count against
the device's budget; they take at most HOST_POOL_FRACTION of the host's available memory.

Page counts are rounded down to at most 6 significant bits (at most 3% less; state_store.round_pages_down; the
ledger rounds any other count up the same way), so the allocated store is what the budget allows, not the next
power of two.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from .state_store import StoreSpec, round_pages_down

CPU_POOL_FRACTION = 0.25
HOST_POOL_FRACTION = 0.5  # of the host's available memory, for page leaves kept in pinned host memory
CPU_POOL_CAP_BYTES = 4 << 30


def leaf_bytes(leaves) -> int:
    """Bytes of one entry of every leaf (per slot column, or per token for page leaves: see page_bytes)."""
    return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in leaves.values())


def page_bytes_of(leaves, page_size: int) -> int:
    """Bytes of one page of every page leaf (a leaf with tokens_per_row > 1 has fewer rows per page)."""
    return sum(leaf_bytes({n: leaf}) * (page_size // leaf.tokens_per_row) for n, leaf in leaves.items())


def device_memory(device=None) -> tuple[int, int] | None:
    """(bytes_limit, bytes_in_use) of the device, or None where it reports no statistics (the CPU)."""
    import jax

    device = device or jax.local_devices()[0]  # this process's (jax.devices() lists every process's)
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def host_available_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return CPU_POOL_CAP_BYTES


@dataclasses.dataclass(frozen=True)
class PoolSize:
    num_pages: int
    page_bytes: int  # one page of every page leaf
    source: str  # how it was sized, for the log

    def describe(self, page_size: int) -> str:
        return (f"{self.num_pages} KV pages of {page_size} tokens ({self.num_pages * page_size} tokens of context "
                f"in all, {self.num_pages * self.page_bytes / 2**30:.2f} GiB; {self.source})")


def size_pool(spec: StoreSpec | tuple[StoreSpec, ...], page_size: int, num_slots: int, num_snapshots: int, k1: int,
              max_model_len: int, utilization: float, memory: tuple[int, int] | None) -> PoolSize:
    """The page count for a store of this spec (see the module docstring). `memory`: device_memory(). A pipeline's
    specs (one per stage) are sized by their sum, as if every stage's store shared that one device: conservative
    when the stages have devices of their own (sizing each stage by its own device is not built yet)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    specs = spec if isinstance(spec, tuple) else (spec,)
    page_bytes = max(1, sum(page_bytes_of(sp.page, page_size) for sp in specs))
    pages_per_seq = -(-max_model_len // page_size)
    if memory is not None:
        limit, in_use = memory
        others = sum(leaf_bytes(sp.slot) for sp in specs) * (num_slots * k1 + num_snapshots)
        budget = int(utilization * limit) - in_use - others
        host = {n: l for sp in specs for n, l in sp.page.items() if l.memory_kind != "device"}
        device_page_bytes = max(1, page_bytes - page_bytes_of(host, page_size))
        pages = round_pages_down(max(budget // device_page_bytes, 0))
        source = (f"{utilization:.2f} of jax's {limit / 2**30:.1f} GiB device memory limit "
                  f"(XLA_PYTHON_CLIENT_MEM_FRACTION of the device, default 0.75), {in_use / 2**30:.2f} GiB in use before")
        if host:  # leaves in pinned host memory (--qsa-kv-offload): the host's memory bounds them too
            host_pages = int(HOST_POOL_FRACTION * host_available_bytes()) // page_bytes_of(host, page_size)
            pages = min(pages, round_pages_down(max(host_pages, 1)))
            source += (f"; {', '.join(host)} in pinned host memory (at most {HOST_POOL_FRACTION:.0%} of the host's "
                       f"available memory)")
        return PoolSize(pages, page_bytes, source)
    want = pages_per_seq * num_slots + 2 * pages_per_seq
    cap = min(int(CPU_POOL_FRACTION * host_available_bytes()), CPU_POOL_CAP_BYTES) // page_bytes
    pages = round_pages_down(max(min(want, cap), 1))
    why = "max_num_seqs sequences of max_model_len" if want <= cap else \
        f"capped at min({CPU_POOL_FRACTION:.0%} of the host's available memory, {CPU_POOL_CAP_BYTES >> 30} GiB)"
    return PoolSize(pages, page_bytes, f"no device memory statistics: {why}")
