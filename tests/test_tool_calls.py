"""Tool calls (hermes, qwen3_xml) and reasoning separation (qwen3): the parsers on known texts, the forced-call
grammars under llguidance, and the official `openai` client against uvicorn serving the demo model with a
Qwen3-style chat template (tools in the system prompt, `<think>` opened when thinking is on)."""

import json

import jsonschema
import llguidance
import openai
import pytest
from fastapi import FastAPI

import flashnext_jax as fj
from flashnext_jax.tokenizer import Tokenizer
from serving.app import create_app
from serving.chat_features import ChatShaper
from serving.reasoning import Qwen3ReasoningParser
from serving.tool_parsers import (HermesToolParser, Qwen3XmlToolParser, ToolCallStream, forced_call_grammar,
                                  parser_for)
from serving_harness import uvicorn_server

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

# a Qwen3-style template, cut short (the demo tokenizer spends a token per byte or two): tools in a system
# section, hermes-style calls in <tool_call> tags, thinking opened unless enable_thinking is false
TEMPLATE = """{%- if tools %}<|im_start|>system
{%- if messages[0]['role'] == 'system' %}
{{ messages[0]['content'] }}
{%- endif %}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant
{%- for c in m['tool_calls'] %}
<tool_call>
{"name": "{{ c['function']['name'] }}", "arguments": {{ c['function']['arguments'] }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ m['content'] }}
</tool_response><|im_end|>
{% elif not (tools and m['role'] == 'system') %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""


# ------------------------------------------------------------------------------------------------ the parsers

def test_hermes_parses_calls_and_keeps_the_content():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n' \
           '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    content, calls = HermesToolParser().parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC"})]


def test_a_block_that_does_not_parse_stays_content():
    text = "<tool_call>\n{not json}\n</tool_call>"
    assert HermesToolParser().parse(text) == (text, [])


def test_qwen3_xml_types_parameters_by_their_schema():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n" \
           "</parameter>\n</function>\n</tool_call>"
    content, calls = Qwen3XmlToolParser(TOOLS).parse(text)
    assert content == "" and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "New York", "days": 3}


@pytest.mark.parametrize("name", ["hermes", "qwen3_xml"])
def test_forced_grammars_accept_a_valid_call_and_parse_back(name):
    lltok = llguidance.LLTokenizer(Tokenizer.from_dir(fj.DEMO_MODEL).tok.to_str(), n_vocab=512, eos_token=509)
    parser = parser_for(name, TOOLS)
    call = ('<tool_call>\n{"name":"get_time","arguments":{"zone":"CET"}}\n</tool_call>' if name == "hermes" else
            "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>")
    for choice, ok in (("required", True), ({"type": "function", "function": {"name": "get_time"}}, True),
                       ({"type": "function", "function": {"name": "get_weather"}}, False)):
        grammar = llguidance.grammar_from("lark", forced_call_grammar(parser, TOOLS, choice, parallel=False))
        matcher = llguidance.LLMatcher(lltok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        tokens = lltok.tokenize_str(call)
        assert (matcher.validate_tokens(tokens) == len(tokens)) == ok, choice
    content, calls = parser.parse(call)
    assert calls and calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"zone": "CET"}
    with pytest.raises(ValueError, match="not among"):
        forced_call_grammar(parser, TOOLS, {"type": "function", "function": {"name": "nope"}}, False)


def _stream(stream, text):
    """Feed `text` one character at a time -> (content sent, every tool_calls delta with the length of text
    that produced it)."""
    sent, deltas = "", []
    for i in range(1, len(text) + 1):
        sent += stream.feed(text[:i])
        deltas += [(i, d) for d in stream.new_calls(text[:i])]
    rest, last = stream.finish(text)
    return sent + rest, deltas + [(len(text), d) for d in last]


def _accumulate(deltas):
    """What a client builds from the deltas (by index): [(id, name, arguments)] in index order."""
    calls: dict = {}
    for _, d in deltas:
        c = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in d:
            assert c["id"] is None, "a call's id and name come once"
            c["id"], c["name"] = d["id"], d["function"]["name"]
        c["arguments"] += d["function"]["arguments"]
    return [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]


def test_tool_call_stream_sends_each_call_while_it_is_written():
    first = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC", "hours": [1, 2]}}\n</tool_call>'
    second = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    text = "Sure " + first + "\n" + second
    stream = ToolCallStream(HermesToolParser())
    content, deltas = _stream(stream, text)
    assert content.strip() == "Sure" and "<" not in content
    whole = HermesToolParser().parse(text)[1]
    assert [(n, a) for _, n, a in _accumulate(deltas)] == [(c.name, c.arguments) for c in whole]
    assert [c.id for c in stream.calls] == [i for i, _, _ in _accumulate(deltas)]  # ids kept, never re-drawn
    assert json.loads(stream.calls[0].arguments) == {"zone": "UTC", "hours": [1, 2]}
    # streamed while written: the name goes out once complete, the arguments in several fragments, all before
    # the block closes but the last
    header = next(i for i, d in deltas if d["index"] == 0)
    assert header == text.index('"get_time"') + len('"get_time"')
    assert sum(d["index"] == 0 for _, d in deltas) > 10
    # cut off inside a call: the call stands with what was written of its arguments; before its name: content
    stream = ToolCallStream(HermesToolParser())
    content, deltas = _stream(stream, "Hi " + first[:-30])
    assert content == "Hi " and _accumulate(deltas) == [(stream.calls[0].id, "get_time",
                                                         first[first.index('{"zone"'):-30])]
    stream = ToolCallStream(HermesToolParser())
    content, deltas = _stream(stream, "Hi " + first[:20])
    assert deltas == [] and stream.calls == [] and content == "Hi " + first[:20]
    # a block that does not parse and never named a call stays content
    stream = ToolCallStream(HermesToolParser())
    content, deltas = _stream(stream, "<tool_call>\n{not json}\n</tool_call>")
    assert deltas == [] and content == "<tool_call>\n{not json}\n</tool_call>"


def test_qwen3_xml_stream_sends_each_parameter_as_it_closes():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n" \
           "</parameter>\n</function>\n</tool_call>"
    stream = ToolCallStream(Qwen3XmlToolParser(TOOLS))
    content, deltas = _stream(stream, text)
    assert content == "" and _accumulate(deltas) == [(stream.calls[0].id, "get_weather", '{"city": "New York", '
                                                                                           '"days": 3}')]
    assert [d["function"]["arguments"] for _, d in deltas] == ["{", '"city": "New York"', ', "days": 3', "}"]
    assert Qwen3XmlToolParser(TOOLS).parse(text)[1][0].arguments == stream.calls[0].arguments


@pytest.mark.parametrize("starts_in_think, text, reasoning, content", [
    (True, "I should greet.\n</think>\n\nHello!", "I should greet.\n", "\n\nHello!"),
    (False, "<think>hmm</think>Hi", "hmm", "Hi"),
    (False, "No thinking here", "", "No thinking here"),
    (True, "still thinking", "still thinking", "")])
def test_reasoning_split_whole_and_streamed_agree(starts_in_think, text, reasoning, content):
    assert Qwen3ReasoningParser(starts_in_think).split(text) == (reasoning, content)
    p, r, c = Qwen3ReasoningParser(starts_in_think), "", ""
    for i in range(1, len(text) + 1):
        dr, dc = p.feed(text[:i], final=i == len(text))
        r, c = r + dr, c + dc
    assert (r, c) == (reasoning, content)


def test_chat_shaper_streams_reasoning_then_tool_calls():
    shaper = ChatShaper(HermesToolParser(), Qwen3ReasoningParser(True))
    text = 'think</think>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    got = []
    for i in range(1, len(text) + 1):
        deltas, finish = shaper.deltas(text[:i], i == len(text), "stop" if i == len(text) else None)
        got += deltas
    assert "".join(d.get("reasoning_content", "") for d in got) == "think"
    calls = _accumulate([(0, tc) for d in got for tc in d.get("tool_calls", [])])
    assert finish == "tool_calls" and [(name, json.loads(args)) for _, name, args in calls] == [
        ("get_time", {"zone": "UTC"})]


# ----------------------------------------------------------------------------------- through the openai client

SHAPES = dict(max_model_len=512, page_size=512, block_size=512, min_batch_bucket=2, min_token_bucket=8,
              min_pool_capacity=(2, 4, 4), compile_ahead=False, max_num_seqs=2, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def base_url():
    tok = Tokenizer.from_dir(fj.DEMO_MODEL)
    tok.chat_template = TEMPLATE
    llm = fj.LLM(None, dtype="float32", tokenizer=tok, **SHAPES)
    root = FastAPI()
    for parser in ("hermes", "qwen3_xml"):  # one engine, one event loop: the two parsers side by side
        root.mount(f"/{parser}", create_app(llm, "demo_model", generation_defaults={"max_tokens": 96},
                                            tool_call_parser=parser, reasoning_parser="qwen3"))
    with uvicorn_server(root) as base:
        yield base


def _client(base_url, parser):
    return openai.OpenAI(base_url=f"{base_url}/{parser}/v1", api_key="none", max_retries=0)


NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
ASK = [{"role": "user", "content": "weather in Oslo?"}]


def _check_call(name, arguments, expected_name=None):
    assert name in SCHEMAS and (expected_name is None or name == expected_name)
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


NAMED = {"type": "function", "function": {"name": "get_weather"}}
SLOW = pytest.mark.slow  # a minute each on a loaded 2-core CPU: the default run keeps one of each feature


@pytest.mark.parametrize("parser, choice", [("hermes", "required"), ("qwen3_xml", NAMED),
                                            pytest.param("hermes", NAMED, marks=SLOW),
                                            pytest.param("qwen3_xml", "required", marks=SLOW)])
def test_forced_tool_calls_non_streamed(base_url, parser, choice):
    r = _client(base_url, parser).chat.completions.create(
        model="demo_model", messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
        temperature=0, max_tokens=96, extra_body=NO_THINK)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id
    _check_call(call.function.name, call.function.arguments, None if choice == "required" else "get_weather")


@pytest.mark.parametrize("parser", [pytest.param("hermes", marks=SLOW), "qwen3_xml"])
def test_forced_tool_calls_streamed(base_url, parser):
    chunks = list(_client(base_url, parser).chat.completions.create(
        model="demo_model", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=0.8, seed=4, max_tokens=96, stream=True, extra_body=NO_THINK))
    deltas = [(0, tc.model_dump(exclude_none=True)) for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    calls = _accumulate([(i, d | {"function": {"arguments": "", **d.get("function", {})}}) for i, d in deltas])
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert len(deltas) > 1  # the call streamed in pieces, not sent whole at its end
    _check_call(calls[0][1], calls[0][2])


def test_tool_choice_none_and_unknown_function(base_url):
    client = _client(base_url, "hermes")
    r = client.chat.completions.create(model="demo_model", messages=ASK, tools=TOOLS, tool_choice="none",
                                       max_tokens=4, temperature=0, extra_body=NO_THINK)
    assert r.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError, match="not among"):
        client.chat.completions.create(model="demo_model", messages=ASK, tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


def test_reasoning_is_separated_streamed_and_not(base_url):
    client = _client(base_url, "hermes")
    kw = dict(model="demo_model", messages=ASK, temperature=0, max_tokens=12)
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    reasoning = message.model_extra.get("reasoning_content")
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed_reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                                 for c in chunks)
    streamed_content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (streamed_reasoning, streamed_content) == (reasoning or "", message.content or "")
    # the prompt opened <think>: without a </think> in 12 random tokens everything is reasoning
    text = (reasoning or "") + (message.content or "")
    assert reasoning and ("</think>" in text or not message.content) or "</think>" in text


def test_a_grammar_applies_after_the_think_block(base_url):
    """Thinking on: the JSON constraint waits for </think>; the think block itself is free text (the random model
    may never close it: then the whole output is reasoning and nothing was forced)."""
    r = _client(base_url, "hermes").chat.completions.create(
        model="demo_model", messages=ASK, temperature=0, max_tokens=24, response_format={"type": "json_object"})
    message = r.choices[0].message
    assert message.model_extra.get("reasoning_content") is not None or message.content is not None
    if message.content and r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(message.content.strip()), dict)
    # with thinking off the grammar applies from the first token
    r = _client(base_url, "hermes").chat.completions.create(
        model="demo_model", messages=ASK, temperature=0, max_tokens=48, response_format={"type": "json_object"},
        extra_body=NO_THINK)
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].message.content.startswith("{")


def test_serve_flags_reach_create_app(monkeypatch):
    """`serve --tool-call-parser/--reasoning-parser` are parsed (bad values rejected by argparse) and passed on."""
    import argparse

    import serving.app
    import serving.cli
    import uvicorn

    parser = argparse.ArgumentParser()
    serving.cli.add_serve_parser(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tool-call-parser", "mistral"])
    args = parser.parse_args(["serve", "--tool-call-parser", "qwen3_xml", "--reasoning-parser", "qwen3"])
    seen = {}
    import flashnext_jax.llm
    monkeypatch.setattr(flashnext_jax.llm, "LLM", lambda *a, **k: None)  # the flags, not the engine
    monkeypatch.setattr(serving.cli, "configure_compilation_cache", lambda option: None)
    monkeypatch.setattr(serving.app, "create_app", lambda llm, name, **kw: seen.update(kw) or FastAPI())
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    assert args.func(args) == 0
    assert (seen["tool_call_parser"], seen["reasoning_parser"]) == ("qwen3_xml", "qwen3")
    with pytest.raises(ValueError, match="tool_call_parser"):
        create_app(None, "x", tool_call_parser="mistral")
