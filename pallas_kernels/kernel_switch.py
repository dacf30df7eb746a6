"""The one switch between Pallas kernels and pure-JAX references (see quant_layout.resolve_impl).

FLASHNEXT_KERNELS=auto|pallas|interpret|reference (default auto: Pallas on GPU, reference elsewhere);
an explicit `impl=` argument to a kernel entry point overrides the environment variable."""

from pallas_kernels.quant_layout import ENV_VAR, IMPLS, resolve_impl, use_pallas

__all__ = ["ENV_VAR", "IMPLS", "resolve_impl", "use_pallas"]
