"""The one switch between Pallas kernels and pure-JAX references.

FLASHNEXT_KERNELS=auto|pallas|interpret|reference (default auto: Pallas on GPU, reference elsewhere);
an explicit `impl=` argument to a kernel entry point overrides the environment variable. Every kernel entry point
and the model's trace-time choices ask `resolve_impl`, so one variable moves them all together."""

from __future__ import annotations

import os

import jax

IMPLS = ("auto", "pallas", "interpret", "reference")
ENV_VAR = "FLASHNEXT_KERNELS"

__all__ = ["ENV_VAR", "IMPLS", "resolve_impl", "use_pallas"]


def resolve_impl(impl: str | None = None, gpu_auto: str = "pallas") -> str:
    """Returns 'pallas', 'interpret' or 'reference'.

    impl (argument) overrides the FLASHNEXT_KERNELS environment variable, which defaults to 'auto':
    'auto' -> `gpu_auto` ('pallas'; 'reference' for a kernel measured slower than its reference) when the default
    backend is a GPU, else 'reference'. 'interpret' runs the Pallas kernels in interpret mode (CPU tests)."""
    choice = impl if impl is not None else os.environ.get(ENV_VAR, "auto")
    if choice not in IMPLS:
        raise ValueError(f"kernel impl must be one of {IMPLS} (argument or ${ENV_VAR}), got {choice!r}")
    if choice == "auto":
        return gpu_auto if jax.default_backend() == "gpu" else "reference"
    return choice


def use_pallas(impl: str | None = None) -> bool:
    """True when the Pallas kernel (compiled or interpreted) should run instead of the reference."""
    return resolve_impl(impl) != "reference"
