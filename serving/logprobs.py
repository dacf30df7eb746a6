"""Output-token logprobs in the OpenAI formats, each token with its raw bytes.

A byte-level BPE token can be part of a UTF-8 character (an emoji split over two tokens): decoded alone it is
U+FFFD. Like OpenAI, such a token's string is written `bytes:\\xe2\\x80` (its bytes escaped), so two different
partial tokens never share one `top_logprobs` key, and `bytes` carries the token's own bytes, not U+FFFD's.
"""

from __future__ import annotations

import functools
import re


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character of each byte (the ByteLevel pre-tokenizer's alphabet), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenText:
    """A token id's raw bytes and its display string, from the model's tokenizer (token ids as strings without
    one)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "tok", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"

    @functools.lru_cache(maxsize=65536)
    def token_bytes(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            return str(token_id).encode()
        piece = self.tokenizer.tok.id_to_token(token_id)
        if piece is not None and self.byte_level:
            alphabet = _byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        if piece is not None and _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(_BYTE_FALLBACK.fullmatch(piece).group(1), 16)])
        return self.tokenizer.decode([token_id]).encode("utf-8")

    def text(self, token_id: int) -> str:
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class LogprobFormat:
    """An output's TokenLogprobs as the OpenAI APIs write them. `offset` carries the completions API's text_offset
    across stream chunks."""

    def __init__(self, tokenizer, offset: int = 0):
        self.tokens, self.offset = TokenText(tokenizer), offset

    def completion(self, lps) -> dict | None:
        if lps is None:
            return None
        text = self.tokens.text
        tokens = [text(t.token_id) for t in lps]
        offsets = []
        for tok in tokens:
            offsets.append(self.offset)
            self.offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [t.logprob for t in lps],
                "top_logprobs": [{text(i): lp for i, lp in t.top} for t in lps], "text_offset": offsets}

    def prompt(self, ids, lps) -> dict:
        """The prompt's tokens in the completions format (echo): `lps` from RequestOutput.prompt_logprobs, whose
        first entry is None (the first token has no context), as OpenAI and vLLM write it."""
        text = self.tokens.text
        tokens = [text(t) for t in ids]
        offsets = []
        for tok in tokens:
            offsets.append(self.offset)
            self.offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
                "top_logprobs": [None if lp is None else {text(i): x for i, x in lp.top} for lp in lps],
                "text_offset": offsets}

    @staticmethod
    def joined(first: dict, then: dict | None) -> dict:
        return first if then is None else {k: first[k] + then[k] for k in first}

    def chat(self, lps) -> dict | None:
        if lps is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            return {"token": self.tokens.text(token_id), "logprob": logprob,
                    "bytes": list(self.tokens.token_bytes(token_id))}
        return {"content": [entry(t.token_id, t.logprob) | {"top_logprobs": [entry(i, lp) for i, lp in t.top]}
                            for t in lps]}
