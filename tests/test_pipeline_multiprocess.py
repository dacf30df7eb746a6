"""Beyond one host (docs/pipeline.md): two processes on localhost (jax.distributed.initialize, gloo CPU
collectives, loopback only), one CPU device each.

* The transport alone (tools/pp_two_process_probe.py): a stage's hidden state crosses from process 0's device to
  process 1's through a jitted shard_map + ppermute over the 2-device global mesh, checked by value.
* The engine (tests/pipeline_multiprocess_check.py): a PP=2 engine with stage 0 in process 0 and stage 1 in
  process 1, the same host loop in each, equals the PP=1 engine and Model.generate token for token and PP=1 in
  logits, with two concurrent requests of mixed lengths, MTP, prefix caching, chunked prefill and a sampled
  request; an engine fault in one process, or processes that added different requests, stop both at once.
* Precompile: with stages in two processes, a request compiles nothing in either (the collectives included).
* The command line: `flashnext generate --coordinator-address ... --process-id i` in each process.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pipeline_runs import PROMPTS

ROOT = Path(__file__).parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_processes(command, timeout: int, env: dict | None = None) -> list[str]:
    """Run command(process, port) as processes 0 and 1 at once -> their standard outputs. A process that exits
    with an error fails the test at once with its own error output (the other is killed), as does a timeout."""
    port = str(_free_port())
    extra, env = env or {}, dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", ""))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.update(extra)
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in (0, 1)]  # never a full pipe
    procs = [subprocess.Popen(command(i, port), stdout=out, stderr=err, text=True, env=env, cwd=ROOT / "tests")
             for i, (out, err) in enumerate(logs)]
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs) and \
                not any(p.poll() for p in procs):
            time.sleep(0.2)
        codes = [p.poll() for p in procs]  # None: still running
    finally:
        for p in procs:
            p.kill()
            p.wait()
    text = [[(f.seek(0), f.read())[1] for f in pair] for pair in logs]
    for i, code in enumerate(codes):
        assert code in (0, None), f"process {i} exited with {code}:\n{text[i][1][-3000:]}"
    assert None not in codes, f"{command(0, port)[1:4]}: process(es) {[i for i, c in enumerate(codes) if c is None]}" \
        f" still running after {timeout} s (killed)"
    return [out for out, _ in text]


def _script(path: Path):
    """`python path PROCESS PORT` (its last output line a JSON object)."""
    return lambda i, port: [sys.executable, str(path), str(i), port]


def _last_json(outs: list[str]) -> list[dict]:
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def test_two_processes_pass_a_hidden_state_by_ppermute():
    results = _last_json(_two_processes(_script(ROOT / "tools" / "pp_two_process_probe.py"), 240))
    assert [r["process"] for r in results] == [0, 1]
    assert all(len(r["devices"]) == 2 and len(r["local"]) == 1 for r in results)
    assert all(r["ppermute"] == "ok" for r in results), results


@pytest.fixture(scope="module")
def engines():
    return _last_json(_two_processes(_script(ROOT / "tests" / "pipeline_multiprocess_check.py"), 600,
                                     {"JAX_COMPILATION_CACHE_DIR": str(ROOT / ".jax_cache_pp_mp")}))


def test_generate_in_two_processes_prints_the_one_process_tokens(engines):
    """`flashnext generate --pipeline-parallel-size 2 --coordinator-address ... --process-id i` in each process
    (no MTP: the draft logits are empty and do not cross) prints Model.generate's tokens in both (process 1's
    Model.generate of the same prompt in `engines`: no third compile of it here)."""
    prompt, tokens = PROMPTS[1], engines[1]["solo"][1]

    def generate(i, port):
        return [sys.executable, "-m", "flashnext_jax.cli", "generate", "--token-ids", ",".join(map(str, prompt)),
                "--max-new-tokens", str(len(tokens)), "--dtype", "float32", "--pipeline-parallel-size", "2",
                "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]
    outs = _two_processes(generate, 400, {"JAX_COMPILATION_CACHE_DIR": str(ROOT / ".jax_cache_cli_mp")})
    assert len(tokens) == 10
    expected = f"output_token_ids: {tokens}"
    assert all(expected in out.splitlines() for out in outs), outs


def test_each_process_holds_its_own_stage(engines):
    p0, p1 = engines
    assert (p0["devices"], p0["local"], p1["devices"], p1["local"]) == (2, 1, 2, 1)
    assert p0["pp2"]["held"] == [True, False] and p1["pp2"]["held"] == [False, True]
    assert p0["pp2"]["store_devices"] == p0["pp2"]["param_devices"] == [[0], [2048]]
    assert p0["pp2"]["gdn_layers_per_stage"] == [4, 2]
    assert p0["pp2"]["bytes_between_stages"] > 0 and p1["pp2"]["bytes_between_stages"] == 0  # stage 0 sends


def test_two_process_pipeline_tokens_equal_one_process(engines):
    p0, p1 = engines
    for key in ("tokens", "again"):
        assert p0["pp2"][key] == p1["pp2"][key] == p0["pp1"][key], key
    s0, s1, solo = p0["pp2"]["sampled"], p1["pp2"]["sampled"], p0["pp1"]["sampled"]
    assert s0["tokens"] == s1["tokens"] == solo["tokens"] and s0["top"] == s1["top"] == solo["top"]
    assert s1["samplers"] == solo["samplers"] > 0 and s0["samplers"] == 0  # run in the last stage's process only
    assert p0["pp2"]["tokens"] == p1["solo"]
    assert p0["pp2"]["prefix_hits"] > 0 and p0["pp2"]["counters"]["drafts"] > 0


def test_two_process_pipeline_logits_equal_one_process(engines):
    d = engines[0]["logit_diff"]
    assert d["positions"] >= 20 and d["max_abs"] < 1e-4, d


def test_only_small_outputs_cross_in_a_greedy_step(engines):
    """Each step sends from the last stage's process only what the other host loops read: in a greedy request's
    steps the argmax and finite flags (a few bytes a row; no raw logits: none crossed in the whole greedy run
    either). Control: a request sampled with a temperature and a penalty (MTP: verified and proposed on the host)
    sends the raw logits in its sampling steps, and both processes draw the same tokens from them."""
    p0, p1 = engines
    assert p0["logits_here"] == 0
    c0, c1 = p0["crossings"], p1["crossings"]
    assert c0 == c1  # the same decision in both processes
    row = c0["vocab_size"] * 4  # one position's f32 logits
    greedy, sampled = c0["greedy"]["sent"], c0["host_sampled"]["sent"]
    assert greedy and all("logits" not in n and "draft_logits" not in n and b < row for n, b in greedy), greedy
    assert "logits_argmax" in greedy[0][0] and "logits_finite" in greedy[0][0]
    with_logits = [b for n, b in sampled if "logits" in n and "draft_logits" in n]
    assert with_logits and min(with_logits) >= 2 * row, sampled
    assert len(c0["host_sampled"]["tokens"]) == 4


def test_a_fault_in_one_process_stops_both(engines):
    p0, p1 = engines
    assert p1["fault"]["error"] == "RuntimeError: injected fault in process 1's commit"
    assert p0["fault"]["error"].startswith("PeerFailed: process 1's engine step failed")
    for p in engines:
        assert p["fault"]["seconds"] < 30 and p["fault"]["finish_reasons"] == ["error"]


def test_processes_that_added_other_requests_both_stop(engines):
    for p in engines:
        assert p["diverge"]["error"].startswith("Diverged: process 1's decisions differ from process 0's")
        assert p["diverge"]["finish_reasons"] == ["error"]


def test_precompile_leaves_no_compile_in_a_request_in_either_process(engines):
    """LLM(pipeline_parallel_size=2, precompile=True) over two processes compiles every step's programs at startup,
    the collectives across processes included (the hidden state's hop, the last stage's outputs to every process):
    the requests then build no program in either process (XLA's compile events, counted in each). Control: the same
    requests on an engine started without precompile compile their stage programs and their collectives there."""
    for p in engines:
        pc, control = p["precompiled"], p["not_precompiled"]
        assert pc["compiled"] == [] and pc["model_steps"] == 0, pc
        assert control["model_steps"] > 0 and "jit(send_across_processes)" in control["compiled"], control
        assert pc["tokens"] == control["tokens"] == p["pp2"]["tokens"]
