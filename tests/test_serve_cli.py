"""`flashnext serve` end to end: a real process on the demo model, a real HTTP request, a clean shutdown."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import flashnext_jax
from flashnext_jax import SamplingParams


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.status, json.loads(r.read())


def test_serve_demo_model_answers_like_the_offline_api():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flashnext_jax.cli", "serve", "--port", str(port),
                             "--dtype", "float32", "--max-model-len", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        deadline = time.time() + 300
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "server did not come up"
            time.sleep(1)
        status, body = post(f"http://127.0.0.1:{port}/v1/completions",
                            {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert status == 200 and body["model"] == "demo_model"
        offline = flashnext_jax.LLM(None, dtype="float32", max_model_len=256).generate(
            [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
        assert body["choices"][0]["token_ids"] == offline.token_ids
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def test_compilation_cache_option(tmp_path, monkeypatch):
    """--compilation-cache: a directory (created), else $JAX_COMPILATION_CACHE_DIR, or 'off'."""
    import jax

    from serving.cli import configure_compilation_cache

    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache)
    try:
        assert configure_compilation_cache(str(tmp_path / "c")) == str(tmp_path / "c") and (tmp_path / "c").is_dir()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
        assert configure_compilation_cache(None) == str(tmp_path / "env")
        assert configure_compilation_cache("off") is None and not jax.config.jax_enable_compilation_cache
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_enable_compilation_cache", before[1])
