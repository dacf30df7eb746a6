"""The server as an OpenAI / vLLM user meets it: a real uvicorn on loopback, the official `openai` client, the toy
model (its word-level tokenizer: token i is the word `w<i>`)."""

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashnext_jax.llm import LLM
from serving.app import create_app
from serving.protocol import UNSUPPORTED_FIELDS

from serving_harness import metrics, uvicorn_server

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def base():
    llm = LLM("toy", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    with uvicorn_server(create_app(llm, "toy", api_key=KEY)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)


def complete(client, **kw):
    return client.completions.create(model="toy", **({"temperature": 0, "extra_body": {"ignore_eos": True}} | kw))


def test_models_retrieve_and_unknown_model_is_a_404(client):
    assert client.models.retrieve("toy").id == "toy"
    assert [m.id for m in client.models.list()] == ["toy"]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert "nope" in e.value.body["message"]


def test_missing_or_wrong_api_key_is_a_401(base):
    for key in ("wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.get(base + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()


def test_unknown_route_and_method_are_openai_errors(base):
    r = httpx.get(base + "/v2/nothing")
    assert r.status_code == 404 and "/v2/nothing" in r.json()["error"]["message"]
    r = httpx.get(base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_version_tokenize_detokenize(base):
    assert httpx.get(base + "/version").json()["version"]
    tok = httpx.post(base + "/tokenize", json={"prompt": "w3 w4 w5"}).json()
    assert tok["tokens"] == [3, 4, 5] and tok["count"] == 3 and tok["max_model_len"] == 512
    assert httpx.post(base + "/detokenize", json={"tokens": [3, 4, 5]}).json() == {"prompt": "w3 w4 w5"}
    chat = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "w7"}]}).json()
    assert 7 in chat["tokens"] and chat["count"] == len(chat["tokens"])
    assert httpx.post(base + "/detokenize", json={"tokens": [99999]}).status_code == 400


def test_metrics_use_vllm_names_and_count_tokens(base, client):
    before = metrics(base)
    complete(client, prompt="w3 w4 w5", max_tokens=4)
    after = metrics(base)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == 3
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 4
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", "flashnext:slots_used", "flashnext:pages_used",
                 "flashnext:slots_total", "flashnext:pages_total", "flashnext:step_compilations",
                 "flashnext:compiled_steps_cached", "flashnext:sampler_compilations",
                 "flashnext:compiled_samplers_cached", "flashnext:xla_compilations"):
        assert name in after, name
    assert after["vllm:e2e_request_latency_seconds_count"] > before.get("vllm:e2e_request_latency_seconds_count", 0)
    assert after["flashnext:slots_used"] == 0 and after["flashnext:pages_total"] > 0
    assert after["flashnext:step_compilations"] >= after["flashnext:compiled_steps_cached"] >= 1


def test_stream_usage_chunk_when_asked(client):
    kw = dict(prompt="w3 w4", max_tokens=5, stream=True)
    chunks = list(complete(client, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == 2 and all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(c.usage is None and c.choices for c in complete(client, **kw))


def test_chat_stream_usage_and_finish_reason(client):
    stream = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "w3"}], max_tokens=3,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-2].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == \
        chat(client, [{"role": "user", "content": "w3"}]).choices[0].message.content


@pytest.mark.parametrize("prompts", [["w3 w4", "w9", "w5 w6 w7"], [[3, 4], [9], [5, 6, 7]]])
def test_batched_prompts_give_one_choice_each_like_solo_runs(client, prompts):
    solo = [complete(client, prompt=p, max_tokens=4).choices[0].text for p in prompts]
    batch = complete(client, prompt=prompts, max_tokens=4)
    assert [c.index for c in batch.choices] == [0, 1, 2] and [c.text for c in batch.choices] == solo
    assert batch.usage.completion_tokens == 12
    streamed = ["", "", ""]
    for chunk in complete(client, prompt=prompts, max_tokens=4, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == solo


def chat(client, messages, extra_body=None, **kw):
    return client.chat.completions.create(model="toy", messages=messages, max_tokens=3, temperature=0,
                                          extra_body={"ignore_eos": True} | (extra_body or {}), **kw)


def test_content_parts_developer_role_and_tool_call_messages(client):
    plain = chat(client, [{"role": "system", "content": "w8"}, {"role": "user", "content": "w3 w4"}])
    parts = chat(client, [{"role": "developer", "content": [{"type": "text", "text": "w8"}]},
                          {"role": "user", "content": [{"type": "text", "text": "w3 "}, {"type": "text", "text": "w4"}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    tool_turn = [{"role": "user", "content": "w3"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "w5"}]
    assert chat(client, tool_turn).choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as e:  # the toy checkpoint has no vision tower
        chat(client, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;"
                                                                                          "base64,AAAA"}}]}])
    assert "takes no images" in e.value.body["message"]


def test_max_tokens_beyond_the_context_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, prompt="w3 w4", max_tokens=511)
    assert "maximum context length" in e.value.body["message"] and "513" in e.value.body["message"]
    assert complete(client, prompt="w3 w4", max_tokens=510).usage.completion_tokens == 510


@pytest.mark.parametrize("field, value, needle", [
    ("suffix", "w3", "'suffix' is not supported"), ("best_of", 2, "best_of=2"), ("n", 2, "n=2"),
    ("user_typo_field", 1, "unknown field 'user_typo_field'"), ("prompt_logprobs", 1, "'prompt_logprobs'"),
    ("logit_bias", {"x": 1}, "logit_bias")])
def test_unsupported_completion_fields_are_a_400_naming_them(client, field, value, needle):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, prompt="w3", max_tokens=2, extra_body={field: value})
    assert needle in e.value.body["message"]


@pytest.mark.parametrize("field, value", [("functions", [{"name": "f"}]), ("function_call", "auto"),
                                          ("guided_json", {"type": "object"}), ("echo", True)])
def test_unsupported_chat_fields_are_a_400_naming_them(client, field, value):
    assert field in UNSUPPORTED_FIELDS
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, [{"role": "user", "content": "w3"}], extra_body={field: value})
    assert field in e.value.body["message"]


def test_metadata_only_field_user_is_accepted(client):
    assert complete(client, prompt="w3", max_tokens=2, user="someone").usage.completion_tokens == 2


_free_texts: dict[int, str] = {}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 3), cuts=st.lists(st.tuples(st.floats(0, 1), st.integers(1, 6)), min_size=1, max_size=3),
       other=st.text(alphabet="w0123456789 ", min_size=1, max_size=4))
def test_streamed_text_equals_non_streamed_text_for_any_stop_strings(client, seed, cuts, other):
    """Stop strings cut from the text the request produces without them (so they do occur, often across tokens),
    plus a random one."""
    kw = dict(prompt="w3 w14", max_tokens=12, temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
    if seed not in _free_texts:
        _free_texts[seed] = client.completions.create(model="toy", **kw).choices[0].text
    free = _free_texts[seed]
    stop = [free[int(a * (len(free) - 1)):][:n] for a, n in cuts] + [other]
    full = client.completions.create(model="toy", stop=stop, **kw).choices[0]
    chunks = list(client.completions.create(model="toy", stream=True, stop=stop, **kw))
    assert "".join(c.choices[0].text for c in chunks) == full.text
    assert chunks[-1].choices[0].finish_reason == full.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert not any(s in full.text for s in stop) and free.startswith(full.text)


def test_logit_bias_steers_greedy_decoding(client):
    free = complete(client, prompt="w3 w4", max_tokens=6).choices[0].token_ids
    forced = complete(client, prompt="w3 w4", max_tokens=6, logit_bias={"17": 100}).choices[0]
    assert forced.token_ids == [17] * 6 and free != [17] * 6
    banned = complete(client, prompt="w3 w4", max_tokens=6, logit_bias={str(free[0]): -100}).choices[0].token_ids
    assert banned[0] != free[0]
    chat_forced = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "w3"}],
                                                 max_tokens=3, temperature=0.9, seed=1, logit_bias={"9": 100},
                                                 extra_body={"ignore_eos": True})
    assert chat_forced.choices[0].message.content == "w9 w9 w9"
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, prompt="w3", max_tokens=2, logit_bias={"100000": 1})
    assert "logit_bias" in e.value.body["message"]


def test_echo_returns_the_prompt_before_the_completion(client):
    plain = complete(client, prompt="w3 w4", max_tokens=3).choices[0]
    echoed = complete(client, prompt="w3 w4", max_tokens=3, echo=True).choices[0]
    assert echoed.text == "w3 w4" + plain.text and echoed.logprobs is None
    streamed = "".join(c.choices[0].text for c in complete(client, prompt="w3 w4", max_tokens=3, echo=True,
                                                             stream=True))
    assert streamed == echoed.text
