"""Fuzzing every endpoint from the app's own OpenAPI schema (schemathesis, against a real uvicorn): whatever the
body, no 5xx, and every 4xx is an OpenAI error object."""

import collections

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from flashnext_jax.llm import LLM
from serving.app import create_app

from serving_harness import uvicorn_server


@pytest.fixture(scope="module")
def api_schema():
    # a short context bounds every generated completion; a small model keeps each example fast
    llm = LLM("toy", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=48)
    with uvicorn_server(create_app(llm, "toy")) as base:
        yield schemathesis.openapi.from_url(base + "/openapi.json")


def test_no_endpoint_answers_5xx(api_schema):
    operations = [op.ok() for op in api_schema.get_all_operations()]
    assert len(operations) >= 9  # every route of the app, each fuzzed below
    statuses = collections.Counter()
    for op in operations:
        # the generating routes have many optional fields (sampling, logprobs, structured outputs, tools): most random
        # bodies are 400s, so they get more examples for some to reach generation
        generating = op.path in ("/v1/completions", "/v1/chat/completions")

        @given(case=op.as_strategy())
        @settings(max_examples=200 if generating else 25, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None, derandomize=True)  # the same examples every run: a pass is not luck
        def no_5xx(case):
            response = case.call(timeout=120)
            statuses[case.method, case.path, response.status_code // 100] += 1
            assert response.status_code < 500, (case.path, case.body, response.text[:500])
            if response.status_code >= 400:
                err = response.json()["error"]
                assert isinstance(err["message"], str) and err["code"] == response.status_code, response.text

        no_5xx()
    print(sorted(statuses.items()))
    # the fuzzer got past validation on the generating routes too (not only 400s)
    assert statuses["POST", "/v1/completions", 2] and statuses["POST", "/v1/chat/completions", 2], statuses
