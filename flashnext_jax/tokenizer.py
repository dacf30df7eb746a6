"""Tokenizer from a checkpoint directory (HF `tokenizers`), incremental detokenisation, jinja2 chat template."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Sequence

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer


class TokenizerError(ValueError):
    pass


class Tokenizer:
    def __init__(self, tok: HFTokenizer, eos_token_id: int | None = None, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None):
        self.tok = tok
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        f = path / "tokenizer.json"
        if not f.is_file():
            raise TokenizerError(f"{path}: no tokenizer.json")
        tok = HFTokenizer.from_file(str(f))
        cfg = {}
        if (path / "tokenizer_config.json").is_file():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        template = None
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        elif isinstance(cfg.get("chat_template"), str):
            template = cfg["chat_template"]

        def tok_str(v):
            return v.get("content") if isinstance(v, dict) else v

        eos, bos = tok_str(cfg.get("eos_token")), tok_str(cfg.get("bos_token"))
        eos_id = tok.token_to_id(eos) if eos else None
        if eos_id is None and (path / "generation_config.json").is_file():
            g = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
            eos_id = g[0] if isinstance(g, list) else g
        return cls(tok, eos_id, template, bos, eos)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """spaces_between_special_tokens=False (with special tokens kept): an added token right after another is
        its own text, without the space the decoder may put before it (vLLM's detokenizer: the texts of adjacent
        special tokens are joined directly)."""
        ids = [int(t) for t in ids]
        if skip_special_tokens or spaces_between_special_tokens:
            return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        added = self.added_tokens
        cuts = [i for i in range(1, len(ids)) if ids[i] in added and ids[i - 1] in added]
        return "".join(self.tok.decode(ids[a:b], skip_special_tokens=False)
                       for a, b in zip([0, *cuts], [*cuts, len(ids)]))

    @functools.cached_property
    def added_tokens(self) -> frozenset[int]:
        """The ids of the tokenizer's added tokens (the special ones among them)."""
        return frozenset(self.tok.get_added_tokens_decoder())

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs):
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template (chat_template.jinja / tokenizer_config.json)")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(msg):
            raise TokenizerError(f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                    ensure_ascii=ensure_ascii)
        text = env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "", **kwargs)
        return self.encode(text) if tokenize else text


class IncrementalDetokenizer:
    """vLLM-style prefix/read offsets: emit text only once it is stable (no partial UTF-8 sequence)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer, self.skip, self.spaces = tokenizer, skip_special_tokens, spaces_between_special_tokens
        self.prefix_offset = self.read_offset = 0
        self.text = ""

    def decode(self, ids: Sequence[int]) -> str:
        """ids as text under this detokenizer's options."""
        return self.tokenizer.decode(ids, self.skip, self.spaces)

    def update(self, ids: Sequence[int]) -> str:
        """All output ids so far -> the newly stable text (also appended to `self.text`)."""
        dec = lambda a, b: self.decode(ids[a:b])  # noqa: E731
        prefix = dec(self.prefix_offset, self.read_offset)
        full = dec(self.prefix_offset, len(ids))
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            self.text += delta
            return delta
        return ""


def toy_tokenizer(vocab_size: int = 64, eos_token_id: int = 0) -> Tokenizer:
    """A word-level tokenizer for the toy model: id 0 is <eos>, the others are short words."""
    from tokenizers import decoders, models, pre_tokenizers

    words = ["<eos>" if i == eos_token_id else f"w{i}" for i in range(vocab_size)]
    tok = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(["<eos>"])
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}w2 {% endif %}")
    return Tokenizer(tok, eos_token_id, template, None, "<eos>")
