"""Small building blocks shared by every layer kind: norms, RoPE, linear projections.

All norms except the GDN gated norm are "zero-centred": `x * rsqrt(mean(x^2) + eps) * (1 + w)`, computed in fp32
and cast back to the input dtype, exactly as the reference does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import fixed_order
from pallas_kernels.dense_matmul import dense_matmul
from pallas_kernels.kernel_switch import resolve_impl

from . import token_kinds


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm over the last axis."""
    xf = x.astype(jnp.float32)
    out = xf * jax.lax.rsqrt(fixed_order.mean(xf * xf, -1, keepdims=True) + eps)
    return (out * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def grouped_rms_norm(x: jax.Array, weight: jax.Array, group: int, eps: float) -> jax.Array:
    """Zero-centred RMSNorm of each `group`-wide slice of the last axis, then the full-width weight."""
    xf = x.astype(jnp.float32)
    g = xf.reshape(*x.shape[:-1], -1, group)
    g = g * jax.lax.rsqrt(fixed_order.mean(g * g, -1, keepdims=True) + eps)
    return (g.reshape(x.shape) * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float, activation: str) -> jax.Array:
    """GDN output norm: plain (not zero-centred) weight, then times act(gate); the only such norm in the model."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(fixed_order.mean(xf * xf, -1, keepdims=True) + eps)).astype(dtype)
    out = weight * normed
    act = jax.nn.sigmoid if activation == "sigmoid" else jax.nn.silu
    return (out.astype(jnp.float32) * act(gate.astype(jnp.float32))).astype(dtype)


def rope_inv_freq(rotary_dim: int, theta: float) -> jax.Array:
    """inv_freq in fp32 (casting it to bf16 moves logits by ~1e-2, so it is never stored in the param dtype)."""
    import numpy as np

    exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    return jnp.asarray(1.0 / (np.float32(theta) ** exponents), dtype=jnp.float32)


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """cos/sin [..., rotary_dim] for integer positions (NeoX layout: the half-angles repeated twice).

    Text-only input gives all three MRoPE axes the same position, so interleaved MRoPE is plain partial RoPE.
    """
    freqs = positions.astype(jnp.float32)[..., None] * rope_inv_freq(rotary_dim, theta)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first `rotary_dim` features of x (rotate_half convention); cos/sin broadcast against x."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = r // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)


SMALL_DOT_MAX_ROWS = 8  # linear: up to this many tokens ...
SMALL_DOT_MAX_WEIGHTS = 1 << 20  # ... against a plain weight of at most this many elements: multiply + reduce


def linear(x: jax.Array, w) -> jax.Array:
    """y = x @ W^T for a plain weight stored [out, in] (torch's orientation, see weights.orient), or x @ W for a
    quantized weight [K=in, N=out] run by the kernel switch.

    Accumulates in fp32; fp32 params use full-precision dots (no TF32 on GPU) so fp32 parity tests mean something.
    With fixed-order reductions on (pallas_kernels.fixed_order, the default) a plain weight always takes the dot: a
    token's value must not change when its step crosses SMALL_DOT_MAX_ROWS rows; and a single row goes in as two
    (a zero row beside it): XLA's CPU backend computes a one-row dot as a matrix-vector product that rounds
    differently from the same row among others (bench/results/invariance_probe_cpu.json).
    """
    if isinstance(w, jax.Array):
        rows = math.prod(x.shape[:-1])
        small = w.dtype != jnp.float32 and rows <= SMALL_DOT_MAX_ROWS and w.size <= SMALL_DOT_MAX_WEIGHTS
        if small and not fixed_order.enabled():  # batch invariance needs one path for every row count
            # A few tokens against a small weight (routers, in_proj_a/b, block_inject): an XLA row reduction.
            # As a dot, M >= 2 went to a cuBLAS / Triton GEMM of 9 us per call for a 33x2560 router (H200,
            # bench/results/decode_step.json, stop 10), ~1 ms of the B=2 real-size decode step.
            prod = x.astype(jnp.float32)[..., None, :] * w.astype(jnp.float32)
            return jnp.sum(prod, axis=-1).astype(x.dtype)
        if fixed_order.enabled() and w.dtype != jnp.float32 and resolve_impl(None) == "pallas" and w.shape[1] % 16 == 0:
            # on the GPU a batch-invariant trace cannot use XLA's dot (cuBLAS picks its algorithm by M): the
            # fixed-order Pallas dot, whose rows do not depend on M (pallas_kernels/dense_matmul.py). K not a
            # multiple of 16 (no such plain weight in the model) stays on XLA's dot, not invariant on the GPU.
            y = dense_matmul(x.reshape(-1, x.shape[-1]).astype(w.dtype), w, out_dtype=jnp.float32)
            return y.reshape(*x.shape[:-1], -1).astype(x.dtype)
        precision = jax.lax.Precision.HIGHEST if w.dtype == jnp.float32 else None
        one_row = rows == 1 and fixed_order.enabled()
        xw = jnp.concatenate([x.reshape(1, -1), jnp.zeros_like(x.reshape(1, -1))]) if one_row else x
        y = jax.lax.dot_general(xw.astype(w.dtype), w, (((xw.ndim - 1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32)
        y = y[0].reshape(*x.shape[:-1], -1) if one_row else y
        return y.astype(x.dtype)
    from pallas_kernels.quant_gemv import gemv_fixed_fits  # quantized weights only
    from pallas_kernels.quant_matmul import quant_matmul

    # The kernels feed bf16 operands to the tensor cores; float32 runs (parity tests) stay on the exact reference.
    impl = "reference" if x.dtype == jnp.float32 else None

    def matmul(v, path="auto"):
        y = quant_matmul(v.reshape(-1, v.shape[-1]), w, impl=impl, path=path)
        return y.reshape(*v.shape[:-1], y.shape[-1]).astype(x.dtype)

    if token_kinds.current() is not None and gemv_fixed_fits(w):
        # a step with token kinds: generated tokens on the fixed GEMV, prompt tokens on the tensor-core kernel in
        # its prompt-token configuration (no split: prompt steps are prefill chunks)
        return token_kinds.by_kind(x, lambda v: matmul(v, "gemv_fixed"), lambda v: matmul(v, "prompt_fixed"))
    return matmul(x)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class FusedLinear:
    """Projections of the same input merged into one weight (`weights.fuse_projections`): one matmul, one kernel
    launch and one bigger weight instead of several (the decode GEMV reaches a larger fraction of the bandwidth on
    bigger matrices). weight: plain [sum(sizes), in] or QuantizedWeight [in, sum(sizes)]; sizes: each part's
    output width, in order."""

    weight: Any
    sizes: tuple[int, ...]

    def tree_flatten(self):
        return (self.weight,), self.sizes

    @classmethod
    def tree_unflatten(cls, sizes, children):
        return cls(children[0], sizes)


def linear_group(x: jax.Array, p: dict, names: tuple[str, ...]) -> list[jax.Array]:
    """[x @ W_name for name in names]: one matmul when the params hold them fused under "+".join(names)."""
    fused = p.get("+".join(names))
    if fused is None:
        return [linear(x, p[n]) for n in names]
    return jnp.split(linear(x, fused.weight), np.cumsum(fused.sizes)[:-1].tolist(), axis=-1)
