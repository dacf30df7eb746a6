"""Beyond one host, as far as it goes (docs/pipeline.md): two processes on localhost (jax.distributed.initialize,
gloo CPU collectives, loopback only), one CPU device each. A stage's hidden state crosses from process 0's device
to process 1's through a jitted shard_map + ppermute over the 2-device global mesh, checked by value."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_pass_a_hidden_state_by_ppermute():
    port = str(_free_port())
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS="")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tools" / "pp_two_process_probe.py"), str(i), port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in (0, 1)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    results = []
    for (out, err), p in zip(outs, procs):
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["process"] for r in results] == [0, 1]
    assert all(len(r["devices"]) == 2 and len(r["local"]) == 1 for r in results)
    assert all(r["ppermute"] == "ok" for r in results), results
