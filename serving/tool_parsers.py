"""Tool calls in the Qwen formats, parsed from the model's output, and the grammar that enforces `tool_choice`
"required" / a named function (`--tool-call-parser hermes | qwen3_xml`).

    hermes:    <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    qwen3_xml: <tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>

Parsing is lenient about whitespace around the tags; a block that does not parse stays in the content (the
client sees what the model wrote rather than nothing). The grammar for a forced call writes the exact format
(llguidance Lark with `%json` for JSON parts), so the output always parses.

Streamed, a call goes out as it is written, as OpenAI and vLLM stream it: its name (and id) once complete, then
its arguments in fragments. Each parser says which prefix of a call's final `arguments` text is already certain
(`partial_call`): hermes arguments are the model's own JSON text, so every character written is final; qwen3_xml
arguments are built parameter by parameter, so a parameter goes out when it closes.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

START, END = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = dataclasses.field(default_factory=new_call_id)

    def openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index} | out


def _lark_str(s: str) -> str:
    return json.dumps(s)


def _lark_json(schema: dict) -> str:
    """A JSON part of a Lark grammar, compact like structured_output's JSON (no free whitespace to loop in)."""
    return f"%json {json.dumps(schema | {'x-guidance': {'whitespace_flexible': False}})}"


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """The end of the JSON value starting at text[i] (an object, array, string or scalar), None if the text ends
    first. Scalars end at the first delimiter after them (so a number at the very end is not complete)."""
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        c = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
            if depth < 0:  # a scalar ended by its container's close
                return j
        elif depth == 0 and c in ", \t\n\r":
            return j
    return None


class HermesToolParser:
    _block = re.compile(re.escape(START) + r"\s*(.*?)\s*" + re.escape(END), re.DOTALL)
    _decoder = json.JSONDecoder()

    def parse_call(self, body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            return ToolCall(obj["name"], args)
        raw = self._members(body).get("arguments", self._members(body).get("parameters"))
        return ToolCall(obj["name"], raw[0] if raw is not None and raw[1] else json.dumps(args))

    def partial_call(self, body: str) -> tuple[str | None, str]:
        """A block's text so far -> (the call's name once written, else None; the certain prefix of its arguments).
        The arguments are the model's JSON text of the "arguments" member (a string member: at the end only)."""
        members = self._members(body)
        name = members.get("name")
        if name is None or not name[1]:
            return None, ""
        args = members.get("arguments", members.get("parameters"))
        if args is None or args[0].startswith('"'):
            return json.loads(name[0]), ""
        return json.loads(name[0]), args[0]

    @classmethod
    def _members(cls, body: str) -> dict[str, tuple[str, bool]]:
        """The top-level members of a JSON object's text, complete or not: key -> (the value's text so far,
        whether it is complete). Stops at the first text that is not a valid prefix."""
        out, i = {}, len(body) - len(body.lstrip())
        if not body[i:].startswith("{"):
            return out
        i += 1
        while True:
            i = _skip_space(body, i)
            if i >= len(body) or body[i] != '"':
                return out
            try:
                key, i = cls._decoder.raw_decode(body, i)
            except json.JSONDecodeError:
                return out
            i = _skip_space(body, i)
            if i >= len(body) or body[i] != ":":
                return out
            i = _skip_space(body, i + 1)
            if i >= len(body):
                return out
            end = _value_end(body, i)
            out[key] = (body[i:end if end is not None else len(body)], end is not None)
            if end is None:
                return out
            i = _skip_space(body, end)
            if i >= len(body) or body[i] != ",":
                return out
            i += 1

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
    _function_open = re.compile(r"\s*<function=([^>\s]+)>")

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
        return ToolCall(name, self._arguments(name, params) + "}")

    def partial_call(self, body: str) -> tuple[str | None, str]:
        """-> (the function's name once its tag closed, the arguments of its closed parameters: "{" and one
        member per closed parameter; the final "}" comes with the block's end, in parse_call)."""
        m = self._function_open.match(body)
        if m is None:
            return None, ""
        return m.group(1), self._arguments(m.group(1), body[m.end():])

    def _arguments(self, function: str, params: str) -> str:
        """'{' and the JSON members of the closed parameters in order, as json.dumps writes them (no closing)."""
        return "{" + ", ".join(f"{json.dumps(p.group(1))}: {json.dumps(self._value(function, p.group(1), p.group(2)))}"
                               for p in self._parameter.finditer(params))

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
    each call goes out while it is written: a first `tool_calls` delta with its index, id, name and the certain
    prefix of its arguments once the name is complete (`partial_call`), then argument fragments, the last one when
    its block closes, so that the fragments add up to the call's `arguments` (`new_calls`). Text after the first
    tag that is not a call goes out as content at the end. A block cut off after its call began (max_tokens) stays
    a call with the arguments sent so far."""

    def __init__(self, parser: HermesToolParser):
        self.parser, self._sent, self._in_calls = parser, 0, False
        self.calls: list[ToolCall] = []  # the calls whose blocks closed, in order (their index is their position)
        self._pos = 0  # where the next block is looked for (after the last closed one)
        self._spans: list[tuple[int, int]] = []  # the text of each call's block, not content
        self._open: tuple[int, str, str, str] | None = None  # the call being streamed: (block start, id, name, sent)

    def feed(self, text: str) -> str:
        """Cumulative text -> the content delta to send now."""
        if self._in_calls:
            return ""
        i = text.find(START)
        if i >= 0:
            self._in_calls = True
            delta, self._sent, self._pos = text[self._sent: i], i, i
            return delta
        keep = next((n for n in range(min(len(START) - 1, len(text)), 0, -1) if START.startswith(text[-n:])), 0)
        delta = text[self._sent: len(text) - keep]
        self._sent = len(text) - keep
        return delta

    def new_calls(self, text: str) -> list[dict]:
        """Cumulative text -> the `tool_calls` deltas to send now (OpenAI's streamed form: the first of a call
        holds its index, id, type and name; the others its index and an arguments fragment)."""
        out: list[dict] = []
        while self._in_calls:
            start = text.find(START, self._pos)
            if start < 0:
                break
            end = text.find(END, start)
            body = text[start + len(START): end if end >= 0 else len(text)]
            if end < 0:
                out += self._stream_open(start, body)
                break
            out += self._close(start, body, end + len(END))
            self._pos = end + len(END)
        return _merged(out)

    def finish(self, text: str) -> tuple[str, list[dict]]:
        """At the end: (the content delta still unsent, the last `tool_calls` deltas)."""
        deltas = self.new_calls(text)
        if self._open is not None:  # cut off inside a streamed call: it stands, with what was sent
            start, call_id, name, sent = self._open
            self.calls.append(ToolCall(name, sent, call_id))
            self._spans.append((start, len(text)))
            self._open = None
        if not self.calls:
            delta, self._sent = text[self._sent:], len(text)
            return delta, deltas
        pieces, pos = [], 0
        for a, b in self._spans:
            pieces.append(text[pos:a])
            pos = b
        content = ("".join(pieces) + text[pos:]).strip()
        sent = text[: self._sent]
        return (content[len(sent):] if content.startswith(sent) else ""), deltas

    def _stream_open(self, start: int, body: str) -> list[dict]:
        name, args = self.parser.partial_call(body)
        if name is None:
            return []
        if self._open is None:
            call_id = new_call_id()
            self._open = (start, call_id, name, args)
            return [self._first(len(self.calls), call_id, name, args)]
        _, call_id, _, sent = self._open
        if len(args) <= len(sent) or not args.startswith(sent):
            return []
        self._open = (start, call_id, name, args)
        return [{"index": len(self.calls), "function": {"arguments": args[len(sent):]}}]

    def _close(self, start: int, body: str, end: int) -> list[dict]:
        call, opened = self.parser.parse_call(body.strip()), self._open
        self._open = None
        if opened is None:
            if call is None:  # not a call: content
                return []
            self.calls.append(call)
            self._spans.append((start, end))
            return [self._first(len(self.calls) - 1, call.id, call.name, call.arguments)]
        _, call_id, name, sent = opened
        args = call.arguments if call is not None and call.arguments.startswith(sent) else sent
        self.calls.append(ToolCall(name, args, call_id))
        self._spans.append((start, end))
        rest = args[len(sent):]
        return [{"index": len(self.calls) - 1, "function": {"arguments": rest}}] if rest else []

    @staticmethod
    def _first(index: int, call_id: str, name: str, args: str) -> dict:
        return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _merged(deltas: list[dict]) -> list[dict]:
    """One entry per call in a chunk: a call's fragments that came out together are joined."""
    out: list[dict] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"]:
            f = out[-1]["function"]
            out[-1] = out[-1] | {"function": f | {"arguments": f["arguments"] + d["function"]["arguments"]}}
        else:
            out.append(d)
    return out
