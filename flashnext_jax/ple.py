"""PLE ("Engram"): hashed n-gram embeddings injected into every residual stream at one layer.

Two halves, deliberately split:
* host side (`NgramHasher`, numpy int64): n-gram ids from each request's token history with the EOS segment rule,
  and the row gather from the table, which stays a memory-mapped host array (51 GB in the release) and never
  enters the jitted params;
* device side (`ple_forward`): the gathered rows [B, T, E] arrive as a step input and are projected, gated by the
  normalised streams and passed through a dilated causal conv whose state is the last 9 normalised gate vectors.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import fixed_order

from .config import ModelConfig
from .gdn import causal_conv, last_valid
from .layers import grouped_rms_norm, linear_group

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Odd hash multipliers, bounded so that multiplier * (vocab - 1) never overflows int64."""
    half_bound = max(1, (((1 << 63) - 1) // max(vocab_size, 1)) // 2)
    base = seed + 10007 * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half_bound) + 1 for i in range(ngram_size)]


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_vocab_sizes(base: int, num_heads: int, ple_index: int = 0) -> list[int]:
    """Distinct primes >= base, one per head (head h of PLE layer i takes the (i*heads + h + 1)-th prime)."""
    primes, p = [], base - 1
    while len(primes) < (ple_index + 1) * num_heads:
        p += 1
        while not _is_prime(p):
            p += 1
        primes.append(p)
    return primes[ple_index * num_heads :]


class NgramHasher:
    """Host-side n-gram ids. `ids(context, tokens)` -> [T, heads] int64 row ids into the concatenated table."""

    def __init__(self, cfg: ModelConfig, ple_index: int = 0):
        self.eos = int(cfg.eos_token_id)
        self.ngram_size = cfg.ngram_size
        self.heads_per_ngram = cfg.heads_per_ngram
        self.multipliers = np.array(layer_multipliers(cfg.vocab_size, cfg.ngram_size, ple_index, cfg.seed), np.int64)
        self.sizes = np.array(head_vocab_sizes(cfg.ngram_vocab_size_base, cfg.ngram_heads, ple_index), np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.total_rows = int(self.sizes.sum())
        div = cfg.make_ngram_vocab_size_divisible_by
        self.padded_rows = -(-self.total_rows // div) * div

    @property
    def context_len(self) -> int:
        return self.ngram_size - 1

    def initial_context(self) -> np.ndarray:
        return np.full(self.context_len, self.eos, np.int64)

    def ids(self, context: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Row ids for `tokens` given the previous `context_len` ids of the same request (EOS-filled at start)."""
        hist = np.concatenate([np.asarray(context, np.int64), np.asarray(tokens, np.int64)])
        n = hist.shape[0]
        pos = np.arange(n)
        eos_pos = np.where(hist == self.eos, pos, -1)
        seg_start = np.concatenate([[-1], np.maximum.accumulate(eos_pos)[:-1]]) + 1  # after the last EOS before p
        shifted = []
        for j in range(self.ngram_size):
            src = pos - j
            ok = (pos - seg_start >= j) & (src >= 0)
            shifted.append(np.where(ok, hist[np.maximum(src, 0)], self.eos))
        heads = []
        mix = shifted[0] * self.multipliers[0]
        for order in range(2, self.ngram_size + 1):
            mix = np.bitwise_xor(mix, shifted[order - 1] * self.multipliers[order - 1])
            lo = (order - 2) * self.heads_per_ngram
            sizes = self.sizes[lo : lo + self.heads_per_ngram]
            heads.append(np.remainder(mix[:, None], sizes[None, :]) + self.offsets[lo : lo + self.heads_per_ngram])
        return np.concatenate(heads, axis=1)[self.context_len :]

    def next_context(self, context: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        hist = np.concatenate([np.asarray(context, np.int64), np.asarray(tokens, np.int64)])
        return hist[-self.context_len :]


def device_ngram_ids(hasher: NgramHasher, context: jax.Array, tokens: jax.Array) -> jax.Array:
    """`hasher.ids` for one new token per row, on the device: context [B, context_len] int (the tokens before it,
    EOS-filled before a request's first token), tokens [B] -> [B, heads] int32 row ids. Async scheduling needs it:
    a chained step's token exists only on the device. Trace it with 64-bit integers (`jax.enable_x64`): the hash
    multiplies token ids by multipliers up to 2**63 / vocab."""
    if not jax.config.read("jax_enable_x64"):
        raise RuntimeError("device_ngram_ids must be traced under jax.enable_x64(True) (64-bit hash products)")
    hist = jnp.concatenate([context.astype(jnp.int64), tokens.astype(jnp.int64)[:, None]], axis=1)
    p = hist.shape[1] - 1  # the new token's position in hist
    positions = jnp.arange(p, dtype=jnp.int64)
    seg_start = jnp.max(jnp.where(hist[:, :p] == hasher.eos, positions, -1), axis=1) + 1  # after the last EOS
    mix, heads = None, []
    for j in range(hasher.ngram_size):
        shifted = jnp.where(p - seg_start >= j, hist[:, p - j], hasher.eos)
        term = shifted * jnp.int64(hasher.multipliers[j])
        mix = term if mix is None else jnp.bitwise_xor(mix, term)
        if j >= 1:
            lo = (j - 1) * hasher.heads_per_ngram
            sizes = jnp.asarray(hasher.sizes[lo: lo + hasher.heads_per_ngram])
            offsets = jnp.asarray(hasher.offsets[lo: lo + hasher.heads_per_ngram])
            heads.append(jnp.remainder(mix[:, None], sizes[None, :]) + offsets)
    return jnp.concatenate(heads, axis=1).astype(jnp.int32)


def device_gather_rows(table: jax.Array, ids: jax.Array, scale: float | None = None) -> jax.Array:
    """`gather_rows` on a device-resident table: [..., heads] ids -> [..., heads * width]."""
    flat = jnp.take(table, ids.reshape(-1), axis=0)
    if scale is not None:
        flat = flat.astype(jnp.float32) * jnp.float32(scale)
    return flat.reshape(*ids.shape[:-1], -1)


def gather_rows(table, ids: np.ndarray, scale: float | None = None) -> np.ndarray:
    """Host gather [..., heads] ids -> [..., heads * width] rows (the table may be an np.memmap)."""
    flat = np.asarray(table[ids.reshape(-1)])
    if scale is not None:
        flat = flat.astype(np.float32) * np.float32(scale)
    return flat.reshape(*ids.shape[:-1], -1)


def ple_forward(p: dict, cfg: ModelConfig, x, rows, conv_state, valid, n_valid, ends=None):
    """X [B, T, S*H] -> (PLE(X) [B, T, S*H], new conv state [B, 9, S*H]). rows [B, T, E] gathered on the host.

    With `ends` [B, K1] (token counts) the conv state comes back per checkpoint column: [B, K1, 9, S*H]."""
    s, h = cfg.hc_count, cfg.hidden_size
    bsz, t, _ = x.shape
    e = rows.astype(x.dtype)
    key, value = linear_group(e, p, ("key_proj", "value_proj"))
    key = grouped_rms_norm(key, p["norm_key"], h, cfg.rms_norm_eps).reshape(bsz, t, s, h)
    query = grouped_rms_norm(x, p["norm_query"], h, cfg.rms_norm_eps).reshape(bsz, t, s, h)
    gate = fixed_order.tree_sum(key * query, -1, keepdims=True) / math.sqrt(h)
    gate = jnp.sqrt(jnp.maximum(jnp.abs(gate), 1e-6)) * jnp.sign(gate)
    gated = (jax.nn.sigmoid(gate) * value[:, :, None, :]).reshape(bsz, t, s * h)
    gated_normed = grouped_rms_norm(gated, p["norm_conv"], h, cfg.rms_norm_eps)
    gated = jnp.where(valid[..., None], gated, 0)
    gated_normed = jnp.where(valid[..., None], gated_normed, 0)

    x_full = jnp.concatenate([conv_state.astype(x.dtype), gated_normed], axis=1)
    if ends is None:
        new_state = last_valid(x_full, n_valid, cfg.ple_conv_state_len)
    else:
        new_state = jnp.stack([last_valid(x_full, ends[:, c], cfg.ple_conv_state_len) for c in range(ends.shape[1])],
                              axis=1)
    conv = causal_conv(x_full, p["conv1d"].astype(x.dtype), t, dilation=cfg.ple_conv_dilation)
    return gated + jax.nn.silu(conv), new_state
