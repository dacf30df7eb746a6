"""Reasoning separation (`--reasoning-parser qwen3`): the text inside `<think>...</think>` is returned as
`reasoning_content`, the rest as `content`, whole or as stream deltas.

Qwen3 templates open the think block in the prompt when thinking is on (`<think>\\n` after the generation
prompt), so the output may start inside the block without an opening tag; with `enable_thinking: false` the
template writes an empty block and the output is all content. The parser therefore takes whether the output
starts inside the block from the caller (`starts_in_think`, from the rendered prompt), and otherwise treats a
leading `<think>` tag as the opening.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_think(prompt: str) -> bool:
    """Whether the rendered prompt leaves a think block open (the output starts inside it)."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


class Qwen3ReasoningParser:
    """Incremental: feed the cumulative output text, get (reasoning delta, content delta). Text that might be the
    start of a tag is held back until it is decided."""

    def __init__(self, starts_in_think: bool = False):
        self.in_think = starts_in_think
        self.started = starts_in_think  # a leading <think> may still open the block
        self._seen = 0  # characters of the output consumed
        self.reasoning, self.content = "", ""

    def _held_back(self, text: str, tag: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of tag."""
        for n in range(min(len(tag) - 1, len(text)), 0, -1):
            if tag.startswith(text[-n:]):
                return n
        return 0

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        reasoning, content = "", ""
        while True:
            rest = text[self._seen:]
            if not self.started:
                stripped = rest.lstrip()
                if stripped.startswith(OPEN):
                    self._seen += len(rest) - len(stripped) + len(OPEN)
                    self.in_think = self.started = True
                    continue
                if not final and OPEN.startswith(stripped):  # could still become <think>
                    break
                self.started = True
                continue
            tag = CLOSE if self.in_think else None
            if tag is None:
                content += rest
                self._seen = len(text)
                break
            i = rest.find(tag)
            if i >= 0:
                reasoning += rest[:i]
                self._seen += i + len(tag)
                self.in_think = False
                continue
            keep = 0 if final else self._held_back(rest, tag)
            reasoning += rest[: len(rest) - keep]
            self._seen += len(rest) - keep
            break
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def split(self, text: str) -> tuple[str, str]:
        """The whole output -> (reasoning_content, content)."""
        self.feed(text, final=True)
        return self.reasoning, self.content


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}
