"""Tool calls in the Qwen formats, parsed from the model's output, and the grammar that enforces `tool_choice`
"required" / a named function (`--tool-call-parser hermes | qwen3_xml`).

    hermes:    <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    qwen3_xml: <tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>

Parsing is lenient about whitespace around the tags; a block that does not parse stays in the content (the
client sees what the model wrote rather than nothing). The grammar for a forced call writes the exact format
(llguidance Lark with `%json` for JSON parts), so the output always parses.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

START, END = "<tool_call>", "</tool_call>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = dataclasses.field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index} | out


def _lark_str(s: str) -> str:
    return json.dumps(s)


def _lark_json(schema: dict) -> str:
    """A JSON part of a Lark grammar, compact like structured_output's JSON (no free whitespace to loop in)."""
    return f"%json {json.dumps(schema | {'x-guidance': {'whitespace_flexible': False}})}"


class HermesToolParser:
    _block = re.compile(re.escape(START) + r"\s*(.*?)\s*" + re.escape(END), re.DOTALL)

    def parse_call(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))

    def call_grammar(self, tool: dict) -> str:
        f = tool["function"]
        schema = {"type": "object", "properties": {"name": {"const": f["name"]},
                                                   "arguments": f.get("parameters") or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False}
        return f"{_lark_str(START + chr(10))} {_lark_json(schema)} {_lark_str(chr(10) + END)}"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The whole output -> (content outside parsed blocks, tool calls in order)."""
        calls, content, pos = [], [], 0
        for m in self._block.finditer(text):
            call = self.parse_call(m.group(1))
            if call is None:
                continue
            content.append(text[pos: m.start()])
            calls.append(call)
            pos = m.end()
        content.append(text[pos:])
        return "".join(content).strip() if calls else text, calls


class Qwen3XmlToolParser(HermesToolParser):
    _function = re.compile(r"<function=([^>\s]+)>\s*(.*?)\s*</function>", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def __init__(self, tools: list[dict] | None = None):
        self.schemas = {t["function"]["name"]: (t["function"].get("parameters") or {}).get("properties", {})
                        for t in tools or []}

    def _value(self, function: str, name: str, raw: str) -> Any:
        """A parameter's text as the JSON value its schema types it as (strings stay strings)."""
        if self.schemas.get(function, {}).get(name, {}).get("type") == "string":
            return raw
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw

    def parse_call(self, body: str) -> ToolCall | None:
        m = self._function.fullmatch(body.strip())
        if m is None:
            return None
        name, params = m.group(1), m.group(2)
        args = {p.group(1): self._value(name, p.group(1), p.group(2)) for p in self._parameter.finditer(params)}
        return ToolCall(name, json.dumps(args))

    def call_grammar(self, tool: dict) -> str:
        """The function's required parameters in schema order (optional ones are left out of a forced call)."""
        f = tool["function"]
        schema = f.get("parameters") or {}
        parts = [_lark_str(f"{START}\n<function={f['name']}>\n")]
        for p in schema.get("required", []):
            sub = schema.get("properties", {}).get(p, {})
            if "enum" in sub and all(isinstance(v, str) for v in sub["enum"]):  # written bare, like any string
                value = "(" + " | ".join(_lark_str(v) for v in sub["enum"]) + ")"
            elif sub.get("type", "string") == "string":  # bare text up to the closing tag, maxLength kept
                value = f"/[^<\\n]{{1,{sub['maxLength']}}}/" if "maxLength" in sub else r"/[^<\n]+/"
            else:
                value = _lark_json(sub)
            parts += [_lark_str(f"<parameter={p}>\n"), value, _lark_str("\n</parameter>\n")]
        parts.append(_lark_str(f"</function>\n{END}"))
        return " ".join(parts)


def parser_for(name: str, tools: list[dict] | None) -> HermesToolParser:
    if name == "hermes":
        return HermesToolParser()
    if name == "qwen3_xml":
        return Qwen3XmlToolParser(tools)
    raise ValueError(f"tool call parser {name!r} not in {sorted(TOOL_PARSERS)}")


TOOL_PARSERS = ("hermes", "qwen3_xml")


def forced_call_grammar(parser: HermesToolParser, tools: list[dict], tool_choice: Any, parallel: bool) -> str | None:
    """The Lark grammar of tool_choice "required" (one of the tools; several calls if parallel) or a named
    function; None for "auto" / "none" (no grammar). ValueError for a name not among the tools."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        chosen = tools
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice: function {name!r} is not among the request's tools")
    else:
        raise ValueError("tool_choice: must be 'auto', 'none', 'required' or {'type': 'function', 'function': "
                         "{'name': ...}}")
    rules = "\n".join(f"call{i}: {parser.call_grammar(t)}" for i, t in enumerate(chosen))
    call = " | ".join(f"call{i}" for i in range(len(chosen)))
    start = "start: call (\"\\n\" call)*" if parallel and tool_choice == "required" else "start: call"
    return f"{start}\ncall: {call}\n{rules}\n"


def check_tools(tools: Any) -> list[dict]:
    """The request's `tools`: OpenAI function tools with a name (and a JSON schema for the parameters)."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("tools: must be a non-empty list")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"tools[{i}]: must be {{'type': 'function', 'function': {{'name': ..., "
                             f"'parameters': {{...}}}}}}")
        if "parameters" in f and not isinstance(f["parameters"], dict):
            raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema object")
    return tools


class ToolCallStream:
    """Streaming: content before the first <tool_call> goes out as it comes (a possible tag prefix held back);
    each call goes out as a `tool_calls` delta as soon as its block closes (`new_calls`), with the index and id it
    keeps; text after the first tag that is not a parsed call goes out as content at the end."""

    def __init__(self, parser: HermesToolParser):
        self.parser, self._sent, self._in_calls = parser, 0, False
        self.calls: list[ToolCall] = []  # sent so far, in order (their index is their position)

    def feed(self, text: str) -> str:
        """Cumulative text -> the content delta to send now."""
        if self._in_calls:
            return ""
        i = text.find(START)
        if i >= 0:
            self._in_calls = True
            delta, self._sent = text[self._sent: i], i
            return delta
        keep = next((n for n in range(min(len(START) - 1, len(text)), 0, -1) if START.startswith(text[-n:])), 0)
        delta = text[self._sent: len(text) - keep]
        self._sent = len(text) - keep
        return delta

    def new_calls(self, text: str) -> list[tuple[int, ToolCall]]:
        """Cumulative text -> (index, call) of each call whose block closed since the last call (a closed block
        cannot change as text is added, so the calls of a prefix are the first calls of the whole)."""
        end = text.rfind(END)
        if not self._in_calls or end < 0:
            return []
        return self._take(self.parser.parse(text[: end + len(END)])[1])

    def finish(self, text: str) -> tuple[str, list[tuple[int, ToolCall]]]:
        """At the end: (the content delta still unsent, (index, call) of the calls not sent yet). A block that did
        not parse is sent as content."""
        content, calls = self.parser.parse(text)
        if not calls:
            delta, self._sent = text[self._sent:], len(text)
            return delta, []
        sent = text[: self._sent]
        return (content[len(sent):] if content.startswith(sent) else ""), self._take(calls)

    def _take(self, calls: list[ToolCall]) -> list[tuple[int, ToolCall]]:
        fresh = calls[len(self.calls):]
        self.calls += fresh
        return list(enumerate(fresh, start=len(self.calls) - len(fresh)))
