"""Fail fast: an engine fault reaches every in-flight request (an SSE error event on streams, a 500 otherwise),
/health turns 503, and `flashnext serve` exits non-zero within 5 s."""

import json
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from flashnext_jax.llm import LLM
from serving.app import create_app
from serving.cli import FAULT_AFTER_STEPS_ENV

from serving_harness import serve_process, toy_checkpoint


def test_engine_fault_is_a_500_then_health_is_503():
    llm = LLM("toy", max_num_seqs=4, max_num_batched_tokens=64)

    def broken_step():
        raise RuntimeError("device lost")

    llm.engine.step = broken_step
    with TestClient(create_app(llm, "toy")) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "w3 w4", "max_tokens": 3})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "internal_error" and "device lost" in r.json()["error"]["message"]
        health = c.get("/health")
        assert health.status_code == 503 and "device lost" in health.json()["error"]["message"]


def _stream_until_error(base: str, result: dict, key: int):
    body = {"prompt": "w3 w4", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and "error" in json.loads(line[6:]):
                    result[key] = ("error event", json.loads(line[6:])["error"], time.monotonic())
                    return
        result[key] = ("ended without an error", None, time.monotonic())
    except httpx.HTTPError as e:
        result[key] = ("connection lost", repr(e), time.monotonic())


def _complete(base: str, result: dict, key: int):
    body = {"prompt": "w5", "max_tokens": 2000, "ignore_eos": True}
    try:
        r = httpx.post(base + "/v1/completions", json=body, timeout=300)
        result[key] = (f"status {r.status_code}", r.json().get("error"), time.monotonic())
    except httpx.HTTPError as e:
        result[key] = ("connection lost", repr(e), time.monotonic())


def test_injected_fault_errors_every_client_and_the_server_exits_nonzero(tmp_path):
    model = toy_checkpoint(tmp_path / "toy")
    with serve_process("--model", str(model), "--max-num-seqs", "8", env={FAULT_AFTER_STEPS_ENV: "60"}) as (base, proc):
        result: dict = {}
        threads = [threading.Thread(target=_stream_until_error, args=(base, result, i)) for i in range(3)]
        threads.append(threading.Thread(target=_complete, args=(base, result, 3)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        first_error = min(t for _, _, t in result.values())
        try:
            health = httpx.get(base + "/health", timeout=2).status_code
        except httpx.HTTPError:
            health = None  # already exited
        code = proc.wait(timeout=10)
        exited = time.monotonic()
    assert [result[i][0] for i in range(3)] == ["error event"] * 3, result
    assert result[3][0] == "status 500" and result[3][1]["type"] == "internal_error", result
    assert all("injected engine fault" in result[i][1]["message"] for i in range(4))
    assert health in (503, None)
    assert code != 0 and exited - first_error < 5, (code, exited - first_error)
