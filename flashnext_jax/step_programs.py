"""The jitted programs of one engine step and the keys they are compiled by: the model step (`model_step`: the
runner's step plus the argmax and finite flags the host commits greedy rows from), the sampler (`choose_tokens`:
everything else that chooses tokens), async scheduling's `chain_tokens`, and `jitted_step`, which keeps a
runner's compiled programs (step_cache.StepCache) with the runner."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import fixed_order

from . import sampling, token_kinds
from .compile_ahead import CompileAhead
from .device_sampling import SamplerInputs, prompt_logprobs, sample_tokens, verify_tokens
from .model_runner import ModelRunner, PackedBatch, unpacked
from .step_cache import StepCache
from .structured_output import apply_token_bitmask


def model_step(step: Callable, logits_of: Callable | None = None) -> Callable:
    """runner.step(params, store, batch) plus, computed on the device: for "logits" and "draft_logits" the argmax
    over the vocabulary ("<name>_argmax") and whether every logit is finite ("<name>_finite"). Greedy rows commit
    from these few bytes instead of copying [B, K1, V] float32 logits to the host (1 MB per row at the real
    vocabulary). A PackedBatch is unpacked here, inside the jitted step. Everything else that chooses tokens
    (device sampling, logprobs, logit bias, grammar masks) is `choose_tokens`, a program of its own, so a model
    step is compiled once per StepKey whatever its rows' sampling.

    `prompt_targets` ([B, T] int32, None when no row asks for prompt logprobs): the step runs with
    all_positions=True and returns the raw logprob of each position's next prompt token and the top
    MAX_LOGPROBS of every position (device_sampling.prompt_logprobs, from logits_of(params, hidden)). None: jit
    traces None and an array separately, so steps without prompt logprobs compute nothing for them.

    `stage_inputs`: what a last pipeline stage takes besides the batch (the previous stage's hyper state)."""
    def run(params, store, batch, prompt_targets=None, *stage_inputs):
        batch, kinds = unpacked(batch)
        with token_kinds.token_kinds(kinds):
            if prompt_targets is None:
                store, out = step(params, store, batch, *stage_inputs)
            else:
                store, out = step(params, store, batch, *stage_inputs, all_positions=True)
            out = dict(out)
            for name in ("logits", "draft_logits"):
                out[name + "_finite"] = jnp.all(jnp.isfinite(out[name]), axis=-1)
                out[name + "_argmax"] = jnp.argmax(out[name], axis=-1).astype(jnp.int32)  # first maximum, as numpy
            if prompt_targets is not None:
                out.update(prompt_logprobs(lambda h: logits_of(params, h), out.pop("hidden"), prompt_targets,
                                           sampling.MAX_LOGPROBS))
        return store, out
    return run


def choose_tokens(logits, draft_logits, sampling_inputs=None, logit_bias=None, token_mask=None,
                  logprobs: bool = False) -> dict:
    """What a step's rows need beyond the model step's argmax, from its raw logits [B, K1, V] and draft logits
    [B, K1, k, V], as a small program of its own (the engine's sampler: its size does not grow with the model, 1-2 s
    to compile on a 2-core CPU where a model step takes about a minute at the real size on a GPU, so its variants
    cost little: docs/engine-design.md, "Compiles"). Each input traces its code only when given (None: jit traces
    nothing for it), so the sampler's key (SamplerKey) says which:

    * `sampling_inputs` (device_sampling.SamplingInputs): the tokens of the rows that sample on the device
      ("logits_sample"; in the verify form of an engine with MTP drafts, the token each column commits if reached
      and whether it accepted its draft, "logits_accept": device_sampling.verify_tokens); which masks it traces
      (top-k, top-p) and the form are static, part of the key;
    * `logit_bias` (device_sampling.LogitBias): added to the logits and draft logits the argmax and the device
      sample choose from (then "logits_argmax" / "draft_logits_argmax" are the biased ones and replace the model
      step's); the raw logits stay raw (the host adds the bias itself where it samples, sampling.apply_logit_bias);
    * `token_mask` [B, K1, ceil(V/32)] int32 (the packed masks of the token-choosing columns of rows with a grammar
      or bans, both ANDed: structured outputs, min_tokens / allowed_token_ids / bad_words; -1 words elsewhere):
      masked columns choose their argmax / sample among the allowed tokens only; the finite flags and the logprobs
      stay those of the raw logits;
    * `logprobs` (static): the log-softmax of the raw logits at the device's tokens ("logits_argmax_logprob",
      "logits_sample_logprob") and the MAX_LOGPROBS most likely tokens of every position ("logits_top_ids",
      "logits_top_logprobs"): a top-k over the whole vocabulary, so only in steps where a row reads them."""
    out = {}
    chosen_from = {"logits": logits, "draft_logits": draft_logits}
    if logit_bias is not None:
        chosen_from = {name: logit_bias.apply(x) for name, x in chosen_from.items()}
    if token_mask is not None:
        chosen_from["logits"] = apply_token_bitmask(chosen_from["logits"], token_mask)
    # the argmax of what the bias or the mask changed (a mask alone leaves the draft logits: their argmax is the
    # model step's)
    changed = ["logits", "draft_logits"] if logit_bias is not None else ["logits"] if token_mask is not None else []
    out = {name + "_argmax": jnp.argmax(chosen_from[name], axis=-1).astype(jnp.int32) for name in changed}
    if sampling_inputs is not None and sampling_inputs.columns:  # MTP drafts to verify
        out["logits_sample"], out["logits_accept"] = verify_tokens(chosen_from["logits"], sampling_inputs)
    elif sampling_inputs is not None:
        out["logits_sample"] = sample_tokens(chosen_from["logits"], sampling_inputs)
    if logprobs:
        x = logits.astype(jnp.float32)
        lse = fixed_order.logsumexp(x, axis=-1)
        top_values, out["logits_top_ids"] = jax.lax.top_k(x, min(sampling.MAX_LOGPROBS, x.shape[-1]))
        out["logits_top_logprobs"] = top_values - lse[..., None]
        taken = lambda ids: jnp.take_along_axis(x, ids[..., None], axis=-1)[..., 0] - lse  # noqa: E731
        argmax = out["logits_argmax"] if "logits_argmax" in out else jnp.argmax(x, axis=-1).astype(jnp.int32)
        out["logits_argmax_logprob"] = taken(argmax)
        if sampling_inputs is not None:
            out["logits_sample_logprob"] = taken(out["logits_sample"])
    return out


def choose_tokens_packed(logits, draft_logits, inputs: SamplerInputs | None, logprobs: bool = False) -> dict:
    """The engine's sampler: choose_tokens with its inputs unpacked from the step's one SamplerInputs transfer."""
    return choose_tokens(logits, draft_logits, *(inputs.unpack() if inputs is not None else (None,) * 3),
                         logprobs=logprobs)


def with_device_sampling(step: Callable, logits_of: Callable | None = None) -> Callable:
    """`model_step` then `choose_tokens` in one function, what the engine's two programs compute together (tests
    and benchmarks of the token-choosing code): run(params, store, batch, sampling_inputs, logprobs, logit_bias,
    prompt_targets, token_mask) -> (store, outputs)."""
    model = model_step(step, logits_of)

    def run(params, store, batch, sampling_inputs=None, logprobs=False, logit_bias=None, prompt_targets=None,
            token_mask=None):
        store, out = model(params, store, batch, prompt_targets)
        if logprobs or any(a is not None for a in (sampling_inputs, logit_bias, token_mask)):
            out |= choose_tokens(out["logits"], out["draft_logits"], sampling_inputs, logit_bias, token_mask,
                                 logprobs)
        return store, out
    return run


def chain_tokens(chained_host_inputs: Callable, chain_params, batch: PackedBatch, argmax, sample, src,
                 context) -> PackedBatch:
    """Async scheduling: a batch whose chained rows take their one input token from the previous step's outputs on
    the device (argmax [B', K1], sample [B', K1] or None: the step before, still in flight or just done), and the
    host inputs made from that token there (`runner.chained_host_inputs`: the PLE n-gram rows, which replace column 0
    of the chained rows' host inputs of those names). src [B, 3] int32
    per row of this batch: (row, column) of that token in the previous step's outputs (row -1: not chained),
    sampled (1: the device sample, 0: the argmax), copied from the rows' tickets (tickets.TokenSource); context
    [B, runner.chain_context_len] the tokens before it (-1 before the first). A small program of its own, traced
    with 64-bit integers (the n-gram hash)."""
    row, col, sampled = src[:, 0], src[:, 1], src[:, 2]
    chained = row >= 0
    at = (jnp.maximum(row, 0), col)
    token = argmax[at]
    if sample is not None:
        token = jnp.where(sampled == 1, sample[at], token)
    first = PackedBatch.LEAD  # the column of a row's first token
    token = jnp.where(chained, token, batch.ints[:, first]).astype(jnp.int32)
    host = dict(batch.host)
    for name, value in chained_host_inputs(chain_params, token, batch.ints[:, 3], context).items():
        old = host[name]
        keep = chained.reshape(-1, *([1] * (old.ndim - 2)))
        host[name] = old.at[:, 0].set(jnp.where(keep, value.astype(old.dtype), old[:, 0]))
    return dataclasses.replace(batch, ints=batch.ints.at[:, first].set(token), host=host)


def jitted_step(runner: ModelRunner, batch_invariant: bool = True,
                token_kinds: bool = False) -> tuple[Any, StepCache, CompileAhead]:
    """The runner's compiled model steps by StepKey (one StepCache per runner, shared by its engines; a new key
    compiles: about a minute at the real model size, so the engine logs it), its compiled samplers (choose_tokens)
    by SamplerKey, and the background compiler that compiles model steps before they are needed (compile_ahead.py).
    A pipeline (pipeline.py) has one jitted model step per stage instead: its PipelineSteps stands in for the model
    steps' StepCache. Engines of one runner in the two batch-invariance modes (EngineConfig.batch_invariant) get
    separate caches: a program keeps the mode it was traced in; so do engines with and without token kinds (their
    batches carry the kinds' width, EngineConfig.token_kinds).

    The programs live in the runner's own attributes, so they go with it: a process that makes engine after engine
    (a notebook, a benchmark) must not keep every executable it ever compiled (each holds memory mappings). A copy
    of a runner (`copy.copy`) starts with none of them."""
    owner, programs = vars(runner).get("_engine_programs", (None, None))
    if owner != id(runner):
        programs = {}
        vars(runner)["_engine_programs"] = (id(runner), programs)  # vars(): frozen dataclasses too
    hit = programs.get((batch_invariant, token_kinds))
    if hit is None:
        if hasattr(runner, "pipeline_step"):
            if runner.batch_invariant != batch_invariant:
                raise ValueError(f"the pipeline's stages were built with batch_invariant={runner.batch_invariant}, "
                                 f"the engine asks for {batch_invariant}: pass the same to PipelineRunner")
            steps = runner.steps()
        else:
            steps = StepCache(model_step(runner.step, getattr(runner, "logits", None)), 32, name="run",
                              batch_invariant=batch_invariant)
        samplers = StepCache(choose_tokens_packed, 64, donate_argnums=(), static_argnums=(3,), name="choose_tokens",
                             log_level=logging.DEBUG, batch_invariant=batch_invariant)
        hit = (steps, samplers, CompileAhead(steps.compile, steps.__contains__))
        programs[(batch_invariant, token_kinds)] = hit
    return hit


def _components(key: tuple, fields: Sequence[str]) -> str:
    return " ".join(f"{name}={getattr(key, name)}" for name in fields)


class StepKey(NamedTuple):
    """What one compiled model step (model_step) is specialised to: its StepCache key (a plain tuple of the same
    values is the same key). Nothing about how rows choose their tokens is in it: that is the SamplerKey's."""

    rows: int  # B: a power-of-two bucket of the step's rows
    tokens: int  # T: the decode bucket or a prefill bucket (Engine._token_bucket)
    page_table_width: int  # pages per row in the step's page tables
    prompt_logprobs: bool  # every position's logits (some row asks for prompt logprobs)
    store: tuple  # the store's leaf shapes (engines of one runner with other pool sizes share the cache)
    images: bool = False  # some row has images: 3-D positions from the slots' spans, the tower's rows as inputs

    def describe(self) -> str:
        """The key in words, for the log."""
        return (f"{self.rows} rows x {self.tokens} tokens, page tables of {self.page_table_width} pages"
                + (", with prompt logprobs" if self.prompt_logprobs else "") + (", with images" if self.images else ""))

    def components(self) -> str:
        """Every component but the store, by name (the debug line of a new key)."""
        return _components(self, [f for f in self._fields if f != "store"])


class SamplerKey(NamedTuple):
    """What one compiled sampler (choose_tokens) is specialised to. It runs after a model step whose rows need more
    than the step's argmax: device sampling, logprobs, a logit bias or grammar masks. Its inputs' other dimensions
    (K1, drafts, vocabulary) are the runner's, so fixed for its StepCache."""

    rows: int  # B, as the model step's
    sampling: tuple | None  # SamplingInputs.masks of the rows sampled on the device (top_k_mode, use_top_p[, the
    # verify form's columns]); None: no row samples there
    logprobs: bool  # the logsumexp and top-k logprob outputs (a row whose token the device chooses wants logprobs)
    logit_bias_width: int  # (id, bias) pairs per row (device_sampling.LogitBias), 0: no row has a logit_bias
    grammar: bool  # packed token masks (some row has a grammar or bans: token_bans.py)

    def describe(self) -> str:
        words = f"the sampler of {self.rows} rows"
        if self.sampling is not None:
            top_k_mode, use_top_p, *verify = self.sampling
            words += ", sampling on the device" + {"off": "", "cap": " with top-k", "sort": " with top-k (full sort)"}[
                top_k_mode] + (" with top-p" if use_top_p else "") + (", verifying drafts" if verify else "")
        words += ", with logprobs" if self.logprobs else ""
        words += f", logit bias of up to {self.logit_bias_width} tokens" if self.logit_bias_width else ""
        return words + (", with grammar masks" if self.grammar else "")

    def components(self) -> str:
        return _components(self, self._fields)

    @property
    def needed(self) -> bool:
        """Whether the step's rows need the sampler at all (greedy rows alone commit from the model step)."""
        return self.sampling is not None or self.logprobs or bool(self.logit_bias_width) or self.grammar


__all__ = ["SamplerKey", "StepKey", "chain_tokens", "choose_tokens", "choose_tokens_packed", "jitted_step",
           "model_step", "with_device_sampling"]
