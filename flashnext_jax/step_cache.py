"""The engine's compiled programs (model steps, samplers), one per key, at most `limit` of them (least recently
used out).

Why: every compiled executable keeps its code mapped in the process (about 1,000 memory mappings each for the
demo model on the CPU); a server that compiled ~60 shapes ran out of vm.max_map_count and died (issue 18). A
`jax.jit` function keeps every executable it ever compiled for as long as the function lives, so here each shape
gets its own `jax.jit` of the step, compiled ahead of time (`lower(...).compile()`), and the cache holds only the
`Compiled` object: dropping it drops the last reference to the executable (tests/test_step_cache.py checks the
backend's live executables). A shape evicted and needed again compiles again, from JAX's persistent compilation
cache when one is configured (seconds instead of a minute at the real size).

Twins (async scheduling on a GPU): XLA runs a step as a CUDA graph and, when any buffer the graph recorded moved,
re-records it before the launch; an async engine launches step n + 1 while step n still holds its buffers, so every
launch found moved buffers (48 layers on the H100: 7.4 ms inside the launch against 1.1 ms,
docs/real-size-decode.md). A second executable of the same program (the first one serialized and loaded again:
no second compile, where the backend can serialize it) used in turn finds, every other step, the buffers of two steps ago, freed by then.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Hashable

import jax
from jax.experimental import serialize_executable

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


class StepCache:
    """Compiled programs of `run` by key: the engine's model steps (`run(params, store, batch, prompt_targets)`,
    the store, argument 1, donated) and its samplers (engine.choose_tokens: nothing donated, its logprobs flag
    static). `name`: the jitted function's name, as the backend's live executables show it; `log_level`: of the
    line each compile logs (a sampler is a small program that compiles often: debug). `batch_invariant`: trace and
    compile every program in that mode (pallas_kernels/fixed_order.py)."""

    def __init__(self, run: Callable, limit: int, donate_argnums: tuple[int, ...] = (1,),
                 static_argnums: tuple[int, ...] = (), name: str = "run", log_level: int = logging.INFO,
                 batch_invariant: bool = True):
        self._run, self._donate, self._static, self._name = run, donate_argnums, static_argnums, name
        self.batch_invariant = batch_invariant
        self._log_level = log_level
        self.limit = limit
        self._lru: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        self._twins: dict[Hashable, list] = {}  # key -> [its twin executable, launches so far] (module docstring)
        self.make_twins = False  # compile() also makes each program's twin (an async engine on a GPU asks for it)
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

    def compile(self, key: Hashable, args: tuple) -> Any:
        """Compile the program for `args` (arrays or their abstract types) under `key`, unless it is cached."""
        with self._lock:
            hit = self._lru.get(key)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        compiled = self._compile(args)
        log.log(self._log_level, "compiled %s in %.1f s: %s", self._name, time.perf_counter() - t0,
                memory_summary(compiled))
        twin = self._twin_of(compiled, args) if self.make_twins else None
        with self._lock:
            self._lru[key] = compiled
            if twin is not None:
                self._twins[key] = [twin, 0]
            self.counters["compiled"] += 1
            self._evict()
        return compiled

    def _compile(self, args: tuple) -> Any:
        def run(*a):  # a new function per shape: the jit below and its caches die with the cache entry
            return self._run(*a)

        run.__name__ = run.__qualname__ = self._name
        jitted = jax.jit(run, donate_argnums=self._donate, static_argnums=self._static)
        with fixed_order.batch_invariant(self.batch_invariant):
            return jitted.lower(*args).compile(fixed_order.compiler_options(self.batch_invariant))

    def _twin_of(self, compiled, args: tuple) -> Any:
        """A second executable of `compiled`'s program: serialized and loaded again (seconds), or compiled again
        where the backend cannot serialize it (XLA:CPU refuses some sort comparators)."""
        t0 = time.perf_counter()
        try:
            twin = serialize_executable.deserialize_and_load(*serialize_executable.serialize(compiled))
            how = "loaded from its serialization"
        except Exception as e:  # noqa: BLE001 - any backend refusal: compile it again instead
            log.debug("cannot serialize a compiled %s (%s): compiling its twin", self._name, e)
            twin, how = self._compile(args), "compiled again"
        log.log(self._log_level, "made the twin of a compiled %s in %.1f s (%s)", self._name,
                time.perf_counter() - t0, how)
        self.counters["twins"] += 1
        return twin

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

    def _evict(self):
        while len(self._lru) > max(self.limit, 1):
            key, _ = self._lru.popitem(last=False)
            self._twins.pop(key, None)
            self.counters["evicted"] += 1
            log.info("dropped a compiled %s (the least recently used of %d kept): %s", self._name, self.limit,
                     str(key)[:200])

    def call(self, key: Hashable, args: tuple, alternate: bool = False) -> Any:
        """Run the program of `key` (compiling it first if it is not cached). The compiled executable takes the
        arguments but the static ones. alternate: every other call runs the program's twin (made now if the
        compile did not make it: module docstring)."""
        compiled = self.get(key) or self.compile(key, args)
        if alternate:
            with self._lock:
                pair = self._twins.get(key)
            if pair is None:
                pair = [self._twin_of(compiled, args), 0]
                with self._lock:
                    if key in self._lru:
                        pair = self._twins.setdefault(key, pair)
            pair[1] += 1
            if pair[1] % 2 == 0:
                compiled = pair[0]
        return compiled(*(a for i, a in enumerate(args) if i not in self._static))
