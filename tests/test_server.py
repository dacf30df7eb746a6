"""The OpenAI-compatible server: responses, streaming, and OpenAI-style 400 errors for bad input."""

import json

import pytest
from fastapi.testclient import TestClient

from flashnext_jax.llm import LLM
from serving.app import create_app


@pytest.fixture(scope="module")
def client():
    llm = LLM("toy", max_num_seqs=4, max_num_batched_tokens=64)
    with TestClient(create_app(llm, "toy")) as c:
        yield c


def events(response) -> list:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_models_and_health(client):
    assert client.get("/health").json() == {"status": "ok"}
    data = client.get("/v1/models").json()
    assert data["object"] == "list" and data["data"][0]["id"] == "toy"


def test_completion_and_its_stream_agree(client):
    body = {"model": "toy", "prompt": "w3 w4 w5", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json=body).json()
    assert full["object"] == "text_completion" and full["choices"][0]["finish_reason"] == "length"
    assert full["usage"]["completion_tokens"] == 6 and len(full["choices"][0]["token_ids"]) == 6
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        ev = events(r)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == full["choices"][0]["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_token_id_prompt_and_seeded_sampling_are_reproducible(client):
    body = {"prompt": [3, 4, 5], "max_tokens": 5, "temperature": 0.9, "seed": 7, "ignore_eos": True}
    a = client.post("/v1/completions", json=body).json()
    b = client.post("/v1/completions", json=body).json()
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]


def test_chat_completion_and_stream(client):
    body = {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    full = client.post("/v1/chat/completions", json=body).json()
    assert full["object"] == "chat.completion" and full["choices"][0]["message"]["role"] == "assistant"
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        ev = events(r)
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and ev[-1] == "[DONE]"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in ev[1:-1])
    assert text == full["choices"][0]["message"]["content"]


def test_completion_logprobs_and_their_stream(client):
    """Greedy completions with logprobs: one entry per token, the chosen token is its position's most likely, the
    text offsets follow the token strings, and the stream's chunks carry the same entries; none when not asked."""
    body = {"prompt": "w3 w4 w5", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    for tok, x, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert x <= 0 and len(top) == 2 and max(top.values()) == pytest.approx(x) and top.get(tok) == pytest.approx(x)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        chunks = [c for c in events(r) if c != "[DONE]"]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert sum((c["token_logprobs"] for c in streamed), []) == lp["token_logprobs"]
    assert sum((c["text_offset"] for c in streamed), []) == lp["text_offset"]
    plain = client.post("/v1/completions", json=body | {"logprobs": None}).json()["choices"][0]
    assert plain["logprobs"] is None and plain["token_ids"] == choice["token_ids"]


def test_chat_logprobs(client):
    body = {"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 3, "temperature": 0.8, "seed": 1,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 3}
    content = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert entry["logprob"] <= 0 and entry["bytes"] == list(entry["token"].encode())
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and entry["logprob"] <= tops[0] + 1e-6
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        ev = [c for c in events(r)[1:] if c != "[DONE]"]
    assert sum((c["choices"][0]["logprobs"]["content"] for c in ev if c["choices"][0]["logprobs"]), []) == content


@pytest.mark.parametrize(
    "path, body, needle",
    [
        ("/v1/completions", {"prompt": "w3", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "w3", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "w3", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": ""}, "empty"),
        ("/v1/completions", {"prompt": "w3", "model": "other"}, "not served"),
        ("/v1/completions", {"prompt": " ".join(["w3"] * 5000), "max_tokens": 4}, "max_model_len"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": "w3", "temperature": "hot"}, "temperature"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ("/v1/completions", {"prompt": "w3", "logprobs": 21}, "logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                  "top_logprobs": 30}, "logprobs"),
    ],
)
def test_bad_input_is_a_400_with_an_openai_error_object(client, path, body, needle):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"], err


def test_server_still_serves_after_bad_requests(client):
    client.post("/v1/completions", json={"prompt": "w3", "max_tokens": -5})
    ok = client.post("/v1/completions", json={"prompt": "w3 w4", "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_logprob_tokens_carry_their_raw_bytes_and_partial_characters_do_not_collide():
    """Byte-level tokens of one UTF-8 character (the demo tokenizer splits 'é' and an emoji into bytes): each entry
    has the token's own bytes (they join back to the text), a `bytes:` string instead of U+FFFD, and two such
    tokens are two different top_logprobs keys."""
    from flashnext_jax.api import DEMO_MODEL
    from flashnext_jax.sampling import TokenLogprob
    from flashnext_jax.tokenizer import Tokenizer
    from serving.logprobs import LogprobFormat

    tok = Tokenizer.from_dir(DEMO_MODEL)
    text = "héllo 🦊"
    ids = tok.encode(text)
    lps = [TokenLogprob(i, -1.0, tuple((j, -2.0) for j in ids)) for i in ids]
    chat = LogprobFormat(tok).chat(lps)["content"]
    assert b"".join(bytes(e["bytes"]) for e in chat).decode() == text
    partial = [e for e in chat if e["token"].startswith("bytes:")]
    assert len(partial) >= 5 and all("\ufffd" not in e["token"] for e in chat)
    assert all(e["token"] == "bytes:" + "".join(f"\\x{b:02x}" for b in e["bytes"]) for e in partial)
    top = LogprobFormat(tok).completion(lps)["top_logprobs"][0]
    assert len(top) == len(set(ids))  # one key per distinct token, partial bytes included
