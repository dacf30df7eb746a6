"""echo with logprobs on the demo model (float32): the prompt tokens' logprobs, in the completions format, equal
log_softmax(Model.logits) of the prompt, and the completion's follow them (a real uvicorn, the openai client)."""

import numpy as np
import openai

import flashnext_jax
from flashnext_jax.llm import LLM
from serving.app import create_app

from serving_harness import uvicorn_server


def log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


def test_echo_logprobs_match_model_logits():
    prompt = [5, 17, 230, 41, 99]
    llm = LLM(None, dtype="float32", max_model_len=64, max_num_seqs=2)
    with uvicorn_server(create_app(llm, "demo")) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0)
        kw = dict(model="demo", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=3,
                  extra_body={"ignore_eos": True})
        choice = client.completions.create(**kw).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
    streamed = {k: sum((getattr(c.logprobs, k) for c in chunks if c.logprobs), []) for k in
                ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert streamed == {k: v for k, v in choice.logprobs.model_dump().items() if k in streamed}
    assert "".join(c.text for c in chunks) == choice.text and sum((c.token_ids for c in chunks), []) == \
        choice.token_ids
    lp, text, ids = choice.logprobs.model_dump(), choice.text, choice.token_ids
    tok = llm.get_tokenizer()
    assert text == tok.decode(prompt) + tok.decode(ids) and len(ids) == 3
    full = prompt + ids
    ref = log_softmax(flashnext_jax.load(dtype="float32").logits(full))  # [T, vocab]: row t predicts token t + 1
    assert len(lp["token_logprobs"]) == len(full)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [ref[t - 1, full[t]] for t in range(1, len(full))]
    np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=2e-4)
    for t in range(1, len(full)):
        top = lp["top_logprobs"][t]
        assert len(top) == 3
        np.testing.assert_allclose(sorted(top.values(), reverse=True), np.sort(ref[t - 1])[::-1][:3], atol=2e-4)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(full))]
