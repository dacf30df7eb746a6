"""Reductions whose rounding does not depend on the shape around them (batch invariance, docs/batch-invariance.md).

XLA emits a reduction with a vectorization and association that depend on the whole operand's shape, so a
token's sum over its own 64 features rounded differently when its step held 8 tokens or 16 (measured on the CPU:
the PLE gate's `jnp.sum(key * query, -1)`). A request's output then depended on what ran beside it. Here a sum
over an axis is a pairwise tree of explicit adds, halving the axis each level (zero-padded to a power of two), so
every element of the result is the same expression of its own inputs whatever the other axes hold. Max is exact
in any order and stays `jnp.max`.

The other half is a compiler option (`compiler_options`): XLA's excess precision lets a fusion skip a bf16
rounding, and which ops share a fusion depends on the shapes, so it too made a token's value depend on its step's
shape (docs/batch-invariance.md). Invariant programs are compiled with it off.

The engine can turn both off (`EngineConfig.batch_invariant`): `batch_invariant(False)` around tracing selects
XLA's reductions instead. The setting is read at trace time, so a program keeps the mode it was traced in; the
engine's `StepCache` traces each program afresh under its own setting.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

_ENABLED = contextvars.ContextVar("flashnext_batch_invariant", default=None)  # None: traced_default()


def compiler_options(on: bool = True) -> dict:
    """XLA options of a program compiled in the given mode (pass to `jax.jit` or `.compile`)."""
    return {"xla_allow_excess_precision": not on}


def default_mode() -> bool:
    """The engine's batch invariance when not asked (EngineConfig.batch_invariant=None): on. On the GPU it holds
    bitwise at B = 2, 8 and mixed prefill + decode for the real config cut to 4 and 12 layers, and with token kinds
    (flashnext_jax/token_kinds.py: generated tokens on the fixed GEMVs) costs 1.10x the fastest decode step at
    B = 1 and 1.14x at B = 2 on an H100 (bench/results/batch_invariance_4layers_token_kinds_h100.json;
    docs/batch-invariance.md)."""
    return True


def traced_default() -> bool:
    """The mode of code traced outside any `batch_invariant(...)` context (a model called directly, a kernel
    benchmark): on for the CPU, off on the GPU, so a kernel benchmark there measures the fast dispatch. The engine
    always traces inside a context of its own mode (EngineConfig.batch_invariant)."""
    return jax.default_backend() == "cpu"


def enabled() -> bool:
    """Whether code traced now uses the fixed-order forms and the kernels' invariant configurations: the enclosing
    `batch_invariant(on)`, else `traced_default()`."""
    on = _ENABLED.get()
    return traced_default() if on is None else on


@contextlib.contextmanager
def batch_invariant(on: bool):
    """Trace the enclosed code with fixed-order reductions on or off."""
    token = _ENABLED.set(bool(on))
    try:
        yield
    finally:
        _ENABLED.reset(token)


def tree_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Sum over `axis` as a pairwise tree (`pairwise_sum`) in invariant traces, XLA's reduce when off."""
    if not enabled():
        return jnp.sum(x, axis=axis, keepdims=keepdims)
    return pairwise_sum(x, axis, keepdims)


def pairwise_sum(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """Sum over `axis` as a pairwise tree of elementwise adds, whatever the mode: the axis zero-padded to a power of
    two and halved each level (element i added to element i + half), so every element of the result is the same
    expression of its own inputs whatever the other axes hold. Low-precision inputs are summed in float32 and the
    sum rounded once, as XLA's and torch's reductions do."""
    dtype = x.dtype
    x = jnp.moveaxis(x, axis, -1).astype(jnp.promote_types(dtype, jnp.float32))
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    x = x[..., 0].astype(dtype)
    return jnp.expand_dims(x, axis) if keepdims else x


def mean(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    return tree_sum(x, axis, keepdims) / x.shape[axis]


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    if not enabled():
        return jax.nn.softmax(x, axis=axis)
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True)))
    return e / tree_sum(e, axis, keepdims=True)


def logsumexp(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
    """log(sum(exp(x))) over `axis`; a row of -inf gives -inf."""
    if not enabled():
        return jax.nn.logsumexp(x, axis=axis, keepdims=keepdims)
    m = jnp.max(x, axis=axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    out = jnp.log(tree_sum(jnp.exp(x - m), axis, keepdims=True)) + m
    return out if keepdims else jnp.squeeze(out, axis)


def log_softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    if not enabled():
        return jax.nn.log_softmax(x, axis=axis)
    return x - logsumexp(x, axis, keepdims=True)
