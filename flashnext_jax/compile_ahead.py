"""Compiling the engine step for a shape before a request needs it, on a background thread.

Why: the step's page-table width is a power-of-two bucket of the pages a row touches, so a request whose context
grows past 64, 128, ... pages needs a step of a new shape, and compiling that at the real model size takes about a
minute (docs/STATUS.md): every request in flight would stall for it. So when the engine runs a decode step at some
width, it asks for the step at the next width, and a worker thread compiles it while decoding goes on.

How: the worker calls the engine's StepCache.compile (step_cache.py) with the step's abstract arguments, which
lowers and compiles the step for that shape and keeps the executable under the shape's key, so the engine's later
step at that shape finds it compiled: tests/test_compile_ahead.py checks that the engine's own thread then
compiles nothing. A compile that fails here only logs a warning; the engine compiles the shape itself when it
needs it, and reports the error there.

Two things the H200 run showed (bench/results/engine_step_compile_ahead.json):
* Tracing and lowering the step is Python work that holds the GIL; with CPython's default 5 ms switch interval
  the engine's thread waited up to 5 ms at every GIL hand-over and a decode step took 286 ms instead of 8 ms while
  the background thread lowered. The worker therefore lowers with a 0.1 ms switch interval (SWITCH_INTERVAL_S):
  the engine's thread then waits at most that long per hand-over. XLA's compile itself releases the GIL.
* A process that exits while the worker is inside XLA's compiler crashed (SIGSEGV at interpreter teardown). At
  exit the worker takes no new job and the exit waits for the compile in progress (`_wait_at_exit`, run before
  every `atexit` handler, see below).
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import weakref
from typing import Any, Callable, Hashable

import jax
import numpy as np

log = logging.getLogger("flashnext_jax.engine")

THREAD_NAME = "flashnext-compile-ahead"
SWITCH_INTERVAL_S = 1e-4  # CPython's GIL switch interval while the worker traces and lowers (default 5e-3)
_WORKERS: "weakref.WeakSet[CompileAhead]" = weakref.WeakSet()  # live workers, for the exit hook (weak: a worker
# goes with its engine's runner, step_programs.jitted_step)


def _wait_at_exit():
    for worker in list(_WORKERS):
        worker.close()


# Run the exit hook before every atexit handler: `threading._register_atexit` callbacks run when the interpreter
# starts shutting down, before `atexit`'s (concurrent.futures uses it for the same reason). Handlers registered
# with `atexit` after this module was imported run before any of ours would (weakref.finalize's, multiprocessing's,
# then jax's clean_up, which clears the backends and caches); with the hook among them, a compile still running
# failed at exit (KeyError / shape errors while lowering) instead of finishing.
threading._register_atexit(_wait_at_exit)


def abstract(tree: Any) -> Any:
    """The tree with every array replaced by its type (shape, dtype, weak type, memory space and, for arrays
    committed to a device, the sharding), as jit sees it: what `lower` needs, without holding buffers the engine
    may donate meanwhile. The memory space is given apart: a sharding's memory kind alone traces as device memory
    (then the program would copy a pinned-host store leaf to the device on every call, qsa_offload.py)."""
    def one(x):
        if isinstance(x, jax.Array):
            committed = getattr(x, "_committed", True)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if committed else None,
                                        weak_type=bool(getattr(x, "weak_type", False)),
                                        _memory_space=jax.typeof(x).memory_space)
        if isinstance(x, np.ndarray):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        return x
    return jax.tree_util.tree_map(one, tree)


class CompileAhead:
    """One worker thread calling `compile(key, abstract_args)` (step_cache.StepCache.compile: it keeps the
    executable) one key at a time (compiles are long and use the host's cores: one at a time leaves the serving
    thread its share). `is_compiled(key)`: whether the key's step is compiled already. The thread ends when the
    queue is empty (a new request starts another): an idle thread would hold its compiler, and through it the
    runner and every executable, alive for the process's life."""

    def __init__(self, compile: Callable[[Hashable, tuple], Any], is_compiled: Callable[[Hashable], bool]):
        self._compile_fn, self._is_compiled = compile, is_compiled
        self._pending: dict[Hashable, threading.Event] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._busy = threading.Lock()  # held while a compile runs
        self.failed: dict[Hashable, str] = {}

    def request(self, key: Hashable, make_args: Callable[[], tuple], what: str) -> bool:
        """Queue a compile of `key` unless it is compiled or queued. make_args() -> the call's abstract arguments
        (called now, on the caller's thread). Returns whether a compile was queued."""
        with self._lock:
            if self._closing or self._is_compiled(key) or key in self._pending or key in self.failed:
                return False
            self._pending[key] = threading.Event()
        args = make_args()
        with self._lock:
            self._queue.put((key, args, what))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=THREAD_NAME, daemon=True)
                self._thread.start()
                _WORKERS.add(self)
        log.info("background compile of the engine step for %s: queued", what)
        return True

    def wait(self, key: Hashable) -> bool:
        """Blocks until the compile of `key` has finished if one is queued or running; returns whether it was."""
        with self._lock:
            event = self._pending.get(key)
        if event is None:
            return False
        event.wait()
        return True

    def wait_all(self):
        """Blocks until every queued compile has finished (tests; a server shutting down does not need to)."""
        with self._lock:
            events = list(self._pending.values())
        for e in events:
            e.wait()

    def close(self):
        """Takes no new compile and waits for the one in progress (the process may be exiting: see above)."""
        with self._lock:
            self._closing = True
            busy = any(not e.is_set() for e in self._pending.values())
        if busy:
            log.info("waiting for a background compile of the engine step to finish before exiting")
        with self._busy:
            pass

    def _work(self):
        while True:
            with self._lock:  # request() puts and checks the thread under this lock: no item is left behind
                if self._queue.empty():
                    self._thread = None
                    return
                key, args, what = self._queue.get_nowait()
            with self._busy:
                if self._closing:
                    with self._lock:
                        self._pending.pop(key).set()
                    continue
                self._compile(key, args, what)

    def _compile(self, key, args, what):
        t0 = time.perf_counter()
        try:
            interval = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            try:  # tracing and lowering hold the GIL; XLA's compile releases it
                self._compile_fn(key, args)
            finally:
                sys.setswitchinterval(interval)
        except Exception as e:  # noqa: BLE001 - the engine compiles it itself if it needs it
            self.failed[key] = repr(e)
            log.warning("background compile of the engine step for %s failed (%s); the engine will compile it when "
                        "it needs it", what, repr(e)[:300])
        else:
            log.info("background compile of the engine step for %s: done in %.1f s", what, time.perf_counter() - t0)
        finally:
            with self._lock:
                self._pending.pop(key).set()
