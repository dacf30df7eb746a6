"""Per-request sampling (host, float64) and MTP verification.

Determinism: the random stream for output token j of a request is keyed by (seed, j, purpose), so a request's
samples do not depend on which other requests share its batch, on batch rows, or on pipeline delay.
Speculative verification: greedy accepts a draft iff it equals the target argmax (exact); sampled acceptance is
standard rejection sampling (accept d with prob min(1, p(d)/q(d)), else resample from max(p - q, 0)), so each
output token is distributed exactly as the target's p. Rows without penalties or grammar do that on the device
(device_sampling.verify_tokens, drafts = the draft head's argmax, q one-hot); `verify` here is the host's.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Iterable, Mapping, Sequence

import numpy as np

from .structured_output import StructuredOutputsParams


MAX_LOGPROBS = 20  # top logprobs a request may ask for per token (OpenAI's limit); the step computes this many
LOGIT_BIAS_LIMIT = 100.0  # logit_bias values are clamped to [-100, 100] (vLLM, OpenAI)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability under the model's raw distribution (log_softmax of the logits, before
    temperature, penalties and masks, as vLLM reports by default) and the `top` most likely (token, logprob) pairs
    of that position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: none; n: each output token's logprob and the n most likely (n <= 20)
    prompt_logprobs: int | None = None  # None: none; n: each prompt token's logprob (the first: None) and top n
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit before any other processing
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow (llguidance)
    min_tokens: int = 0  # EOS and stop_token_ids are banned (and stop strings unchecked) before this many tokens
    allowed_token_ids: Sequence[int] | None = None  # only these tokens may be generated
    bad_words: Sequence[str] | None = None  # words that must not be generated (token_bans.py)
    # bad_words as token sequences, vLLM's tokenization (token_bans.bad_words_token_ids): LLM sets them from its
    # tokenizer; an engine without a tokenizer takes them directly
    bad_words_token_ids: Sequence[Sequence[int]] | None = None
    skip_special_tokens: bool = True  # the output text leaves special tokens out
    spaces_between_special_tokens: bool = True  # False: adjacent special tokens' texts are joined without a space
    truncate_prompt_tokens: int | None = None  # keep the last N prompt tokens (-1: the last max_model_len)

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"SamplingParams.{field}={getattr(self, field)!r}: {why}")

        if self.n != 1:
            bad("n", "only n=1 is supported")
        if not isinstance(self.temperature, (int, float)) or not np.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be an int >= 1, or 0/-1 to disable")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        for f in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, f) <= 2.0:
                bad(f, "must be in [-2, 2]")
        if not (np.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            bad("repetition_penalty", "must be > 0 (1 = disabled)")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", "must be a non-negative int or None")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an int >= 1")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            bad("stop", "must be a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or isinstance(self.prompt_logprobs, bool)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
        object.__setattr__(self, "logit_bias", self._checked_bias(bad))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams or None")
        ids = tuple(self.stop_token_ids or ())
        if any(not isinstance(t, (int, np.integer)) or t < 0 for t in ids):
            bad("stop_token_ids", "must be non-negative ints")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        for f in ("skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, f), bool):
                bad(f, "must be true or false")
        if self.truncate_prompt_tokens is not None and (not _is_int(self.truncate_prompt_tokens) or (
                self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)):
            bad("truncate_prompt_tokens", "must be an int >= 1, or -1 (the model's max length)")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be an int in [0, max_tokens={self.max_tokens}]")
        if self.allowed_token_ids is not None:
            allowed = tuple(self.allowed_token_ids) if isinstance(self.allowed_token_ids, Iterable) else ()
            if not allowed or any(not _is_int(t) or t < 0 for t in allowed):
                bad("allowed_token_ids", "must be None or a non-empty list of token ids")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted({int(t) for t in allowed})))
        words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words or ())
        if any(not isinstance(w, str) or not w.strip() for w in words):
            bad("bad_words", "must be a list of non-empty strings")
        object.__setattr__(self, "bad_words", tuple(words) or None)
        if self.bad_words_token_ids is not None:
            seqs = [tuple(w) for w in self.bad_words_token_ids]
            if any(not w or any(not _is_int(t) or t < 0 for t in w) for w in seqs):
                bad("bad_words_token_ids", "must be non-empty lists of token ids")
            object.__setattr__(self, "bad_words_token_ids", tuple(tuple(int(t) for t in w) for w in seqs) or None)

    def _checked_bias(self, bad) -> Mapping[int, float] | None:
        """logit_bias as a fresh {int id: float clamped to [-100, 100]} (None when empty; a plain dict, so params
        still pickle). Ids are checked against the vocabulary by the engine, which knows it."""
        if self.logit_bias is None:
            return None
        if not isinstance(self.logit_bias, Mapping):
            bad("logit_bias", "must be a mapping of token id -> bias")
        out = {}
        for t, b in self.logit_bias.items():
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or t < 0:
                bad("logit_bias", f"key {t!r} is not a non-negative token id")
            if not isinstance(b, (int, float, np.number)) or isinstance(b, bool) or not np.isfinite(b):
                bad("logit_bias", f"the bias of token {t} must be a finite number, got {b!r}")
            out[int(t)] = float(np.clip(b, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT))
        return out or None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def device_argmax(self) -> bool:
        """Greedy without penalties: every token is the argmax of the raw logits, which the engine's step computes
        on the device, so the full-vocabulary logits never need to reach the host."""
        return self.greedy and not self.has_penalties

    def with_bad_words_tokenized(self, encode) -> "SamplingParams":
        """bad_words as token sequences (bad_words_token_ids) with `encode(text) -> ids` (no special tokens); self
        when it has none or they are tokenized already."""
        if not self.bad_words or self.bad_words_token_ids is not None:
            return self
        from .token_bans import bad_words_token_ids

        return dataclasses.replace(self, bad_words_token_ids=bad_words_token_ids(self.bad_words, encode))

    def with_defaults(self) -> "SamplingParams":
        """A sampled request without a seed gets a random one now, so its whole stream is fixed from here on."""
        if self.seed is None and not self.greedy:
            return dataclasses.replace(self, seed=random.SystemRandom().randrange(2**63))
        return self


def truncate_prompt(ids: Sequence[int], n: int | None, max_model_len: int) -> list[int]:
    """The last n ids of a prompt (vLLM's truncate_prompt_tokens: -1 is max_model_len, None keeps all; n over
    max_model_len is an error, in vLLM's words)."""
    if n is None:
        return list(ids)
    if n > max_model_len:
        raise ValueError(f"truncate_prompt_tokens value ({n}) is greater than max_model_len ({max_model_len}). "
                         "Please, select a smaller truncation size.")
    return list(ids[-(max_model_len if n == -1 else n):])


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def token_logprob(logits: np.ndarray, token: int, n_top: int) -> TokenLogprob:
    """TokenLogprob of `token` from one position's raw logits [V] (float64 log_softmax; ties in the top list by
    ascending id, as lax.top_k orders them on the device)."""
    x = logits.astype(np.float64)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))
    top = np.argsort(-lp, kind="stable")[:n_top]
    return TokenLogprob(int(token), float(lp[token]), tuple((int(i), float(lp[i])) for i in top))


def _rng(params: SamplingParams, index: int, purpose: int) -> np.random.Generator:
    return np.random.default_rng([params.seed or 0, index, purpose])


def apply_logit_bias(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """logits + logit_bias (float64 where a bias applies; the logits themselves, no copy, when none does). The
    first of the processing steps, as in vLLM: penalties, temperature and the masks see the biased logits."""
    if not params.logit_bias:
        return logits
    x = logits.astype(np.float64)  # a copy
    ids = np.fromiter(params.logit_bias.keys(), np.int64)
    x[..., ids] += np.fromiter(params.logit_bias.values(), np.float64)
    return x


def apply_penalties(logits: np.ndarray, params: SamplingParams, tokens: Sequence[int], num_prompt: int) -> np.ndarray:
    """Repetition / presence / frequency penalties in float64; the logits themselves (no copy) when none apply."""
    repetition = params.repetition_penalty != 1.0 and len(tokens) > 0
    counted = bool(params.presence_penalty or params.frequency_penalty) and len(tokens) > num_prompt
    if not (repetition or counted):
        return logits
    x = logits.astype(np.float64)
    if repetition:
        seen = np.unique(np.asarray(tokens, np.int64))
        v = x[seen]
        x[seen] = np.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
    if counted:
        counts = np.bincount(np.asarray(tokens[num_prompt:], np.int64), minlength=x.shape[0])[: x.shape[0]]
        x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    return x


def nucleus_mask(p: np.ndarray, top_p: float) -> np.ndarray:
    """The top-p set: the shortest prefix of p in (descending probability, ascending token id) order whose mass
    before its last element is < top_p.

    A full sort of a 248k vocabulary costs ~30 ms per token on the host, but the tokens above a threshold t are
    exactly a prefix of that order, so sorting only them gives the same prefix whenever their mass reaches top_p.
    t starts at 1e-3 of the largest probability (a few thousand tokens at most for a language model) and drops
    twice before the full sort is the fallback (tests/test_sampling.py compares with the full sort)."""
    n = p.shape[0]
    for rel in (1e-3, 1e-5, 1e-8):
        cand = np.flatnonzero(p >= rel * p.max())
        if cand.shape[0] > n // 2:
            break  # a flat distribution: the full sort costs about the same
        cand = cand[np.lexsort((cand, -p[cand]))]  # (descending p, ascending id), as a stable sort of -p
        csum = np.cumsum(p[cand])
        if csum[-1] >= top_p:  # the prefix reaching top_p lies inside the candidates
            mask = np.zeros(n, dtype=bool)
            mask[cand[(csum - p[cand]) < top_p]] = True
            return mask
    order = np.argsort(-p, kind="stable")
    csum = np.cumsum(p[order])
    mask = np.zeros(n, dtype=bool)
    mask[order[(csum - p[order]) < top_p]] = True
    return mask


def probs_from_logits(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature, top-k, top-p, min-p -> a normalised distribution (one-hot when greedy)."""
    if params.greedy:
        p = np.zeros_like(x, dtype=np.float64)
        p[int(np.argmax(x))] = 1.0
        return p
    x = x.astype(np.float64) / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[0]:
        kth = np.partition(x, -params.top_k)[-params.top_k]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - np.max(x))
    p /= p.sum()
    if params.top_p < 1.0:
        p = np.where(nucleus_mask(p, params.top_p), p, 0.0)
    if params.min_p > 0.0:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
    return p / p.sum()


def check_finite_flags(finite, rid: str):
    """Raises unless every flag is True (the device's all-finite flags of a row's logits, or np.isfinite)."""
    if not np.all(finite):
        raise FloatingPointError(f"non-finite logits for request {rid!r}: its state is corrupt (poisoned slot?)")


def _check_finite(logits: np.ndarray, rid: str):
    check_finite_flags(np.isfinite(logits), rid)


def _draw(p: np.ndarray, rng: np.random.Generator) -> int:
    return int(min(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right"), p.shape[0] - 1))


def sample(logits: np.ndarray, params: SamplingParams, tokens: Sequence[int], num_out: int, rid: str = "?") -> int:
    _check_finite(logits, rid)
    x = apply_penalties(apply_logit_bias(logits, params), params, tokens, len(tokens) - num_out)
    if params.greedy:  # the argmax of the one-hot distribution probs_from_logits would build
        return int(np.argmax(x))
    return _draw(probs_from_logits(x, params), _rng(params, num_out, 0))


def verify(target: np.ndarray, drafts: list[int], draft_probs: list, params: SamplingParams, tokens: Sequence[int],
           num_out: int, rid: str = "?", allowed: np.ndarray | None = None) -> tuple[int, list[int]]:
    """target [nd + 1, V]: logits predicting drafts[0..nd-1] and the bonus. -> (accepted drafts m, m + 1 tokens).
    allowed [nd + 1, V] bool (a grammar's masks, structured_output.py): the target restricted to those tokens, so a
    draft the grammar forbids has p = 0 and is rejected; the draft's q must be masked the same way."""
    _check_finite(target, rid)
    target = apply_logit_bias(target, params)
    num_prompt = len(tokens) - num_out
    hist = list(tokens)
    out: list[int] = []
    for i in range(len(drafts) + 1):
        x = apply_penalties(target[i], params, hist, num_prompt)
        if allowed is not None:
            x = np.where(allowed[i], x, -np.inf)
        if params.greedy:  # the argmax of the one-hot distribution probs_from_logits would build
            t = int(np.argmax(x))
            if i == len(drafts) or t != drafts[i]:
                return i, out + [t]
            out.append(t)
            hist.append(t)
            continue
        p = probs_from_logits(x, params)
        if i == len(drafts):
            return i, out + [_draw(p, _rng(params, num_out + i, 0))]
        d = drafts[i]
        q = draft_probs[i] if i < len(draft_probs) and draft_probs[i] is not None else None
        qd = 1.0 if q is None else float(q[d])
        if not _rng(params, num_out + i, 1).random() < min(1.0, p[d] / qd if qd > 0 else 1.0):
            resid = p.copy()
            if q is None:
                resid[d] = 0.0
            else:
                resid = np.maximum(p - q, 0.0)
            if resid.sum() <= 0:
                resid = p
            return i, out + [_draw(resid / resid.sum(), _rng(params, num_out + i, 2))]
        out.append(d)
        hist.append(d)
    raise AssertionError("unreachable")


def verify_argmax(argmax: np.ndarray, finite: np.ndarray, drafts: list[int], rid: str = "?") -> tuple[int, list[int]]:
    """`verify` for SamplingParams.device_argmax rows from the device's per-column argmax [nd + 1] and all-finite
    flags [nd + 1] of the same logits: the same result as verify(logits, ...) without the logits."""
    check_finite_flags(finite, rid)
    for i, t in enumerate(int(a) for a in argmax):
        if i == len(drafts) or t != drafts[i]:
            return i, list(drafts[:i]) + [t]
    raise AssertionError("unreachable")


def verify_sampled(tokens: np.ndarray, accepted, finite: np.ndarray, drafts: list[int], rid: str = "?"
                   ) -> tuple[int, list[int]]:
    """`verify` for rows the device samples (device_sampling.verify_tokens, or sample_tokens without drafts), from
    its per-column tokens [nd + 1], draft acceptances [nd] and all-finite flags [nd + 1]: the drafts up to the first
    rejected one, then that column's token (its draw from p without the draft; the bonus when none is rejected)."""
    check_finite_flags(finite, rid)
    for i, d in enumerate(drafts):
        if not accepted[i]:
            return i, list(drafts[:i]) + [int(tokens[i])]
        if int(tokens[i]) != d:
            raise AssertionError(f"request {rid}: the device accepted draft {d} at column {i} but gave {tokens[i]}")
    return len(drafts), list(drafts) + [int(tokens[len(drafts)])]


def propose_argmax(argmax: np.ndarray, finite: np.ndarray, rid: str = "?"):
    """`propose` for SamplingParams.device_argmax rows from the device's argmax [nd] and all-finite flags [nd]."""
    check_finite_flags(finite, rid)
    return [int(t) for t in argmax], [None] * len(argmax)


def propose(draft_logits: np.ndarray, params: SamplingParams, num_out: int, rid: str = "?",
            allowed: np.ndarray | None = None):
    """Draft tokens from the MTP head's logits [nd, V] -> (tokens, q per token or None when greedy); allowed
    [nd, V] bool: drafts restricted to those tokens (q too)."""
    _check_finite(draft_logits, rid)
    draft_logits = apply_logit_bias(draft_logits, params)  # the proposals come from the biased draft distribution
    if allowed is not None:
        draft_logits = np.where(allowed, draft_logits, -np.inf)
    if params.greedy:
        return [int(np.argmax(r)) for r in draft_logits], [None] * len(draft_logits)
    toks, qs = [], []
    for i, r in enumerate(draft_logits):
        q = probs_from_logits(r, params)
        toks.append(_draw(q, _rng(params, num_out + i, 3)))
        qs.append(q)
    return toks, qs
