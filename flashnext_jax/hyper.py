"""4-stream hyper-connections: the gated read before each branch and the scalar write after it.

There are no input/post-attention/final RMSNorms in this model: each branch reads a learned mix of the S residual
streams (normalised per stream) and writes its output back to every stream with its own gain.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.hyper_read import check_hyper_read, hyper_read_fused
from pallas_kernels.kernel_switch import resolve_impl
from pallas_kernels.quant_layout import QuantizedWeight

from .config import ModelConfig
from .layers import grouped_rms_norm, linear


def hyper_read(p: dict, cfg: ModelConfig, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """x [..., S*H] -> (branch input u [..., H], write gains c [..., S] or None for the final mixer)."""
    fused = fused_hyper_read(p, cfg, x)
    return fused if fused is not None else hyper_read_reference(p, cfg, x)


def hyper_read_reference(p: dict, cfg: ModelConfig, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """hyper_read as plain JAX ops (the model's definition; any dtype, plain or quantized weights)."""
    s, h = cfg.hc_count, cfg.hidden_size
    normed = grouped_rms_norm(x, p["hc_norm"], h, cfg.rms_norm_eps)
    mix = jax.nn.silu(linear(normed, p["input_mix_weight_down"]) / s)  # divide by S before the SiLU
    mix = jax.nn.sigmoid(linear(mix, p["input_mix_weight_up"]))
    mix = mix.reshape(*x.shape[:-1], s, h)
    u = jnp.mean(mix * normed.reshape(*x.shape[:-1], s, h), axis=-2)
    if "block_inject_weight" not in p:
        return u, None
    gains = 2 * jax.nn.sigmoid(linear(normed, p["block_inject_weight"]) / s)
    return u, gains


def fused_hyper_read(p: dict, cfg: ModelConfig, x: jax.Array):
    """hyper_read in two Pallas kernels (pallas_kernels/hyper_read.py) when it applies: a few tokens, quantized
    mixer weights, a plain block-inject weight, the kernel impls and a non-float32 dtype (float32 runs stay on the
    exact reference). Returns None where it does not apply (the caller then runs the reference code)."""
    wd, wu, wb = p["input_mix_weight_down"], p["input_mix_weight_up"], p.get("block_inject_weight")
    mode = resolve_impl(None)
    if (mode == "reference" or x.dtype == jnp.float32 or not isinstance(wd, QuantizedWeight)
            or not isinstance(wu, QuantizedWeight) or not (wb is None or isinstance(wb, jax.Array))):
        return None
    lead = x.shape[:-1]
    xm = x.reshape(-1, x.shape[-1])
    try:
        check_hyper_read(xm.shape, cfg.hc_count, wd, wu, wb)
    except ValueError:
        return None
    u, gains = hyper_read_fused(xm, p["hc_norm"], wd, wu, wb, n_streams=cfg.hc_count, eps=cfg.rms_norm_eps,
                                interpret=mode == "interpret")
    return u.reshape(*lead, u.shape[-1]), None if gains is None else gains.reshape(*lead, gains.shape[-1])


def hyper_write(x: jax.Array, y: jax.Array, gains: jax.Array) -> jax.Array:
    """Add branch output y [..., H] to every stream s of the UN-normalised x with gain c[s]."""
    inject = y[..., None, :] * gains[..., :, None]
    return x + inject.reshape(x.shape)
