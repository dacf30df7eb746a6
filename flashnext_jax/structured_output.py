"""Structured outputs: a request's grammar (llguidance), its matcher state on the host, and the token masks.

A constrained request owns one `GrammarState` (an llguidance `LLMatcher`) in the engine's per-request
bookkeeping, keyed by request id: created at admission, advanced at commit with the tokens the step accepted,
dropped when the request finishes. Before a step the engine asks `GrammarCompiler.fill_masks` for the packed
int32 bitmask of every token position that chooses a token: the request's current position and, under MTP, one
per draft token (the matcher walks through the drafts and rolls them back, so its state stays the committed
one). The bitmask crosses to the device in the step's one transfer of sampler inputs (device_sampling.SamplerInputs)
and masks the logits inside the jitted sampler (`apply_token_bitmask`); host-sampled paths use the same rows
(`allowed_tokens`). docs/structured-output.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from typing import Any, Sequence

import numpy as np

import llguidance
from llguidance.numpy import (fill_next_token_bitmask, fill_next_token_bitmask_par,
                              fill_next_token_bitmask_par_with_draft_tokens)

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True, eq=False)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one of a JSON schema (dict or its JSON text), a regular expression,
    a list of choices (the output is one of them verbatim), a Lark grammar, or json_object=True (any JSON object).
    `after` (ours, not vLLM's): the grammar applies only once the output contains this text, e.g. "</think>" so a
    reasoning model thinks freely first (the server sets it with --reasoning-parser)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    after: str | None = None

    def __post_init__(self):
        given = [k for k in _KINDS if (getattr(self, k) not in (None, False))]
        if len(given) != 1:
            raise ValueError("StructuredOutputsParams: give exactly one of json, regex, choice, grammar, json_object"
                             f" (got {given or 'none'})")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json: a JSON schema must be an object (or true/false)")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{k}: must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or not all(isinstance(c, str) and c
                                                                             for c in self.choice):
                raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object is not False and self.json_object is not True:
            raise ValueError("structured_outputs.json_object: must be true or false")
        if self.after is not None and (not isinstance(self.after, str) or not self.after):
            raise ValueError("structured_outputs.after: must be a non-empty string")

    @property
    def spec(self) -> tuple[str, str]:
        """(kind, canonical text): the key compiled grammars are cached by."""
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return "json", json.dumps(schema)  # key order kept: it is the order properties are generated in
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


def _grammar_text(kind: str, text: str) -> str:
    """llguidance's grammar for a spec. JSON: compact (no free whitespace between tokens), so a model cannot spend
    its whole budget on blanks, and additional properties follow the schema (JSON Schema's default: allowed)."""
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(text, overrides={"whitespace_flexible": False})
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             overrides={"whitespace_flexible": False})
    if kind == "choice":
        return llguidance.grammar_from("choice", json.loads(text))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    return llguidance.grammar_from("lark", text)


def _one_line(message: str) -> str:
    return " ".join(message.split())


class GrammarState:
    """One request's matcher. Its state is always the request's committed output: masks for draft positions are
    computed by walking the drafts and rolling them back (llguidance's executor does both)."""

    def __init__(self, matcher: llguidance.LLMatcher, spec: tuple[str, str], after: str | None = None,
                 lltokenizer: llguidance.LLTokenizer | None = None):
        self.matcher, self.spec = matcher, spec
        self.step_mask: np.ndarray | None = None  # [positions, words] of the step in flight (host-sampled paths)
        self.waiting_for = after.encode() if after else None  # dormant (no masks) until the output holds this
        self._lltok, self._tail = lltokenizer, b""

    @property
    def active(self) -> bool:
        return self.waiting_for is None

    def commit(self, tokens: Sequence[int], request_id: str) -> None:
        """Advance by the tokens the step accepted; each was chosen under its mask, so a refusal is an engine bug.
        Dormant: look for the text the grammar waits for (the token that completes it ends the free part)."""
        if not self.active:
            self._tail = (self._tail + self._lltok.decode_bytes([int(t) for t in tokens]))[-4 * len(
                self.waiting_for):]
            if self.waiting_for in self._tail:
                self.waiting_for = None
            return
        if not self.matcher.consume_tokens([int(t) for t in tokens]):
            raise RuntimeError(f"request {request_id!r}: the grammar refused committed tokens {list(tokens)}: "
                               f"{self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and admits no further token (only EOS)."""
        return self.active and self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles specs into matchers for one tokenizer and one logits width. Compiled grammars are cached by
    (kind, spec): a new request deep-copies a pristine matcher instead of compiling its grammar again."""

    # below this many matchers a step's masks are filled on the calling thread: at B = 2 llguidance's executor
    # threads gained nothing on the (loaded) 2-core host (bench/results/structured_cost.json, "fill": "executor"
    # vs "serial"); 8 is a guess at where parallel filling pays on a host with cores to spare (not measured)
    PARALLEL_FROM = 8

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 256, num_threads: int | None = None,
                 lltokenizer: llguidance.LLTokenizer | None = None):
        self.vocab_size = int(vocab_size)  # the logits' width (may exceed the tokenizer's: padding ids forbidden)
        self.words = (self.vocab_size + 31) // 32
        self._tokenizer, self._lltok, self._executor = tokenizer, lltokenizer, None
        self._num_threads = num_threads
        self._lock = threading.Lock()
        self._compiled = functools.lru_cache(maxsize=cache_size)(self._compile)

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (from its HF tokenizers JSON), built on first use (~1 s at 248K)."""
        if self._lltok is None:
            n = self._tokenizer.vocab_size
            if n > self.vocab_size:
                raise ValueError(f"tokenizer has {n} tokens, more than the model's {self.vocab_size} logits")
            self._lltok = llguidance.LLTokenizer(self._tokenizer.tok.to_str(), n_vocab=self.vocab_size,
                                                 eos_token=self._tokenizer.eos_token_id)
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._num_threads)
        return self._lltok

    def _compile(self, kind: str, text: str) -> llguidance.LLMatcher:
        try:
            grammar = _grammar_text(kind, text)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{kind}: {e}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.lltokenizer)
        if is_error:
            raise ValueError(f"structured_outputs.{kind}: unsupported or invalid: {_one_line(messages[0])}")
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{kind}: unsupported or invalid: {_one_line(matcher.get_error())}")
        return matcher

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for a request (ValueError naming the problem for a bad or unsupported spec)."""
        spec = params.spec
        with self._lock:
            return GrammarState(self._compiled(*spec).deep_copy(), spec, params.after, self.lltokenizer)

    def fill_masks(self, rows: Sequence[tuple[GrammarState, int, Sequence[int]]], num_positions: int) -> np.ndarray:
        """rows: (state, first position index, draft tokens) -> bitmask [num_positions, words] int32: at the first
        index the mask of the state's next token, at index + i + 1 the mask after drafts[0..i] (until a draft the
        grammar forbids: later positions never choose a token). Unlisted positions allow every token (-1)."""
        bitmask = np.full((num_positions, self.words), -1, np.int32)
        self.lltokenizer  # noqa: B018 (builds the executor too)
        if len(rows) < self.PARALLEL_FROM:
            for s, i, drafts in rows:
                _fill_walking_drafts(s.matcher, bitmask, i, drafts)
        else:
            self._fill_parallel(rows, bitmask)
        for s, i, drafts in rows:
            s.step_mask = bitmask[i: i + len(drafts) + 1].copy()
        return bitmask

    def _fill_parallel(self, rows, bitmask: np.ndarray) -> None:
        """fill_masks through llguidance's executor threads (it walks and rolls back drafts itself)."""
        plain = [(s.matcher, i) for s, i, drafts in rows if not len(drafts)]
        drafted = [(s.matcher, i, [int(d) for d in drafts]) for s, i, drafts in rows if len(drafts)]
        if plain:  # llguidance's draft variant refuses an empty draft list
            fill_next_token_bitmask_par(self._executor, plain, bitmask)
        if drafted:
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, bitmask)

    def draft_masks(self, state: GrammarState, propose_one, num_drafts: int) -> list:
        """Draft tokens proposed one at a time, each under the mask after the drafts before it: propose_one(i,
        allowed [V] bool) -> token. The matcher walks the drafts and rolls them back. -> the drafts."""
        m, drafts, walked = state.matcher, [], 0
        mask = np.empty((1, self.words), np.int32)
        try:
            for i in range(num_drafts):
                fill_next_token_bitmask(m, mask)
                d = propose_one(i, allowed_tokens(mask, self.vocab_size)[0])
                drafts.append(d)
                if i + 1 < num_drafts:
                    if m.is_stopped() or m.validate_tokens([d]) != 1:
                        break
                    m.consume_token(d)
                    walked += 1
        finally:
            m.rollback(walked)
        return drafts


def _fill_walking_drafts(matcher: llguidance.LLMatcher, bitmask: np.ndarray, index: int, drafts) -> None:
    """Row index: the matcher's mask; row index + j + 1: the mask after drafts[0..j], until a draft the grammar
    forbids or a stopped grammar; then the drafts are rolled back (what llguidance's executor does, serially)."""
    fill_next_token_bitmask(matcher, bitmask, index)
    walked = 0
    try:
        for d in drafts:
            if matcher.is_stopped() or matcher.validate_tokens([int(d)]) != 1:
                break
            matcher.consume_token(int(d))
            walked += 1
            fill_next_token_bitmask(matcher, bitmask, index + walked)
    finally:
        matcher.rollback(walked)


def allowed_tokens(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Packed int32 bitmask [..., words] -> bool [..., vocab_size] (bit j of word w: token 32 w + j)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


def apply_token_bitmask(logits, bitmask):
    """Inside the jitted step: logits [..., V] with every token the packed bitmask [..., ceil(V/32)] int32 forbids
    set to -inf (a row of -1 words allows everything). Each logit tests its own bit in its word: the logits are
    viewed as [..., words, 32] (padded with -inf to a multiple of 32 first when V is not one), so the mask is read
    in place by one elementwise pass, never unpacked into a [..., V] array of its own."""
    import jax.numpy as jnp

    v, words = logits.shape[-1], bitmask.shape[-1]
    lead = logits.shape[:-1]
    x = logits if v == 32 * words else jnp.pad(logits, [(0, 0)] * len(lead) + [(0, 32 * words - v)],
                                               constant_values=-jnp.inf)
    x = x.reshape(*lead, words, 32)
    allowed = (bitmask[..., None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    out = jnp.where(allowed != 0, x, -jnp.inf).reshape(*lead, 32 * words)
    return out if v == 32 * words else out[..., :v]


def structured_from_request(fields: dict[str, Any]) -> StructuredOutputsParams:
    """vLLM's request field `structured_outputs` {json | regex | choice | grammar | json_object} -> params."""
    if not isinstance(fields, dict):
        raise ValueError("structured_outputs: must be an object")
    unknown = set(fields) - set(_KINDS)
    if unknown:
        raise ValueError(f"structured_outputs: unsupported field(s) {sorted(unknown)}")
    return StructuredOutputsParams(**{k: v for k, v in fields.items() if k in _KINDS})
