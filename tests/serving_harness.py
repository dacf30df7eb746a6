"""Servers for the serving tests: a real uvicorn on 127.0.0.1 (a free port) in a thread of the test process, or
`flashnext serve` as a subprocess; /metrics parsed with prometheus-client's parser."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def uvicorn_server(app):
    """Serve `app` with uvicorn on a free loopback port; yields the base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def toy_checkpoint(directory: Path, **config) -> Path:
    """A toy checkpoint directory (`flashnext serve --model` loads the toy model from it)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "toy_config.json").write_text(json.dumps(config))
    return directory


@contextlib.contextmanager
def serve_process(*args: str, env: dict | None = None, timeout: float = 600):
    """`flashnext serve ARGS` on a free port until /health answers; yields (base URL, Popen)."""
    port = free_port()
    log = open(os.environ.get("FLASHNEXT_SERVE_LOG", os.devnull), "w")
    proc = subprocess.Popen([sys.executable, "-m", "flashnext_jax.cli", "serve", "--port", str(port), *args],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, **(env or {})))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            assert proc.poll() is None, f"server exited with {proc.returncode}"
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.5)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # graceful shutdown waits for requests still in flight
                proc.kill()
                proc.wait(timeout=30)
        log.close()


def metrics(base: str, timeout: float = 30) -> dict[str, float]:
    """/metrics as {sample name: value} (labels dropped: one model per server)."""
    text = httpx.get(base + "/metrics", timeout=timeout).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def wait_for(predicate, timeout: float = 30, every: float = 0.1):
    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value or time.time() > deadline:
            return value
        time.sleep(every)
