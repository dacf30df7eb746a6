"""Structured outputs through the server: the official `openai` client against uvicorn on a loopback port, on the
demo model. Oracles: jsonschema / pydantic on what comes back, and OpenAI-style 400s naming the bad field."""

import json

import jsonschema
import openai
import pydantic
import pytest

import flashnext_jax as fj
from serving.app import create_app
from serving_harness import uvicorn_server

SHAPES = dict(max_model_len=96, page_size=96, block_size=96, min_batch_bucket=2, min_token_bucket=8,
              min_pool_capacity=(2, 4, 4), compile_ahead=False, max_num_seqs=2)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}


class Trip(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=6)
    days: int = pydantic.Field(ge=1, le=9)


@pytest.fixture(scope="module")
def client():
    llm = fj.LLM(None, dtype="float32", **SHAPES)
    with uvicorn_server(create_app(llm, "demo_model", generation_defaults={"max_tokens": 48})) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)


MESSAGES = [{"role": "user", "content": "plan a trip"}]


def test_chat_json_schema_strict(client):
    r = client.chat.completions.create(model="demo_model", messages=MESSAGES, temperature=0, max_tokens=48,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "trip", "schema": SCHEMA, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model="demo_model", messages=MESSAGES, temperature=0, max_tokens=48,
                                      response_format=Trip)
    assert isinstance(r.choices[0].message.parsed, Trip)


def test_completions_json_object_streamed(client):
    chunks = list(client.completions.create(model="demo_model", prompt="data:", max_tokens=48, temperature=0.8,
                                            seed=3, stream=True,  # the client's completions have no
                                            extra_body={"response_format": {"type": "json_object"}}))  # such arg
    text = "".join(c.choices[0].text for c in chunks)
    if chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert chunks[-1].choices[0].finish_reason == "length" and text.startswith("{")


@pytest.mark.parametrize("constraint, check", [
    ({"choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"regex": "[A-Z][a-z]{2,5}"}, lambda t: t[0].isupper() and t[1:].islower() and 3 <= len(t) <= 6),
    ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None)])
def test_vllm_structured_outputs_on_chat(client, constraint, check):
    r = client.chat.completions.create(model="demo_model", messages=MESSAGES, temperature=0, max_tokens=48,
                                       extra_body={"structured_outputs": constraint})
    assert r.choices[0].finish_reason == "stop" and check(r.choices[0].message.content)


@pytest.mark.parametrize("extra, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "structured_outputs.json: unsupported or invalid"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"xml": "a"}}, "unsupported field"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "not both")])
def test_bad_constraints_are_400_naming_the_problem(client, extra, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model="demo_model", messages=MESSAGES, max_tokens=8,
                                       extra_body=extra)


@pytest.mark.parametrize("extra, message", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "without --tool-call-parser"),
    ({"tool_choice": "required"}, "tool_choice: needs tools"),
    ({"functions": [{"name": "f"}]}, "'functions' is not supported")])
def test_tools_need_a_parser_and_legacy_functions_stay_unsupported(client, extra, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model="demo_model", messages=MESSAGES, max_tokens=4, extra_body=extra)
