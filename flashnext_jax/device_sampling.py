"""Temperature / top-k / top-p / min-p sampling on the device, in the engine's jitted sampler.

Why: on the host (numpy, float64) one sampled token costs 4.8-8.5 ms per row at the 248k vocabulary on a 2-core
CPU (temperature alone / with top-p 0.9 / with top-k 50), about the device's whole real-size decode step (6.5 ms
on an H200), and the [B, K1, V] float32 logits must first be copied off the device. Here the same steps run on
[B, K1, V] where they are (1.3 ms for temperature alone even on that CPU), and one token id per column leaves the
device.

Which rows: sampled rows without penalties (`device_sampled` below). With MTP drafts the device verifies them too
(`verify_tokens`: rejection sampling of drafts that are the draft head's argmax, as vLLM's MTP / EAGLE proposers
draft); the penalties (which need the token history) and grammar-constrained rows with drafts (drafted on the host
from the masked draft distribution) stay on the host (sampling.py). Greedy rows take the model step's device argmax (step_programs.model_step); this runs in the engine's
sampler (step_programs.choose_tokens), a small program of its own after the model step.

Same steps as `sampling.probs_from_logits`, in float32: x = logits / T; top-k keeps x >= the k-th largest (ties
kept); p = softmax; top-p keeps the shortest prefix in (descending p, ascending id) order whose mass before its
last element is < top_p; min-p keeps p >= min_p * max p; then the inverse CDF at a uniform u. Determinism: u of
output token j of a request comes from the key SeedSequence(seed, j, 4), so a request's tokens do not depend on
its batch, its row or the pipeline delay (tests/test_engine_toy.py compares batched runs with solo runs).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import fixed_order

from .sampling import SamplingParams

_PURPOSE = 4  # distinct from the host streams' purposes 0..3 (sampling._rng)
_PURPOSE_VERIFY = 5  # the per-column keys of rows whose drafts the device verifies (verify_tokens)


def device_sampled(params: SamplingParams, num_speculative_tokens: int) -> bool:
    """Whether a row with these params samples on the device (see the module docstring)."""
    if params.greedy or params.has_penalties:
        return False
    return num_speculative_tokens == 0 or params.structured_outputs is None


TOP_CAP = 256  # top-k / top-p first look among the largest TOP_CAP entries (lax.top_k), else sort the row


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["temperature", "top_k", "top_p", "min_p", "key_data", "drafts"],
                   meta_fields=["top_k_mode", "use_top_p", "columns"])
@dataclasses.dataclass(frozen=True)
class SamplingInputs:
    """Per batch row: the sampling parameters and the key of the row's next output token (padding and rows that do
    not sample on the device: temperature 1, no masks, key 0; their samples are never read).

    `top_k_mode` and `use_top_p` say which masks some row of the batch uses. They are static (pytree metadata, so
    part of the jitted sampler's key, step_programs.SamplerKey) because the host knows them: a mask is chosen at trace
    time instead of by a `lax.cond` on device values, which made the H200 step's jitted call wait until the step
    had run (bench/results/engine_step_sampling.json). The price is one compiled sampler per combination in use (a
    small program: the model step does not depend on it).

    `columns` > 0 is the verify form of an engine with MTP drafts (`for_verify_rows`, `verify_tokens`): a key per
    row and column, and the draft each column tests."""

    temperature: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] float32, 1 = off
    min_p: jax.Array  # [B] float32, 0 = off
    key_data: jax.Array  # [B, 2] uint32 threefry key data; verify form: [B, columns, 2]
    top_k_mode: str = "sort"  # TOP_K_MODES: no row uses top-k / every k <= TOP_CAP / some k > TOP_CAP
    use_top_p: bool = True  # some row uses top-p
    columns: int = 0  # 0: one key per row (sample_tokens); K1: the verify form (verify_tokens)
    drafts: jax.Array | None = None  # verify form: [B, columns] int32, the draft token a column tests (-1: none)

    @staticmethod
    def for_rows(rows: list[tuple[SamplingParams, int] | None], batch_size: int) -> "SamplingInputs":
        """rows[b] = (params, index of the output token row b samples) or None; numpy arrays (device_put later)."""
        return SamplingInputs._of_rows(rows, batch_size, 0)

    @staticmethod
    def for_verify_rows(rows: list[tuple[SamplingParams, int, int, Sequence[int]] | None], batch_size: int,
                        columns: int) -> "SamplingInputs":
        """The verify form. rows[b] = (params, index of the row's next output token, the column of its last known
        token, its drafts) or None. Column first + i holds output token index + i: it tests drafts[i] (i < nd) or
        draws the bonus (i = nd), with the key of that output index, so a token's randomness is its request's
        alone (not the column, which depends on how the prompt was chunked beside other rows)."""
        return SamplingInputs._of_rows(rows, batch_size, columns)

    @staticmethod
    def _of_rows(rows: list, batch_size: int, columns: int) -> "SamplingInputs":
        temperature = np.ones(batch_size, np.float32)
        top_k = np.zeros(batch_size, np.int32)
        top_p = np.ones(batch_size, np.float32)
        min_p = np.zeros(batch_size, np.float32)
        key_data = np.zeros((batch_size, columns, 2) if columns else (batch_size, 2), np.uint32)
        drafts = np.full((batch_size, columns), -1, np.int32) if columns else None
        key = lambda p, index, purpose: np.random.SeedSequence(  # noqa: E731
            [p.seed or 0, index, purpose]).generate_state(2, np.uint32)
        for b, row in enumerate(rows):
            if row is None:
                continue
            p, index = row[:2]
            temperature[b], top_k[b], top_p[b], min_p[b] = p.temperature, max(p.top_k, 0), p.top_p, p.min_p
            if not columns:
                key_data[b] = key(p, index, _PURPOSE)
                continue
            first, row_drafts = row[2:]
            for i in range(len(row_drafts) + 1):
                key_data[b, first + i] = key(p, index + i, _PURPOSE_VERIFY)
            drafts[b, first: first + len(row_drafts)] = row_drafts
        return SamplingInputs(temperature, top_k, top_p, min_p, key_data, *mask_modes(top_k, top_p),
                              columns=columns, drafts=drafts)

    @property
    def masks(self) -> tuple:
        """The static part: which masks the batch's step computes (and, in the verify form, its columns)."""
        return (self.top_k_mode, self.use_top_p) + ((self.columns,) if self.columns else ())


TOP_K_MODES = ("off", "cap", "sort")


def mask_modes(top_k: np.ndarray, top_p: np.ndarray) -> tuple[str, bool]:
    """Host values of the rows' top_k (0 = off) and top_p (1 = off) -> (top_k_mode, use_top_p) for masked_probs.
    A k >= the vocabulary keeps every token; "sort" is still exact for it, only slower."""
    top_k, top_p = np.asarray(top_k), np.asarray(top_p)
    top_k_mode = "sort" if np.any(top_k > TOP_CAP) else "cap" if np.any(top_k > 0) else "off"
    return top_k_mode, bool(np.any(top_p < 1.0))


def masked_probs(logits: jax.Array, temperature, top_k, top_p, min_p, *, top_k_mode: str, use_top_p: bool
                 ) -> jax.Array:
    """logits [..., V] and per-row parameters of shape [...] -> normalised probabilities [..., V] float32.

    Sorting 248k entries per row is slow (118 ms on a 2-core CPU), so each mask is only traced when some row uses
    it (`top_k_mode`, `use_top_p`: static, from `mask_modes` on the host values), and top-k / top-p look among the
    TOP_CAP largest entries first: top-k sorts the row only in mode "sort"; top-p is exact whenever every row's
    nucleus ends inside them, which only the device knows (a `lax.cond` falls back to the full sort: the one
    device-value branch left, in steps where some row uses top-p)."""
    if top_k_mode not in TOP_K_MODES:
        raise ValueError(f"top_k_mode {top_k_mode!r} not in {TOP_K_MODES}")
    lead, v = logits.shape[:-1], logits.shape[-1]
    n, cap = int(np.prod(lead)), min(TOP_CAP, v)
    x = logits.reshape(n, v).astype(jnp.float32) / temperature.reshape(n)[:, None]
    top_k, top_p, min_p = top_k.reshape(n), top_p.reshape(n), min_p.reshape(n)
    rows = jnp.arange(n)[:, None]

    use_k = (top_k > 0) & (top_k < v)
    k = jnp.where(use_k, top_k, 1)

    if top_k_mode != "off":  # kth [n, 1]: the k-th largest value of each row (ties counted)
        if top_k_mode == "cap":  # every k <= TOP_CAP (or k >= v: no mask)
            kth = jnp.take_along_axis(jax.lax.top_k(x, cap)[0], jnp.minimum(k, cap)[:, None] - 1, axis=-1)
        else:
            kth = jnp.take_along_axis(-jnp.sort(-x, axis=-1), k[:, None] - 1, axis=-1)
        x = jnp.where(use_k[:, None] & (x < kth), -jnp.inf, x)
    p = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    p = p / fixed_order.tree_sum(p, -1, keepdims=True)

    use_p = top_p < 1.0

    def nucleus(p):  # [n, V] bool: the shortest prefix in (descending p, ascending id) order with mass < top_p before
        def keep_of(vals, idx):  # its last element; vals / idx: a prefix of that order
            ks = (jnp.cumsum(vals, axis=-1) - vals) < top_p[:, None]
            return jnp.zeros((n, v), bool).at[rows, idx].set(ks), ks[:, -1]

        vals, idx = jax.lax.top_k(p, cap)  # stable: equal values keep ascending ids
        small, open_end = keep_of(vals, idx)

        def full(p):
            order = jnp.argsort(-p, axis=-1, stable=True)
            return keep_of(jnp.take_along_axis(p, order, axis=-1), order)[0]
        return jax.lax.cond(jnp.any(use_p & open_end), full, lambda p: small, p)

    if use_top_p:
        p = jnp.where(use_p[:, None] & ~nucleus(p), 0.0, p)
    p = jnp.where(p >= min_p[:, None] * jnp.max(p, axis=-1, keepdims=True), p, 0.0)
    return (p / jnp.sum(p, axis=-1, keepdims=True)).reshape(*lead, v)


def sample_tokens(logits: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """logits [B, K1, V] -> one token per row and column [B, K1] int32, every column of a row drawn with the row's
    one uniform (the engine reads the column of the row's last token). The engine traces this only into steps where
    some row samples on the device (step_programs.choose_tokens), not behind a lax.cond: with one, the H200 engine
    step at B=1 did not return from the jitted call until the step had run (dispatch 7.5 ms, device time 6.0;
    bench/results/engine_step_sampling.json), as if XLA read the predicate back on the host mid-step."""
    b, k1, v = logits.shape
    bcast = lambda a: jnp.broadcast_to(a[:, None], (b, k1))  # noqa: E731
    p = masked_probs(logits, bcast(inputs.temperature), bcast(inputs.top_k), bcast(inputs.top_p),
                     bcast(inputs.min_p), top_k_mode=inputs.top_k_mode, use_top_p=inputs.use_top_p)
    keys = jax.vmap(lambda d: jax.random.wrap_key_data(d, impl="threefry2x32"))(inputs.key_data)
    # one u per row for all columns: which column holds the row's last token depends on how its prompt was chunked
    u = jax.vmap(jax.random.uniform)(keys)[:, None]
    csum = jnp.cumsum(p, axis=-1)
    idx = jnp.sum(csum <= (u * csum[..., -1])[..., None], axis=-1)  # the first token whose cumulative mass > u
    return jnp.minimum(idx, v - 1).astype(jnp.int32)


def verify_tokens(logits: jax.Array, inputs: SamplingInputs) -> tuple[jax.Array, jax.Array]:
    """Rejection sampling of MTP drafts on the device (inputs in the verify form, `SamplingInputs.for_verify_rows`):
    logits [B, K1, V] -> (tokens [B, K1] int32, accepted [B, K1] bool). A column that tests draft d (drafted as the
    draft head's argmax, so q is one-hot at d) accepts it with probability p(d), p the column's masked
    distribution; its token is then d, else a draw from p without d (max(p - q, 0), renormalised); a column without
    a draft draws from p (the bonus token, or a prefill row's first token). The host commits drafts up to the first
    column that rejects and that column's token (`sampling.verify_sampled`), so each token is distributed as p
    (the standard speculative sampling argument). Each column draws its two uniforms from its own key."""
    b, k1, v = logits.shape
    bcast = lambda a: jnp.broadcast_to(a[:, None], (b, k1))  # noqa: E731
    p = masked_probs(logits, bcast(inputs.temperature), bcast(inputs.top_k), bcast(inputs.top_p),
                     bcast(inputs.min_p), top_k_mode=inputs.top_k_mode, use_top_p=inputs.use_top_p)
    keys = jax.vmap(jax.vmap(lambda d: jax.random.wrap_key_data(d, impl="threefry2x32")))(inputs.key_data)
    uniform = lambda purpose: jax.vmap(jax.vmap(  # noqa: E731
        lambda k: jax.random.uniform(jax.random.fold_in(k, purpose))))(keys)
    return verify_with_uniforms(p, inputs.drafts, uniform(0), uniform(1))


def verify_with_uniforms(p: jax.Array, drafts: jax.Array, u_accept: jax.Array, u_draw: jax.Array
                         ) -> tuple[jax.Array, jax.Array]:
    """verify_tokens' decision from the probabilities p [B, K1, V], drafts [B, K1] (-1: none) and the columns'
    uniforms [B, K1] (a function of its own so that tests can give the uniforms)."""
    v = p.shape[-1]
    has = drafts >= 0
    d = jnp.maximum(drafts, 0)
    p_d = jnp.take_along_axis(p, d[..., None], axis=-1)[..., 0]
    accepted = has & (u_accept < p_d)
    resid = jnp.where(has[..., None] & (jnp.arange(v) == d[..., None]), 0.0, p)
    csum = jnp.cumsum(resid, axis=-1)  # p(d) = 1 leaves nothing: such a column accepts (u < 1), its draw unread
    draw = jnp.minimum(jnp.sum(csum <= (u_draw * csum[..., -1])[..., None], axis=-1), v - 1).astype(jnp.int32)
    return jnp.where(accepted, d, draw).astype(jnp.int32), accepted


@functools.partial(jax.tree_util.register_dataclass, data_fields=["ids", "values"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LogitBias:
    """Per batch row, the request's logit_bias as (ids [B, NB] int32, values [B, NB] float32), padded with
    (0, 0.0): a few bytes per step instead of a dense [B, V] bias (1 MB per row at the real vocabulary). NB is a
    power-of-two bucket of the longest bias of the step (engine), so it is part of the sampler's key."""

    ids: jax.Array
    values: jax.Array

    @staticmethod
    def for_rows(biases: list[dict | None], batch_size: int) -> "LogitBias | None":
        """biases[b]: row b's {id: bias} or None -> numpy LogitBias (device_put later); None when no row has one."""
        longest = max((len(b) for b in biases if b), default=0)
        if not longest:
            return None
        nb = LogitBias.width(longest)
        ids, values = np.zeros((batch_size, nb), np.int32), np.zeros((batch_size, nb), np.float32)
        for row, bias in enumerate(biases):
            if bias:
                ids[row, : len(bias)] = list(bias.keys())
                values[row, : len(bias)] = list(bias.values())
        return LogitBias(ids, values)

    @staticmethod
    def width(longest: int) -> int:
        """NB for a step whose longest bias has `longest` entries (>= 1)."""
        return max(8, 1 << (longest - 1).bit_length())

    def apply(self, logits: jax.Array) -> jax.Array:
        """logits [B, ..., V] + each row's bias (padding adds 0.0 to token 0)."""
        b, v = logits.shape[0], logits.shape[-1]
        dense = jnp.zeros((b, v), jnp.float32).at[jnp.arange(b)[:, None], self.ids].add(self.values)
        return logits + dense.reshape((b,) + (1,) * (logits.ndim - 2) + (v,))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["words"],
                   meta_fields=["sampling", "bias_width", "mask_shape"])
@dataclasses.dataclass(frozen=True)
class SamplerInputs:
    """What a step's sampler (step_programs.choose_tokens) takes besides the logits, as it crosses to the device: the
    rows' SamplingInputs, LogitBias and packed grammar masks side by side in one int32 array `words` [B, C] (float32 and
    uint32 fields bit-cast), so a step costs one host->device copy for all of them instead of one per leaf (up to
    eight; ~60-100 us each on the H200 host, bench/results/structured_cost_device.json). Which parts are present
    (and the masks' shape) is static: part of the sampler's key. `unpack` runs inside the jitted sampler: slices
    and bit-casts, so the values are exactly the ones packed."""

    words: jax.Array
    sampling: tuple | None  # SamplingInputs.masks when some row samples on the device, else None
    bias_width: int  # LogitBias NB (0: no bias)
    mask_shape: tuple | None  # (K1, ceil(V/32)) of the grammar masks, None: no constrained row

    @staticmethod
    def pack(inputs: SamplingInputs | None, bias: LogitBias | None, mask: np.ndarray | None
             ) -> "SamplerInputs | None":
        """numpy parts (each may be None) -> one numpy SamplerInputs (device_put later); None when all are None."""
        parts = []
        if inputs is not None:
            b = inputs.temperature.shape[0]
            parts += [np.stack([inputs.temperature.view(np.int32), inputs.top_k, inputs.top_p.view(np.int32),
                                inputs.min_p.view(np.int32)], axis=1), inputs.key_data.view(np.int32).reshape(b, -1)]
            if inputs.columns:
                parts.append(inputs.drafts)
        if bias is not None:
            parts += [bias.ids, bias.values.view(np.int32)]
        if mask is not None:
            parts.append(mask.reshape(mask.shape[0], -1))
        if not parts:
            return None
        return SamplerInputs(np.concatenate(parts, axis=1).astype(np.int32, copy=False),
                             None if inputs is None else inputs.masks, 0 if bias is None else bias.ids.shape[1],
                             None if mask is None else tuple(mask.shape[1:]))

    def unpack(self) -> tuple[SamplingInputs | None, LogitBias | None, jax.Array | None]:
        w, at = self.words, 0
        f32 = lambda a: jax.lax.bitcast_convert_type(a, jnp.float32)  # noqa: E731
        inputs = bias = mask = None
        if self.sampling is not None:
            columns = self.sampling[2] if len(self.sampling) > 2 else 0
            n_keys = 2 * max(columns, 1)
            key_data = jax.lax.bitcast_convert_type(w[:, 4: 4 + n_keys], jnp.uint32)
            at = 4 + n_keys
            drafts = None
            if columns:
                key_data, drafts = key_data.reshape(-1, columns, 2), w[:, at: at + columns]
                at += columns
            inputs = SamplingInputs(f32(w[:, 0]), w[:, 1], f32(w[:, 2]), f32(w[:, 3]), key_data, *self.sampling,
                                    drafts=drafts)
        if self.bias_width:
            nb = self.bias_width
            bias = LogitBias(w[:, at: at + nb], f32(w[:, at + nb: at + 2 * nb]))
            at += 2 * nb
        if self.mask_shape is not None:
            mask = w[:, at:].reshape(w.shape[0], *self.mask_shape)
        return inputs, bias, mask


PROMPT_LOGITS_CHUNK = 128  # positions whose full-vocabulary logits exist at once while computing prompt logprobs


def prompt_logprobs(logits_of, hidden: jax.Array, targets: jax.Array, n_top: int) -> dict[str, jax.Array]:
    """Raw log-softmax at every row position, for prompt logprobs: hidden [B, T, ...] (the runner's "hidden"
    output), logits_of(hidden chunk) -> [B, c, V] logits, targets [B, T] int32 = the prompt token after each
    position (-1: none). -> "prompt_logprob" [B, T] (the target's logprob; garbage where the target is -1),
    "prompt_top_ids" / "prompt_top_logprobs" [B, T, n_top]. The logits of PROMPT_LOGITS_CHUNK positions exist at
    a time (lax.map), not [B, T, V] at once: 8 GB for an 8,192-token chunk at the real vocabulary."""
    b, t = targets.shape
    c = min(t, PROMPT_LOGITS_CHUNK)
    c = c if t % c == 0 else t
    hs = jnp.moveaxis(hidden.reshape(b, t // c, c, *hidden.shape[2:]), 1, 0)
    ts = jnp.moveaxis(targets.reshape(b, t // c, c), 1, 0)

    def chunk(args):
        h, tgt = args
        x = logits_of(h).astype(jnp.float32)
        lse = fixed_order.logsumexp(x, axis=-1)
        top_values, top_ids = jax.lax.top_k(x, min(n_top, x.shape[-1]))
        chosen = jnp.take_along_axis(x, jnp.maximum(tgt, 0)[..., None], axis=-1)[..., 0]
        return chosen - lse, top_ids, top_values - lse[..., None]

    chosen, top_ids, top_lps = jax.lax.map(chunk, (hs, ts))
    back = lambda a: jnp.moveaxis(a, 0, 1).reshape(b, t, *a.shape[3:])  # noqa: E731
    return {"prompt_logprob": back(chosen), "prompt_top_ids": back(top_ids), "prompt_top_logprobs": back(top_lps)}
