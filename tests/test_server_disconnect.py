"""Clients that go away mid-stream: their requests are aborted and their slots and pages freed (read from
/metrics, the engine's ledger); and no request, finished or aborted, leaves a record behind (a 30-minute soak of
17K requests grew the server by ~25 KB per request before `Engine.free_request`)."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from flashnext_jax.llm import LLM
from flashnext_jax.sampling import SamplingParams
from serving.app import create_app

from serving_harness import metrics, uvicorn_server, wait_for


def _read_then_drop(base: str, i: int) -> int:
    prompt = [[3 + i % 40, 4], [5, 6 + i % 30]] if i % 5 == 0 else f"w{3 + i % 50} w7"  # some batched
    body = {"prompt": prompt, "max_tokens": 500, "ignore_eos": True, "stream": True,
            "logprobs": 2 if i % 3 == 0 else None}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for n, line in enumerate(r.iter_lines()):
            if n >= 1 + i % 4:  # leave after a few chunks, without reading the rest
                return n
    raise AssertionError("the stream ended before the client left")


def _disconnects(count: int):
    llm = LLM("toy", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024)
    with uvicorn_server(create_app(llm, "toy")) as base:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: _read_then_drop(base, i), range(count)))
        idle = wait_for(lambda: (m := metrics(base))["flashnext:slots_used"] == 0 and m["flashnext:pages_used"] == 0
                        and m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0)
        assert idle, metrics(base)
        assert not llm.engine.has_unfinished()
        ok = httpx.post(base + "/v1/completions", json={"prompt": "w3", "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        with httpx.stream("POST", base + "/v1/completions",
                          json={"prompt": "w3", "max_tokens": 3, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200 and "data: [DONE]" in list(r.iter_lines())
        assert wait_for(lambda: not _records(llm)), _records(llm)


def _records(llm: LLM) -> dict[str, int]:
    """What the engine and the LLM layer still keep per request (empty once every request's caller has its output)."""
    tables = {"engine.requests": llm.engine.requests, "engine.grammars": llm.engine.grammars,
              "detokenizers": llm._detok, "prompts": llm._prompts, "emitted": llm._emitted, "streams": llm._streams}
    return {name: len(t) for name, t in tables.items() if t}


def test_generate_keeps_no_record_of_finished_requests():
    llm = LLM("toy", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    outs = llm.generate(["w3 w4", "w5", [7, 8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 4, 4]
    assert not _records(llm), _records(llm)


def test_100_disconnects_mid_stream_free_every_slot_and_page():
    _disconnects(100)


@pytest.mark.slow
def test_1000_disconnects_mid_stream_free_every_slot_and_page():
    _disconnects(1000)


def test_a_caller_gone_while_its_request_is_added_leaves_no_record():
    """LLM.stream adds a request on a worker thread (tokenizer, vision tower); a caller cancelled meanwhile (a
    client that disconnected) has its request dropped once the add completes, not left to run unread."""
    import asyncio
    import time

    llm = LLM("toy", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    real_add, added = llm._add, []

    def slow_add(*args):
        time.sleep(0.5)
        added.append(real_add(*args))
        return added[-1]
    llm._add = slow_add

    async def run():
        stream = llm.stream("w3 w4", SamplingParams(max_tokens=200, ignore_eos=True))
        first = asyncio.create_task(anext(stream))
        await asyncio.sleep(0.1)  # inside the add
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.sleep(1.0)  # the add ends meanwhile, and its request is dropped
    asyncio.run(run())
    assert len(added) == 1 and added[0].finished and added[0].finish_reason == "abort"
    assert not _records(llm), _records(llm)
