"""4-stream hyper-connections: the gated read before each branch and the scalar write after it.

There are no input/post-attention/final RMSNorms in this model: each branch reads a learned mix of the S residual
streams (normalised per stream) and writes its output back to every stream with its own gain.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import ModelConfig
from .layers import grouped_rms_norm, linear


def hyper_read(p: dict, cfg: ModelConfig, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """x [..., S*H] -> (branch input u [..., H], write gains c [..., S] or None for the final mixer)."""
    s, h = cfg.hc_count, cfg.hidden_size
    normed = grouped_rms_norm(x, p["hc_norm"], h, cfg.rms_norm_eps)
    mix = jax.nn.silu(linear(normed, p["input_mix_weight_down"]) / s)  # divide by S before the SiLU
    mix = jax.nn.sigmoid(linear(mix, p["input_mix_weight_up"]))
    mix = mix.reshape(*x.shape[:-1], s, h)
    streams = (mix * normed.reshape(*x.shape[:-1], s, h)).astype(jnp.float32)
    # the mean over the S streams as explicit adds in stream order: XLA's reduction of a size-S axis associates
    # differently with the number of rows (batch invariance: a row's value must not depend on the batch)
    total = streams[..., 0, :]
    for i in range(1, s):
        total = total + streams[..., i, :]
    u = (total / s).astype(mix.dtype)
    if "block_inject_weight" not in p:
        return u, None
    gains = 2 * jax.nn.sigmoid(linear(normed, p["block_inject_weight"]) / s)
    return u, gains


def hyper_write(x: jax.Array, y: jax.Array, gains: jax.Array) -> jax.Array:
    """Add branch output y [..., H] to every stream s of the UN-normalised x with gain c[s]."""
    inject = y[..., None, :] * gains[..., :, None]
    return x + inject.reshape(x.shape)
