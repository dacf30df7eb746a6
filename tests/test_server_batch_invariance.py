"""Issue 19 as a user met it: 8 concurrent greedy requests against the server on the demo model in bf16 gave 5
outputs that differ from the same requests sent alone. Now each answer, and each token's logprob and top
logprobs, equals its solo answer bit for bit (a real uvicorn on loopback, the official `openai` client)."""

import concurrent.futures

import openai
import pytest

from flashnext_jax.llm import LLM
from serving.app import create_app

from serving_harness import uvicorn_server

PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Stack:\n    def __init__(self):",
           "for i in range(10):", "# sort a list of numbers\n", "def read_file(path):\n    with open(",
           "x = [1, 2, 3]\nprint(", "while True:\n    line = input()"]


@pytest.fixture(scope="module")
def client():
    llm = LLM(None, dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512)
    with uvicorn_server(create_app(llm, "demo")) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def complete(client, prompt):
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=40, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    return c.text, c.logprobs.token_logprobs, c.logprobs.top_logprobs


def test_eight_concurrent_greedy_requests_equal_their_solo_answers(client):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: complete(client, p), PROMPTS))
    for prompt, got in zip(PROMPTS, together):
        alone = complete(client, prompt)
        assert got[0] == alone[0], prompt  # the text
        assert got[1] == alone[1] and got[2] == alone[2], prompt  # every logprob, bit for bit (JSON floats)
