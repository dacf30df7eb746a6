"""The incident's serving profile on three GPUs (issue 23): PP = 3 with the layer split 16, 17, 15, MTP with one
draft token, prefix caching, max_num_seqs 2, max_num_batched_tokens 512, and two concurrent streams of requests
with 6K-45K-token prompts sharing source-code-like prefixes and 400-900 output tokens, half greedy and half at
temperature 0.7, through the OpenAI server (`serving.app.create_app`, uvicorn on loopback) and a real HTTP client.

The model: the real config, 48 layers, random INT4-Mixed weights (`decode_step.build`, `--experts` of 512 kept, the
MTP head in BF16 as the release), token ids as prompts (a token-id tokenizer decodes the answers). Checked:
* every request completes (HTTP 200, a finish reason), no fault; no degenerate output (an answer ending in a loop
  of a few characters, the incident's "one token forever");
* greedy answers equal the same requests run one at a time on PP = 1 (`--compare` of them, default 10), with the
  batch-invariant mode on (`--no-batch-invariant`: off) so that running beside the other stream changes nothing;
* tokens/s per stream and in aggregate; the stages' idle fraction (`PipelineRunner(profile=True)`).
Writes `bench/results/pp3_live.json` (or --out) with the issue's "summary": requests_completed, greedy_matches_pp1,
faults, degenerate_outputs, tok_s_per_stream, device, date.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 bench/pp3_live.py --deadline-s 300   # 3+ GPUs
    JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/pp3_live.py --smoke   # CPU dry run: 3 simulated devices, demo config

The full 2 x 100 requests of ~650 output tokens take ~30 min at ~80 tokens/s, and one device call holds 10 minutes:
`--deadline-s` stops sending, and the summary says how many requests were sent and completed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

if "--smoke" in sys.argv:  # before jax is imported: three simulated CPU devices
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=3"

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import decode_step  # noqa: E402
from bench.engine_step import RandomPleRunner  # noqa: E402
from bench.results_io import save_result  # noqa: E402
from flashnext_jax import api  # noqa: E402
from flashnext_jax.config import from_hf_config  # noqa: E402
from flashnext_jax.llm import LLM  # noqa: E402
from flashnext_jax.pipeline import PipelineRunner  # noqa: E402
from flashnext_jax.sampling import SamplingParams  # noqa: E402
from flashnext_jax.stages import StagePlan  # noqa: E402
from flashnext_jax.tokenizer import toy_tokenizer  # noqa: E402
from serving.app import create_app  # noqa: E402
from tests.serving_harness import uvicorn_server  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: demo config (8 layers), short requests")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--partition", default="16,17,15")
    ap.add_argument("--experts", type=int, default=32, help="routed experts kept (512 in the release)")
    ap.add_argument("--requests", type=int, default=100, help="requests per stream")
    ap.add_argument("--prompt", default="6144,45056", help="prompt lengths: min,max tokens")
    ap.add_argument("--output", default="400,900", help="output lengths: min,max tokens")
    ap.add_argument("--prefixes", type=int, default=4, help="shared prefixes the prompts start with")
    ap.add_argument("--compare", type=int, default=10, help="greedy requests re-run alone on PP = 1")
    ap.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="send no new request after this many seconds")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.partition, args.requests = 8, "3,3,2", min(args.requests, 3)
        args.prompt, args.output, args.compare = "20,60", "6,12", min(args.compare, 3)
    return args


def model_of(args) -> api.Model:
    with open(decode_step.DEMO_CONFIG if args.smoke else decode_step.REAL_CONFIG) as f:
        cfg = decode_step.cut_config(from_hf_config(json.load(f)), args.layers, args.experts)
    params, _, _ = decode_step.build(cfg, jax.random.key(0), with_mtp=True)
    return api.Model(cfg, params, table=None, dtype=jnp.float32 if args.smoke else jnp.bfloat16)


def requests_of(args, vocab: int) -> list[list[dict]]:
    """Two streams of request bodies: prompts = one of the shared prefixes cut to length, then a tail of their own;
    every other request greedy, the rest at temperature 0.7 with a seed."""
    rng = random.Random(0)
    lo, hi = map(int, args.prompt.split(","))
    out_lo, out_hi = map(int, args.output.split(","))
    prefixes = [[rng.randrange(1, vocab) for _ in range(hi)] for _ in range(args.prefixes)]
    streams = []
    for s in range(2):
        bodies = []
        for i in range(args.requests):
            n, tail = rng.randint(lo, hi), min(32, lo // 2)
            prompt = prefixes[rng.randrange(args.prefixes)][: n - tail] + [rng.randrange(1, vocab) for _ in
                                                                           range(tail)]
            greedy = i % 2 == 0
            bodies.append(dict(prompt=prompt, max_tokens=rng.randint(out_lo, out_hi), ignore_eos=True,
                               temperature=0.0 if greedy else 0.7, seed=1000 * s + i))
        streams.append(bodies)
    return streams


def looping(text: str, window: int = 200, max_period: int = 8) -> bool:
    """An answer that ends in a loop of a few characters repeated over its last `window` characters."""
    tail = text[-window:]
    return len(tail) == window and any(tail == (tail[:p] * (window // p + 1))[:window] for p in
                                       range(1, max_period + 1))


def stream(base: str, model: str, bodies: list[dict], results: list, deadline: float):
    with httpx.Client(timeout=3600) as client:
        t0 = time.perf_counter()
        for body in bodies:
            if time.perf_counter() > deadline:
                break
            t = time.perf_counter()
            try:
                r = client.post(f"{base}/v1/completions", json=dict(model=model, **body))
                data = r.json()
                choice = data["choices"][0] if r.status_code == 200 else {}
                results.append(dict(status=r.status_code, text=choice.get("text"),
                                    finish_reason=choice.get("finish_reason"), seconds=time.perf_counter() - t,
                                    completion_tokens=data.get("usage", {}).get("completion_tokens", 0),
                                    error=None if r.status_code == 200 else data))
            except Exception as e:  # a dropped connection or a hang cut by the timeout: a fault
                results.append(dict(status=None, text=None, finish_reason=None, seconds=time.perf_counter() - t,
                                    completion_tokens=0, error=repr(e)))
        results.append(dict(wall=time.perf_counter() - t0))


def main(argv=None) -> int:
    args = parse_args(argv)
    devs = jax.devices()
    print(f"{devs[0].device_kind} x{len(devs)} jax {jax.__version__}", flush=True)
    model = model_of(args)
    cfg = model.cfg
    tokenizer = toy_tokenizer(cfg.vocab_size, cfg.eos_token_id)
    hi = int(args.prompt.split(",")[1]) + int(args.output.split(",")[1]) + 64
    engine = dict(speculative_config={"method": "mtp", "num_speculative_tokens": 1}, max_num_seqs=2,
                  max_num_batched_tokens=512, enable_prefix_caching=True, max_model_len=hi,
                  batch_invariant=args.batch_invariant, tokenizer=tokenizer)
    if args.smoke:
        engine.update(page_size=16, block_size=16)
    else:  # one page-table width: nothing compiles as the contexts grow
        engine.update(page_table_width="max")
    partition = tuple(int(x) for x in args.partition.split(","))
    pipe = PipelineRunner(RandomPleRunner(model, 1), StagePlan.build(cfg.num_hidden_layers, 3, partition, devs[:3]),
                          profile=True, batch_invariant=args.batch_invariant)
    served = LLM(pipe, precompile=not args.smoke, **engine)  # the served engine's step shapes before any request
    streams = requests_of(args, cfg.vocab_size)
    results: list[list] = [[], []]
    t0 = time.perf_counter()
    with uvicorn_server(create_app(served, "random-int4-mixed")) as base:
        threads = [threading.Thread(target=stream, args=(base, "random-int4-mixed", streams[s], results[s],
                                                         t0 + args.deadline_s)) for s in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    walls = [r.pop()["wall"] for r in results]
    idle = pipe.timeline.idle_fractions() if pipe.timeline is not None else None
    del served, pipe  # the PP = 1 engine below takes the devices' memory
    rows = [dict(stream=s, request=i, prompt_tokens=len(streams[s][i]["prompt"]),
                 temperature=streams[s][i]["temperature"], **r) for s in range(2) for i, r in enumerate(results[s])]
    completed = [r for r in rows if r["status"] == 200 and r["finish_reason"] in ("stop", "length")]
    faults = [r for r in rows if r not in completed]
    degenerate = [r for r in completed if looping(r["text"] or "")]

    # greedy answers against PP = 1, one request at a time
    alone = LLM(RandomPleRunner(model, 1), **engine)
    greedy = [r for r in completed if r["temperature"] == 0.0][: args.compare]
    matches = 0
    for r in greedy:
        body = streams[r["stream"]][r["request"]]
        out = alone.generate([body["prompt"]], SamplingParams(temperature=0.0, max_tokens=body["max_tokens"],
                                                              ignore_eos=True))[0]
        r["pp1_equal"] = out.text == r["text"]
        matches += r["pp1_equal"]
    tok_s = [sum(r["completion_tokens"] for r in rows if r["stream"] == s) / max(walls[s], 1e-9) for s in range(2)]
    summary = dict(requests_completed=len(completed),  # exactly the keys; the rest beside it
                   greedy_matches_pp1=matches / len(greedy) if greedy else None, faults=len(faults),
                   degenerate_outputs=len(degenerate), tok_s_per_stream=tok_s, device=devs[0].device_kind,
                   date=time.strftime("%Y-%m-%d"))
    details = dict(requests_sent=len(rows), greedy_compared=len(greedy), tok_s_aggregate=sum(tok_s),
                   stage_idle_fraction=idle, batch_invariant=args.batch_invariant, partition=list(partition),
                   layers=cfg.num_hidden_layers, experts=cfg.num_experts, smoke=args.smoke,
                   wall_s=time.perf_counter() - t0)
    for r in rows:
        r["text"] = (r["text"] or "")[:200]  # keep the JSON small
    path = save_result("pp3_live.json", rows, args.out, summary=summary, **details)
    print(json.dumps(dict(summary, **details), indent=1))
    print("wrote", path)
    return 0 if not faults and not degenerate and matches == len(greedy) else 1


if __name__ == "__main__":
    sys.exit(main())
