import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiled programs are shared between tests and the CLI subprocesses they start: compile time dominates the suite.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).parents[1] / ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
