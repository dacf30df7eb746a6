"""Load on `flashnext serve`: request throughput and TTFT / inter-token latency percentiles for 1, 2 and 8
concurrent streams, with and without MTP.

    python bench/serve_load.py [--model DIR] [--requests-per-stream 4] [--out bench/results/serve_load.json]

Each configuration starts its own server (a subprocess, real HTTP over loopback, streamed completions), runs one
warm-up round at every concurrency first (compiles excluded from the numbers), then `--requests-per-stream`
requests per concurrent stream: fixed-length token-id prompts, `--max-tokens` new tokens each (EOS ignored, greedy).
TTFT: request sent to first token chunk; ITL: the gap between a request's consecutive token chunks, divided by the
tokens the chunk carried; throughput: finished requests (and output tokens) per wall-clock second of the round.
Default model: the embedded demo model (float32). On the CPU the numbers say where time goes, not GPU speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_io import save_result  # noqa: E402


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "flashnext_jax.cli", "serve", "--port", str(port), "--dtype", args.dtype,
           "--max-model-len", str(args.max_model_len), "--max-num-seqs", "8", *extra]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"server did not start: {cmd}")
        time.sleep(0.5)


def one_stream(base: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    ttft, gaps, last, tokens = None, [], None, 0
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            n = len(json.loads(line[6:])["choices"][0]["token_ids"])
            if n == 0:
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gaps += [(now - last) / n] * n
            last, tokens = now, tokens + n
    return {"ttft": ttft, "itl": gaps, "e2e": time.perf_counter() - t0, "tokens": tokens}


def step_compilations(base: str) -> int:
    """The server's flashnext:step_compilations gauge (/metrics)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return int(float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("flashnext:step_compilations"))))


def round_at(base: str, concurrency: int, requests: int, args, rng: random.Random) -> dict:
    prompts = [[rng.randrange(1, 500) for _ in range(args.prompt_tokens)] for _ in range(requests)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one_stream(base, p, args.max_tokens), prompts))
    wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in results]
    itl = [g for r in results for g in r["itl"]]

    def pct(xs):
        return {f"p{q}": round(float(np.percentile(xs, q)) * 1e3, 2) for q in (50, 90, 99)} if xs else None
    return {"concurrency": concurrency, "requests": requests, "wall_s": round(wall, 3),
            "requests_per_s": round(requests / wall, 3),
            "output_tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 2),
            "ttft_ms": pct(ttft), "itl_ms": pct(itl), "e2e_ms": pct([r["e2e"] for r in results])}


def _save(rows: list[dict], args, complete: bool) -> str:
    summary = {f"{'mtp' if r['mtp_tokens'] else 'no_mtp'}_c{r['concurrency']}": {
        "requests_per_s": r["requests_per_s"], "output_tokens_per_s": r["output_tokens_per_s"],
        "ttft_p50_ms": r["ttft_ms"]["p50"], "itl_p50_ms": r["itl_ms"]["p50"] if r["itl_ms"] else None}
        for r in rows}
    return save_result("serve_load.json", rows, args.out, summary=summary, complete=complete,
                       model=args.model or "embedded demo model", dtype=args.dtype,
                       prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                       requests_per_stream=args.requests_per_stream)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: the embedded demo model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--mtp", type=int, nargs="+", default=[0, 1], help="MTP draft tokens per configuration (0 = off)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rng = random.Random(0)
    rows: list[dict] = []
    path = None
    for k in args.mtp:
        proc, base = start_server(args, ["--num-speculative-tokens", str(k)] if k else [])
        try:
            for c in args.concurrency:  # warm-up: compile every shape these rounds use
                round_at(base, c, c, args, rng)
            for c in args.concurrency:
                before = step_compilations(base)
                row = {"mtp_tokens": k} | round_at(base, c, c * args.requests_per_stream, args, rng)
                # a step shape the warm-up missed compiles inside the round: its latencies then include it
                row["step_compilations_in_round"] = step_compilations(base) - before
                rows.append(row)
                print(json.dumps(row), flush=True)
                path = _save(rows, args, complete=False)  # what is measured so far survives an interrupted run
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    path = _save(rows, args, complete=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
