"""The engine's compiled programs (model steps, samplers), one per key, at most `limit` of them (least recently
used out).

Why: every compiled executable keeps its code mapped in the process (about 1,000 memory mappings each for the
demo model on the CPU); a server that compiled ~60 shapes ran out of vm.max_map_count and died (issue 18). A
`jax.jit` function keeps every executable it ever compiled for as long as the function lives, so here each shape
gets its own `jax.jit` of the step, compiled ahead of time (`lower(...).compile()`), and the cache holds only the
`Compiled` object: dropping it drops the last reference to the executable (tests/test_step_cache.py checks the
backend's live executables). A shape evicted and needed again compiles again, from JAX's persistent compilation
cache when one is configured (seconds instead of a minute at the real size).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Hashable

import jax

from pallas_kernels import fixed_order

log = logging.getLogger("flashnext_jax.engine")


def memory_summary(compiled) -> str:
    """XLA's memory analysis of a compiled step in words (what a step needs beyond the weights and the store)."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend has one
        m = None
    if m is None:
        return "no memory analysis on this backend"
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    return (f"arguments {gib(m.argument_size_in_bytes)}, outputs {gib(m.output_size_in_bytes)} "
            f"({gib(m.alias_size_in_bytes)} of them donated in place), temporaries {gib(m.temp_size_in_bytes)}")


class CompiledLRU:
    """Compiled programs by key, at most `limit` of them, the least recently used dropped first; thread-safe (the
    background compiler adds from its own thread). What StepCache and the pipeline's PipelineSteps share; `what`
    names the programs in the log."""

    def __init__(self, limit: int, what: str):
        self.limit, self._what = limit, what
        self._lru: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.counters = collections.Counter()

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._lru

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    def keys(self) -> list:
        with self._lock:
            return list(self._lru)

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
            return hit

    def set_limit(self, limit: int):
        with self._lock:
            self.limit = limit
            self._evict()

    def _keep(self, key: Hashable, programs: Any) -> Any:
        """A newly compiled entry, counted; the least recently used ones past the limit go."""
        with self._lock:
            self._lru[key] = programs
            self.counters["compiled"] += 1
            self._evict()
        return programs

    def _evict(self):
        while len(self._lru) > max(self.limit, 1):
            key, _ = self._lru.popitem(last=False)
            self.counters["evicted"] += 1
            log.info("dropped a compiled %s (the least recently used of %d kept): %s", self._what, self.limit,
                     str(key)[:200])


class StepCache(CompiledLRU):
    """Compiled programs of `run` by key: the engine's model steps (`run(params, store, batch, prompt_targets)`,
    the store, argument 1, donated) and its samplers (step_programs.choose_tokens: nothing donated, its logprobs flag
    static). `name`: the jitted function's name, as the backend's live executables show it; `log_level`: of the
    line each compile logs (a sampler is a small program that compiles often: debug). `batch_invariant`: trace and
    compile every program in that mode (pallas_kernels/fixed_order.py)."""

    def __init__(self, run: Callable, limit: int, donate_argnums: tuple[int, ...] = (1,),
                 static_argnums: tuple[int, ...] = (), name: str = "run", log_level: int = logging.INFO,
                 batch_invariant: bool = True):
        super().__init__(limit, name)
        self._run, self._donate, self._static, self._name = run, donate_argnums, static_argnums, name
        self.batch_invariant = batch_invariant
        self._log_level = log_level

    def compile(self, key: Hashable, args: tuple) -> Any:
        """Compile the program for `args` (arrays or their abstract types) under `key`, unless it is cached."""
        with self._lock:
            hit = self._lru.get(key)
        if hit is not None:
            return hit
        def run(*a):  # a new function per shape: the jit below and its caches die with the cache entry
            return self._run(*a)

        run.__name__ = run.__qualname__ = self._name
        jitted = jax.jit(run, donate_argnums=self._donate, static_argnums=self._static)
        t0 = time.perf_counter()
        with fixed_order.batch_invariant(self.batch_invariant):
            compiled = jitted.lower(*args).compile(fixed_order.compiler_options(self.batch_invariant))
        log.log(self._log_level, "compiled %s in %.1f s: %s", self._name, time.perf_counter() - t0,
                memory_summary(compiled))
        return self._keep(key, compiled)

    def call(self, key: Hashable, args: tuple) -> Any:
        """Run the program of `key` (compiling it first if it is not cached). The compiled executable takes the
        arguments but the static ones."""
        compiled = self.get(key) or self.compile(key, args)
        return compiled(*(a for i, a in enumerate(args) if i not in self._static))
