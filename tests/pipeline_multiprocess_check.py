"""Run by tests/test_pipeline_multiprocess.py once per process: 2 processes on localhost, one CPU device each
(multihost.initialize: jax.distributed with gloo collectives). Usage: pipeline_multiprocess_check.py PROCESS PORT.

First an engine started with precompile=True, whose requests must compile nothing in either process (the hops
across processes included), and the same requests without precompile as the control. The PP=2 engine (stage 0 in
process 0, stage 1 in process 1) runs pipeline_runs.run in both processes, as a user runs
`LLM(..., pipeline_parallel_size=2)` in each. Then the two ways such an engine must stop, in both processes at
once: a fault in one process's step (process 1's third commit raises) and processes that added different
requests. Last, each process runs one oracle alone on its own device (process 0 the PP=1 engine, process 1
Model.generate). Prints one JSON line; asserts nothing itself."""

import faulthandler
import json
import pickle
import sys
import tempfile
import time
from pathlib import Path

import jax
from jax._src import dispatch
from jax import monitoring

import flashnext_jax as fj
from flashnext_jax import multihost
from flashnext_jax.engine import Engine
from flashnext_jax.sampling import SamplingParams
from pipeline_runs import MAX_LEN, PROMPTS, logit_diff, run, solo

COMPILED: list[str] = []  # the name of every program XLA built in this process (persistent cache hits included)


def _on_event(event: str, _seconds: float, **kw):
    if event == dispatch.BACKEND_COMPILE_EVENT:
        COMPILED.append(kw.get("fun_name", "?"))


monitoring.register_event_duration_secs_listener(_on_event)


def compiles_in_requests(precompile: bool) -> dict:
    """LLM(..., pipeline_parallel_size=2, precompile=precompile) (one page-table width, so that precompile covers
    every step shape, prefill buckets 4 and 16), then both prompts at once: the programs compiled while the requests
    ran. Precompile's warm-up request runs a 16-token chunk, so the 3-token prompt's step (T=4) and its hops across
    processes are first launched by the requests."""
    lm = fj.LLM(fj.load(dtype="float32", device="host"), max_num_seqs=2, max_num_batched_tokens=16,
                max_model_len=MAX_LEN, page_size=4, block_size=4, page_table_width="max", min_batch_bucket=2,
                pipeline_parallel_size=2, pp_layer_partition=(5, 3), precompile=precompile)
    before = len(COMPILED)
    outs = lm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                       SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    return {"tokens": [o.token_ids for o in outs], "compiled": COMPILED[before:],
            "model_steps": lm.engine.counters["compiles"]}


def stops_together(lm, pid: int, how: str) -> dict:
    """A fresh engine over the same stages; "fault": process 1's third commit raises; "diverge": process 1 adds the
    requests in the other order. -> what this process's engine raised, and after how long."""
    engine = Engine(lm.runner, lm.engine.cfg)
    prompts = PROMPTS[::-1] if how == "diverge" and pid == 1 else PROMPTS
    for i, p in enumerate(prompts):
        engine.add_request(f"{how}{i}", p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    if how == "fault" and pid == 1:
        commit, calls = engine._commit, []

        def failing(ticket, out):
            calls.append(ticket.step_id)
            if len(calls) == 3:
                raise RuntimeError("injected fault in process 1's commit")
            return commit(ticket, out)
        engine._commit = failing
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished():
            engine.step()
    except Exception as e:  # noqa: BLE001 - reported for the test to judge
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0,
                "finish_reasons": sorted({r.finish_reason for r in engine.requests.values()})}
    return {"error": None}


def crossings(lm) -> dict:
    """What crosses from the last stage's process each step (PipelineRunner.outputs_sent: the names and bytes):
    a greedy request, then (the control) one sampled with a temperature and a repetition penalty, which with MTP
    drafts verifies and proposes on the host from the raw logits (without a penalty it samples and verifies on the
    device: device_sampling.device_sampled)."""
    res = {"vocab_size": lm.runner.vocab_size}
    host = SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True, repetition_penalty=1.2)
    for name, params in (("greedy", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)),
                         ("host_sampled", host)):
        lm.runner.outputs_sent.clear()
        out = lm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)
        res[name] = {"tokens": out[0].token_ids, "sent": [[list(n), b] for n, b in lm.runner.outputs_sent]}
    return res


def main(pid: int, port: int):
    multihost.initialize(f"127.0.0.1:{port}", 2, pid, timeout_s=120, heartbeat_timeout_s=30)
    faulthandler.dump_traceback_later(480, exit=True)  # a hang shows where, before the test's 600 s kill
    res = {"process": pid, "devices": len(jax.devices()), "local": len(jax.local_devices())}
    res["precompiled"] = compiles_in_requests(True)  # first: no earlier engine has run any of its programs
    res["not_precompiled"] = compiles_in_requests(False)
    t0 = time.perf_counter()
    # one page-table width (RealRunner's own choice, as the PP=1 oracle runs): one step shape, not 4 (1, 2, 4, 8
    # pages); widths growing in both processes are test_server_multiprocess.py's (a served PP=2 on "auto")
    res["pp2"], logits2, lm = run(None, 2, page_table_width="max")
    res["pp2_seconds"] = time.perf_counter() - t0
    shared = Path(tempfile.gettempdir()) / f"pp_mp_logits_{port}.pickle"  # process 1's: it holds the last stage
    if pid == 1:
        shared.write_bytes(pickle.dumps(logits2))
    logits_here = len(logits2)  # process 0's copies: none (every step of run() is greedy)
    res["crossings"] = crossings(lm)
    res["fault"] = stops_together(lm, pid, "fault")
    res["diverge"] = stops_together(lm, pid, "diverge")
    model = fj.load(dtype="float32")  # the oracles, each process one of them alone on its own device
    if pid == 0:  # (only process 0 writes JAX's compilation cache: its programs compile once across runs)
        res["pp1"], logits1, _ = run(model, 1, compile_ahead=False)
        # the last stage's logits in process 1 (greedy steps send process 0 only their argmax and finite flags);
        # written before the collectives of stops_together, so there by now
        res["logit_diff"] = logit_diff(logits1, pickle.loads(shared.read_bytes()))
        res["logits_here"] = logits_here
        shared.unlink()
    else:
        res["solo"] = solo(model)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
