import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiled programs are shared between tests and the CLI subprocesses they start: compile time dominates the suite.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).parents[1] / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# LLVM at -O0 for the CPU programs (XLA's HLO passes and fusion are unchanged): the suite's time is mostly XLA's CPU
# compile, ~60% of it LLVM's optimizer. IEEE float semantics hold at every level (no fast-math), and the bitwise
# batch-invariance tests and their controls pass and fail alike at -O0 and the default (stop 48). The subprocesses
# the tests start inherit it (those that set XLA_FLAGS themselves add to it). `XLA_FLAGS= pytest ...` (set, even
# empty) runs with XLA's default flags.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
