"""vLLM's request fields min_tokens, allowed_token_ids, bad_words, skip_special_tokens /
spaces_between_special_tokens and truncate_prompt_tokens through the server (toy model: id 0 is <eos>, id i the word
"wi"), streamed and whole, and their 400s."""

import pytest
from fastapi.testclient import TestClient

from flashnext_jax.llm import LLM
from serving.app import create_app

from test_server import events

EOS_UP = {"0": 100}  # <eos> is the argmax everywhere


@pytest.fixture(scope="module")
def client():
    llm = LLM("toy", max_num_seqs=4, max_num_batched_tokens=64)
    with TestClient(create_app(llm, "toy")) as c:
        yield c


def complete(client, **body):
    r = client.post("/v1/completions", json={"prompt": "w3 w4 w5", "temperature": 0} | body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def streamed(client, path, body) -> tuple[str, list]:
    with client.stream("POST", path, json=body | {"stream": True}) as r:
        chunks = [c for c in events(r) if c != "[DONE]"]
    texts = [c["choices"][0].get("text", c["choices"][0].get("delta", {}).get("content")) or "" for c in chunks]
    return "".join(texts), chunks


def test_min_tokens_holds_eos_back_exactly_that_long(client):
    for path, body in (("/v1/completions", {"prompt": "w3 w4 w5"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w3"}]})):
        body = body | {"temperature": 0, "max_tokens": 8, "logit_bias": EOS_UP, "min_tokens": 3}
        r = client.post(path, json=body).json()
        assert r["usage"]["completion_tokens"] == 4 and r["choices"][0]["finish_reason"] == "stop", r
        assert client.post(path, json=body | {"min_tokens": 0}).json()["usage"]["completion_tokens"] == 1
    assert complete(client, max_tokens=8, logit_bias=EOS_UP, min_tokens=3)["token_ids"][3] == 0


def test_min_tokens_defers_stop_strings(client):
    free = complete(client, max_tokens=6, ignore_eos=True)
    stop = free["text"].split()[1]  # the second token's word
    assert complete(client, max_tokens=6, ignore_eos=True, stop=[stop])["text"] == free["text"].split(stop)[0]
    late = complete(client, max_tokens=6, ignore_eos=True, stop=[stop], min_tokens=3)
    assert late["text"].startswith(" ".join(free["text"].split()[:3])), late  # not cut at the early occurrence


def test_allowed_token_ids_and_bad_words(client):
    allowed = complete(client, max_tokens=6, ignore_eos=True, allowed_token_ids=[5, 9])
    assert set(allowed["token_ids"]) <= {5, 9} and set(allowed["text"].split()) <= {"w5", "w9"}
    free = complete(client, max_tokens=6, ignore_eos=True)["token_ids"]
    banned = complete(client, max_tokens=6, ignore_eos=True, bad_words=[f"w{free[0]}", f"w{free[2]} w{free[3]}"])
    ids = banned["token_ids"]
    assert free[0] not in ids and all(ids[i:i + 2] != free[2:4] for i in range(5)) and ids != free
    text, _ = streamed(client, "/v1/completions", {"prompt": "w3 w4 w5", "temperature": 0, "max_tokens": 6,
                                                   "ignore_eos": True, "bad_words": [f"w{free[0]}"]})
    assert text == complete(client, max_tokens=6, ignore_eos=True, bad_words=[f"w{free[0]}"])["text"]


@pytest.mark.parametrize("fields, text", [({}, ""), ({"skip_special_tokens": False}, "<eos> <eos> <eos>"),
                                          ({"skip_special_tokens": False, "spaces_between_special_tokens": False},
                                           "<eos><eos><eos>")])
def test_special_tokens_in_the_text(client, fields, text):
    body = {"temperature": 0, "max_tokens": 3, "ignore_eos": True, "logit_bias": EOS_UP} | fields
    assert complete(client, **body)["text"] == text
    assert streamed(client, "/v1/completions", {"prompt": "w3 w4 w5"} | body)[0] == text
    chat = {"messages": [{"role": "user", "content": "w3"}]} | body
    assert client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"] == text
    assert streamed(client, "/v1/chat/completions", chat)[0] == text


def test_eos_is_left_out_of_the_text_when_it_stops(client):
    assert complete(client, max_tokens=3, logit_bias=EOS_UP, skip_special_tokens=False)["text"] == ""


def test_truncate_prompt_tokens(client):
    prompt = [3, 4, 5, 6, 7, 8, 9, 10]
    cut = client.post("/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": 3, "max_tokens": 4,
                                               "temperature": 0, "ignore_eos": True, "echo": True}).json()
    last3 = complete(client, prompt=prompt[-3:], max_tokens=4, ignore_eos=True)
    assert cut["usage"]["prompt_tokens"] == 3 and cut["choices"][0]["token_ids"] == last3["token_ids"]
    assert cut["choices"][0]["text"] == "w8 w9 w10" + last3["text"]
    whole = complete(client, prompt=prompt, max_tokens=4, ignore_eos=True, truncate_prompt_tokens=-1)
    assert whole["token_ids"] == complete(client, prompt=prompt, max_tokens=4, ignore_eos=True)["token_ids"]
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w3 w4 w5 w6"}],
                                                     "truncate_prompt_tokens": 2, "max_tokens": 2}).json()
    assert chat["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize("body, needle", [
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"allowed_token_ids": [3, 64]}, "[64]"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": "3"}, "allowed_token_ids"), ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": "w3"}, "bad_words"), ({"skip_special_tokens": "maybe"}, "skip_special_tokens"),
    ({"spaces_between_special_tokens": 3}, "spaces_between_special_tokens"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"truncate_prompt_tokens": -2}, "truncate_prompt"),
    ({"truncate_prompt_tokens": 10**6}, "greater than max_model_len"),
])
def test_bad_values_are_400s(client, body, needle):
    for path, base in (("/v1/completions", {"prompt": "w3"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w3"}]})):
        r = client.post(path, json=base | {"max_tokens": 4} | body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and needle in err["message"], err
