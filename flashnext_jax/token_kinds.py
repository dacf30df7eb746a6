"""Token kinds: in a batch-invariant step on the GPU kernels, a request's generated tokens go through the GEMV
kernels and its prompt tokens through the tensor-core kernels (docs/batch-invariance.md, "Token kinds").

Why: batch invariance needs each token's arithmetic to be the same whatever else is in its step, so one kernel
must serve a token at every row count. The tensor-core kernels serve prefill, but at decode sizes (M <= 2) the
CUDA-core GEMVs are 1.4-2.4x faster (bench/results/batch_invariance_4layers_h100_stop44.json: the invariant decode
step cost 1.54x the fast mode's with the tensor-core kernels for every token). A token is a prompt token or a
generated one in its solo run and in any batch alike, so the kernel may follow the kind: the GEMVs' fixed
variants (`quant_matmul(path="gemv_fixed")`, `routed_experts(path="gemv_fixed")`) round a token the same at
every M, and so do the tensor-core kernels' invariant configurations.

What makes it hold is the scheduler (SchedulerConfig.token_kinds): a row's tokens are all prompt tokens or all
generated ones; a generated row holds at most `tokens` (the decode step's width) in columns [0, tokens); a step
shaped like a decode step holds generated rows only; prefix-cache snapshots stop at the prompt (a later request
reading a cached generated token as its prompt would otherwise read a GEMV-computed value where its solo run
computes it as a prompt token).

The step sets the context (`step_programs.model_step`) from its batch; `layers.linear` and `moe.moe_forward` read it at
trace time, so a program keeps what it was traced with."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TokenKinds:
    generated: jax.Array  # [B] bool: the row's tokens are generated tokens (else prompt tokens or padding)
    tokens: int  # a generated row's tokens sit in columns [0, tokens) (the decode step's width)
    all_generated: bool  # the step is shaped like a decode step: every row is generated (or padding)


_KINDS: contextvars.ContextVar[TokenKinds | None] = contextvars.ContextVar("flashnext_token_kinds", default=None)


def current() -> TokenKinds | None:
    return _KINDS.get()


@contextlib.contextmanager
def token_kinds(kinds: TokenKinds | None):
    """Trace the enclosed step with its rows' token kinds (None: no kinds, every token takes the prompt path)."""
    handle = _KINDS.set(kinds)
    try:
        yield
    finally:
        _KINDS.reset(handle)


def by_kind(x, generated_fn: Callable, prompt_fn: Callable) -> jax.Array:
    """f(x) with f = generated_fn on the generated rows' tokens and prompt_fn on the others. x: an array
    [B, t, ..., K] or a tuple of such arrays (the step's rows first, each possibly repeated r times in a row as
    [B * r, ...]; then the call's tokens per row: t may differ from the step's width, e.g. the last position only);
    both functions map x (sliced along t) to [B, t', ..., N] token by token.

    Outside a kinds context every token takes prompt_fn; in a decode-shaped step, generated_fn. Otherwise both run
    (prompt_fn on every token, generated_fn on the first min(t, tokens) columns, where the generated rows' tokens
    are) and each row keeps its kind's result: in a prefill step the decode rows beside it cost one GEMV pass."""
    kinds = _KINDS.get()
    if kinds is None:
        return prompt_fn(x)
    if kinds.all_generated:
        return generated_fn(x)
    rows = kinds.generated.shape[0]
    first = x[0] if isinstance(x, tuple) else x
    if first.ndim < 3 or first.shape[0] % rows:
        raise ValueError(f"a call inside a step with token kinds takes [rows={rows} (or each row repeated), tokens, "
                         f"..., features] inputs, got {first.shape}")
    width = min(first.shape[1], kinds.tokens)
    y = prompt_fn(x)
    head = generated_fn(jax.tree.map(lambda a: a[:, :width], x))
    # the dense MTP oracle runs each row's K1 alternatives as rows b * K1 + c (runner._mtp_dense): row b's kind,
    # repeated (the paged drafts, mtp_paged.py, keep them as a row's K1 tokens)
    generated = jnp.repeat(kinds.generated, first.shape[0] // rows)
    keep = generated.reshape((first.shape[0],) + (1,) * (head.ndim - 1))
    head = jnp.where(keep, head, y[:, :width])
    return head if width == first.shape[1] else jnp.concatenate([head, y[:, width:]], axis=1)
