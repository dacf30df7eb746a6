"""`flashnext serve` over two processes (docs/pipeline.md, "Beyond one host"; serving/multiprocess.py): stage 0 in
process 0, which serves HTTP, stage 1 in process 1, which follows process 0's inputs; two processes on localhost
(gloo CPU collectives), one CPU device each, the demo model in float32.

In order, on one server: two concurrent requests (a streamed chat, a completion) answer as the one-process PP=1
engine does; a client that goes away mid-stream has its request aborted in both processes (the per-step agreement
would stop both at the first step they differ); then SIGINT to process 0 ends both, each with exit status 0. Apart:
a fault in process 1 answers the client with an OpenAI-style error and ends both processes.
"""

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

import flashnext_jax as fj
from flashnext_jax.sampling import SamplingParams
from flashnext_jax.structured_output import StructuredOutputsParams
from serving.multiprocess import StepInputs, params_from_json, params_to_json
from serving_harness import free_port

ROOT = Path(__file__).parents[1]
MAX_LEN = 256
CHAT = [{"role": "user", "content": "Name three colours."}]
PROMPT = [5, 6, 7, 8]


class TwoProcessServer:
    """`flashnext serve --pipeline-parallel-size 2 ...` as processes 0 and 1 (their outputs in temporary files, never
    a full pipe). `env1`: extra environment of process 1 only."""

    def __init__(self, env1: dict | None = None):
        coordinator, self.port = free_port(), free_port()
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", ""),
                   JAX_COMPILATION_CACHE_DIR=str(ROOT / ".jax_cache_serve_mp"))  # (process 0 writes it)
        self.logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in (0, 1)]
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", "flashnext_jax.cli", "serve", "--port", str(self.port), "--dtype", "float32",
             "--max-model-len", str(MAX_LEN), "--pipeline-parallel-size", "2", "--coordinator-address",
             f"127.0.0.1:{coordinator}", "--num-processes", "2", "--process-id", str(i)],
            stdout=out, stderr=err, text=True, cwd=ROOT, env=env | (env1 or {}) if i else env)
            for i, (out, err) in enumerate(self.logs)]
        self.url = f"http://127.0.0.1:{self.port}"

    def output(self, i: int) -> tuple[str, str]:
        return tuple((f.seek(0), f.read())[1] for f in self.logs[i])

    @contextlib.contextmanager
    def explained(self):
        """A failure inside comes with both processes' error output."""
        try:
            yield
        except Exception as e:
            raise AssertionError(f"{type(e).__name__}: {e}\n--- process 0:\n{self.output(0)[1][-4000:]}\n"
                                 f"--- process 1:\n{self.output(1)[1][-4000:]}") from e

    def check_running(self) -> None:
        for i, p in enumerate(self.procs):
            assert p.poll() is None, f"process {i} exited with {p.returncode}:\n{self.output(i)[1][-3000:]}"

    def wait_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check_running()
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"the server did not come up in {timeout} s"
            time.sleep(0.5)

    def wait_exit(self, timeout: float) -> list[int | None]:
        """Both processes' exit statuses (None: still running after `timeout`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.2)
        return [p.poll() for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def server():
    s = TwoProcessServer()
    try:
        s.wait_up(480)
        s.disconnected = 0
        yield s
    finally:
        s.kill()


@pytest.fixture(scope="module")
def one_process():
    """The oracle: the one-process PP=1 engine over the same model."""
    return fj.LLM(None, dtype="float32", max_model_len=MAX_LEN)


def _greedy(n: int) -> dict:
    return {"max_tokens": n, "temperature": 0, "ignore_eos": True}


def _streamed_chat(url: str, n: int) -> str:
    text = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": CHAT, "stream": True} | _greedy(n),
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                body = json.loads(line[6:])
                assert "error" not in body, body
                text += [c["delta"].get("content") or "" for c in body["choices"]]
    return "".join(text)


def _completion(url: str, prompt: list[int], n: int) -> list[int]:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt} | _greedy(n), timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_every_sampling_field_crosses_as_json():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.01, presence_penalty=0.5,
                            frequency_penalty=-0.25, repetition_penalty=1.1, seed=2**63 - 5, stop=["x", "yz"],
                            stop_token_ids=[3, 4], max_tokens=7, ignore_eos=True, include_stop_str_in_output=True,
                            logprobs=2, prompt_logprobs=1, logit_bias={5: 1.5, 9: -100.0},
                            structured_outputs=StructuredOutputsParams(json={"type": "object", "b": 1, "a": 2},
                                                                       after="</think>"),
                            min_tokens=2, allowed_token_ids=[3, 8, 5], bad_words=["a b"],
                            bad_words_token_ids=[[1, 2], [7]], skip_special_tokens=False,
                            spaces_between_special_tokens=False, truncate_prompt_tokens=-1)
    inputs = StepInputs([["add", "r", [1, 2], params_to_json(params)], ["abort", "r"], ["free", "r"]], step=True)
    back = StepInputs.decode(inputs.encode())
    got = params_from_json(back.ops[0][3])
    grammar, got_grammar = params.structured_outputs, got.structured_outputs
    assert got_grammar.spec == grammar.spec and got_grammar.after == grammar.after
    assert dataclasses_equal(got, params) and back.ops[1:] == inputs.ops[1:] and back.step
    assert StepInputs(step=True).encode() == b"" and StepInputs.decode(b"") == StepInputs(step=True)


def dataclasses_equal(a: SamplingParams, b: SamplingParams) -> bool:
    """Equal in every field (StructuredOutputsParams compares by identity: checked by spec above)."""
    return all(getattr(a, f.name) == getattr(b, f.name) for f in dataclasses.fields(a)
               if f.name != "structured_outputs")


def test_two_concurrent_requests_answer_as_one_process(server, one_process):
    with concurrent.futures.ThreadPoolExecutor(2) as pool, server.explained():
        chat = pool.submit(_streamed_chat, server.url, 8)
        completion = pool.submit(_completion, server.url, PROMPT, 8)
        chat, completion = chat.result(), completion.result()
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert completion == one_process.generate(PROMPT, greedy)[0].token_ids
    assert chat == one_process.chat(CHAT, greedy)[0].text


def test_a_client_that_goes_away_mid_stream_is_aborted_in_both_processes(server, one_process):
    body = {"prompt": PROMPT, "stream": True} | _greedy(200)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 2:
                break  # and close the connection
    server.disconnected += 1
    time.sleep(1)
    # the next steps: process 1 aborted the request where process 0 did, or the agreement stops both
    assert _completion(server.url, [9, 8, 7], 6) == one_process.generate(
        [9, 8, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids
    server.check_running()


def test_sigint_to_process_0_ends_both(server):
    server.procs[0].send_signal(signal.SIGINT)
    codes = server.wait_exit(120)
    assert codes == [0, 0], (codes, server.output(0)[1][-3000:], server.output(1)[1][-3000:])
    done = json.loads(server.output(1)[0].split("followed process 0: ")[-1])
    assert done.get("abort", 0) == server.disconnected  # the client that went away, aborted here too
    assert done.get("add", 0) == done.get("free", 0)  # every request process 0 answered was dropped here too


def test_a_fault_in_process_1_answers_with_an_error_and_ends_both():
    s = TwoProcessServer(env1={"FLASHNEXT_TEST_FAULT_AFTER_STEPS": "3"})
    try:
        s.wait_up(480)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT} | _greedy(20), timeout=300)
        assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error", r.text
        assert "PeerFailed" in r.json()["error"]["message"]
        codes = s.wait_exit(60)
        assert codes == [1, 1], (codes, s.output(0)[1][-3000:], s.output(1)[1][-3000:])
        assert "injected engine fault" in s.output(1)[1]
    finally:
        s.kill()
