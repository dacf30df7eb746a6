"""A request's token restrictions besides a grammar: vLLM's `min_tokens`, `allowed_token_ids` and `bad_words`, as
per-column packed token masks.

One `TokenBans` per restricted request (`Engine.add_request`). Before a step the engine asks it for the mask of
every column that chooses a token (`column_masks`): column i of a row holds output index len(output) + i, preceded
by the committed output and the row's drafts before it, so the ban is exact per output token also under MTP:

* min_tokens: EOS (even with ignore_eos, as vLLM) and the request's stop_token_ids are banned at output indices
  < min_tokens (vLLM's MinTokensLogitsProcessor);
* allowed_token_ids: every other token is banned;
* bad_words (as token sequences, `bad_words_token_ids`): the last token of a bad word is banned where the output
  tokens before it end with the word's other tokens (vLLM's bad-words processor: output tokens only, the prompt
  does not count).

The masks are the grammar's packed format ([columns, ceil(V/32)] int32, bit j of word w: token 32 w + j), so the
engine ANDs them into a constrained row's grammar masks and the sampler applies both at once
(structured_output.apply_token_bitmask); the host-sampled paths read the same rows (structured_output.allowed_tokens).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def bad_words_token_ids(bad_words: Sequence[str], encode) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of bad words (SamplingParams.update_from_tokenizer): each word, stripped of leading
    spaces, as encoded alone, and also with one leading space where that gives another first token and as many
    tokens (the word in the middle of a text); encode(text) -> ids without special tokens."""
    out: list[tuple[int, ...]] = []
    for word in bad_words:
        for prefix in ("", " "):
            ids = tuple(int(t) for t in encode(prefix + word.lstrip()))
            if not ids:
                raise ValueError(f"bad_words: {word!r} encodes to no tokens")
            if not prefix or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    return tuple(out)


class TokenBans:
    """A request's restrictions as token masks (see the module docstring); `of` gives None for a request without
    any."""

    def __init__(self, vocab_size: int, min_tokens: int = 0, min_tokens_ids: Sequence[int] = (),
                 allowed_token_ids: Sequence[int] | None = None, bad_words: Sequence[Sequence[int]] = ()):
        self.vocab_size, self.words = vocab_size, (vocab_size + 31) // 32
        self.min_tokens, self.min_tokens_ids = min_tokens, sorted(set(min_tokens_ids))
        keep = np.ones(32 * self.words, bool)  # what allowed_token_ids leaves (every token without it)
        if allowed_token_ids is not None:
            keep[:] = False
            keep[list(allowed_token_ids)] = True
        self.base = np.packbits(keep, bitorder="little").view(np.uint32)
        self.restricts_all = allowed_token_ids is not None
        self.bad_words = [tuple(w) for w in bad_words]
        self.longest_prefix = max((len(w) for w in self.bad_words), default=1) - 1

    @staticmethod
    def applies(params) -> bool:
        """Whether SamplingParams `params` restricts any token (so its rows take token masks)."""
        return bool(params.min_tokens or params.allowed_token_ids is not None or params.bad_words_token_ids)

    @classmethod
    def of(cls, params, vocab_size: int, eos_token_id: int | None) -> "TokenBans | None":
        """The restrictions of SamplingParams `params` (None when it has none)."""
        if not cls.applies(params):
            return None
        words = params.bad_words_token_ids or ()
        stops = list(params.stop_token_ids) + ([] if eos_token_id is None else [eos_token_id])  # (with ignore_eos too,
        # as vLLM: its min-tokens processor bans every stop token id, the model's EOS included)
        return cls(vocab_size, params.min_tokens, stops, params.allowed_token_ids, words)

    def needed(self, index: int) -> bool:
        """Whether output index `index` can have a ban (later ones cannot when this one cannot)."""
        return self.restricts_all or bool(self.bad_words) or (index < self.min_tokens and bool(self.min_tokens_ids))

    def banned(self, index: int, before: Sequence[int]) -> list[int]:
        """The tokens banned at output index `index` after the output tokens `before` (its last
        `longest_prefix` are enough), besides those allowed_token_ids leaves out."""
        out = list(self.min_tokens_ids) if index < self.min_tokens else []
        for w in self.bad_words:
            n = len(w) - 1
            if n <= len(before) and (n == 0 or tuple(before[len(before) - n:]) == w[:-1]):
                out.append(w[-1])
        return out

    def mask(self, index: int, before: Sequence[int]) -> np.ndarray:
        """The packed mask [words] int32 of output index `index` after the output tokens `before`."""
        mask = self.base.copy()
        for t in self.banned(index, before):
            mask[t >> 5] &= ~np.uint32(1 << (t & 31))
        return mask.view(np.int32)

    def _before(self, output: Sequence[int], drafts: Sequence[int]) -> list[int]:
        """The output tokens the bad words look at: the last `longest_prefix` of output + drafts."""
        if not self.longest_prefix:
            return []
        return list(output[max(0, len(output) - self.longest_prefix):]) + [int(d) for d in drafts]

    def column_masks(self, output: Sequence[int], drafts: Sequence[int]) -> np.ndarray | None:
        """The packed masks [len(drafts) + 1, words] int32 of a row's token-choosing columns: column i chooses output
        index len(output) + i after output + drafts[:i]. None when no column can ban anything."""
        n = len(output)
        if not self.needed(n):
            return None
        return np.stack([self.mask(n + i, self._before(output, drafts[:i])) for i in range(len(drafts) + 1)])

    def allowed_after(self, output: Sequence[int], drafts: Sequence[int]) -> np.ndarray:
        """bool [V]: the tokens output index len(output) + len(drafts) may take after output + drafts (a host-drawn
        draft's restriction)."""
        from .structured_output import allowed_tokens

        return allowed_tokens(self.mask(len(output) + len(drafts), self._before(output, drafts)), self.vocab_size)
