"""Chat requests with tools and reasoning: the prompt (tools and chat_template_kwargs through the checkpoint's
chat template), the grammar a forced tool choice needs, and the assistant message or stream deltas
(`content`, `reasoning_content`, `tool_calls`, finish_reason "tool_calls") built from the output text.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from flashnext_jax.structured_output import StructuredOutputsParams

from .reasoning import CLOSE, REASONING_PARSERS, prompt_opens_think
from .tool_parsers import ToolCallStream, check_tools, forced_call_grammar, parser_for


def grammar_after_thinking(params, shaper: "ChatShaper"):
    """A grammar of a chat whose prompt leaves a think block open applies only after `</think>`: the matcher
    stays dormant (no masks) until the output holds it (structured_output.GrammarState)."""
    so = params.structured_outputs
    if so is None or shaper.reasoning is None or not shaper.reasoning.in_think:
        return params
    return dataclasses.replace(params, structured_outputs=dataclasses.replace(so, after=CLOSE))


class ChatShaper:
    """One chat request's output shaping. `tool_parser` None: tool calls are not parsed (no tools, or
    tool_choice "none"); `reasoning` None: no reasoning separation."""

    def __init__(self, tool_parser=None, reasoning=None):
        self.tool_parser, self.reasoning = tool_parser, reasoning
        self._stream = ToolCallStream(tool_parser) if tool_parser is not None else None
        self._content = ""  # content so far (after reasoning separation), cumulative

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        """-> (reasoning delta, cumulative content)."""
        if self.reasoning is None:
            return "", text
        reasoning_delta, _ = self.reasoning.feed(text, final=final)
        return reasoning_delta, self.reasoning.content

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        reasoning_delta, content = self._split(text, final=True)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning.reasoning or None
        if self.tool_parser is not None:
            content, calls = self.tool_parser.parse(content)
            if calls:
                msg["content"] = content or None
                msg["tool_calls"] = [c.openai() for c in calls]
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return msg, finish_reason

    def deltas(self, text: str, finished: bool, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """Cumulative output text -> the stream deltas to send now (and the finish reason at the end)."""
        reasoning_delta, content = self._split(text, final=finished)
        out = []
        if reasoning_delta:
            out.append({"reasoning_content": reasoning_delta})
        if self._stream is None:
            delta, self._content = content[len(self._content):], content
            if delta:
                out.append({"content": delta})
            return out, finish_reason
        delta = self._stream.feed(content)
        if finished:
            rest, calls = self._stream.finish(content)
            delta += rest
        else:
            calls = self._stream.new_calls(content)
        if delta:
            out.append({"content": delta})
        if calls:  # each call while it is written: its name, then fragments of its arguments
            out.append({"tool_calls": calls})
        if finished and self._stream.calls:
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return out, finish_reason


def prepare_chat(body, render: Callable[[dict], str], tool_call_parser: str | None, reasoning_parser: str | None
                 ) -> tuple[str, ChatShaper, StructuredOutputsParams | None]:
    """-> (rendered prompt, the output shaper, the grammar of a forced tool choice or None). `render(kwargs)`
    renders the request's messages with the chat template and these extra template variables."""
    kwargs = dict(body.chat_template_kwargs or {})
    tools = None
    if body.tools is not None:
        if tool_call_parser is None:
            raise ValueError("tools: this server was started without --tool-call-parser")
        tools = check_tools(body.tools)
        kwargs["tools"] = tools
    elif body.tool_choice not in (None, "none", "auto"):
        raise ValueError("tool_choice: needs tools")
    prompt = render(kwargs)
    reasoning = None
    if reasoning_parser is not None:
        reasoning = REASONING_PARSERS[reasoning_parser](starts_in_think=prompt_opens_think(prompt))
    parser = grammar = None
    if tools is not None and body.tool_choice != "none":
        parser = parser_for(tool_call_parser, tools)
        lark = forced_call_grammar(parser, tools, body.tool_choice, body.parallel_tool_calls)
        if lark is not None:
            if body.response_format is not None or body.structured_outputs is not None:
                raise ValueError("tool_choice: a forced tool call cannot be combined with response_format / "
                                 "structured_outputs")
            grammar = StructuredOutputsParams(grammar=lark)
    return prompt, ChatShaper(parser, reasoning), grammar
