"""What structured outputs cost per token and per engine step, at the real vocabulary (248,320 tokens).

Host part (`--part host`, a host cost: run it anywhere, the result says device=cpu when run on a CPU): a
synthetic byte-level tokenizer of 248,320 tokens (the 256 bytes, then unique byte strings shaped like BPE pieces:
words with and without a leading space, digits, punctuation and JSON fragments), llguidance matchers for a JSON
schema, any JSON object and a regex, walked along a random path of allowed tokens. Per step it times what the
engine does (structured_output.GrammarCompiler): the masks of B = 1 and B = 2 requests ("serial": on the calling
thread, the engine's path below PARALLEL_FROM rows; "executor": llguidance's parallel executor), without and with
one MTP draft per request (2 mask rows each), the commit (consume_token), and the unpacking a host-sampled row
needs (allowed_tokens).

Device part (`--part device`, for the H200): the jitted step epilogue of step_programs.with_device_sampling on [B, K1,
248320] logits, with a mask of the constrained rows vs without (argmax; and device sampling), i.e. what a
constrained row adds to a step on the device; plus the mask's host->device copy. The issue's target: a step with a
constrained row <= 5% slower than without (decode step ~6.5 ms on the H200: bench/results/engine_step.json).

  JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/structured_cost.py --part host  # bench/results/structured_cost.json
  PYTHONPATH=. python3 bench/structured_cost.py --part device                  # on the H200 -> $OUT
  STRUCTURED_BENCH_SMOKE=1 JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/structured_cost.py --part device  # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

VOCAB = 248_320
SMOKE = bool(os.environ.get("STRUCTURED_BENCH_SMOKE"))
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                 "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
GRAMMARS = {"json_schema": ("json", json.dumps(SCHEMA)), "json_object": ("json_object", ""),
            "regex": ("regex", "[A-Z][a-z]{2,10}( [A-Z][a-z]{2,10}){0,6}\\.")}


class SyntheticTokenizer:
    """A byte-level vocabulary of `n` tokens for llguidance.TokenizerWrapper (eos = the last id)."""

    def __init__(self, n: int, seed: int = 0):
        rng = random.Random(seed)
        pieces = [bytes([b]) for b in range(256)]
        seen = set(pieces)
        alphabet = string.ascii_letters + string.digits
        fragments = ['{"', '":', '",', '"}', '["', '"]', "},", ": ", ", ", "{\n", "\n}", "  ", "    "]
        for f in fragments:
            if f.encode() not in seen:
                seen.add(f.encode())
                pieces.append(f.encode())
        while len(pieces) < n - 1:
            kind = rng.random()
            if kind < 0.6:
                w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 10)))
                w = (" " if rng.random() < 0.5 else "") + (w.capitalize() if rng.random() < 0.2 else w)
            elif kind < 0.75:
                w = "".join(rng.choice(string.digits) for _ in range(rng.randint(1, 3)))
            elif kind < 0.9:
                w = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))
            else:
                w = "".join(rng.choice(string.punctuation + " ") for _ in range(rng.randint(2, 4)))
            b = w.encode()
            if b not in seen:
                seen.add(b)
                pieces.append(b)
        self.tokens = pieces + [b"<|endoftext|>"]
        self.eos_token_id, self.bos_token_id, self.special_token_ids = n - 1, None, [n - 1]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)  # byte tokens: what llguidance's own greedy re-tokenizing starts from


def _stats_us(samples: list[float]) -> dict:
    us = sorted(1e6 * s for s in samples)
    return {"median_us": round(statistics.median(us), 1), "p90_us": round(us[int(0.9 * (len(us) - 1))], 1),
            "max_us": round(us[-1], 1), "n": len(us)}


def host_part(steps: int) -> list[dict]:
    import llguidance
    from llguidance.numpy import fill_next_token_bitmask

    from flashnext_jax.structured_output import GrammarCompiler, GrammarState, _grammar_text, allowed_tokens

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(SyntheticTokenizer(VOCAB)), n_vocab=VOCAB)
    build_s = time.perf_counter() - t0
    compiler = GrammarCompiler(None, VOCAB, lltokenizer=lltok)
    words = (VOCAB + 31) // 32
    rows = [{"what": "tokenizer build (once per server)", "seconds": round(build_s, 2)}]
    rng = np.random.default_rng(0)
    for name, (kind, text) in GRAMMARS.items():
        t0 = time.perf_counter()
        grammar = _grammar_text(kind, text)
        pristine = llguidance.LLMatcher(lltok, grammar, log_level=0)
        compile_s = time.perf_counter() - t0
        cases = [(b, d, m) for b in (1, 2) for d in (0, 1) for m in ("executor", "serial") if b > 1 or m == "serial"]
        for batch, drafts, mode in cases:
            matchers = [pristine.deep_copy() for _ in range(batch)]
            mask = np.full((batch * (1 + drafts), words), -1, np.int32)
            t_mask, t_commit, t_unpack, n = [], [], [], 0
            for _ in range(steps):
                if any(m.is_stopped() for m in matchers):  # restart a finished walk: steady-state cost
                    matchers = [pristine.deep_copy() for _ in range(batch)]
                # MTP: the draft is an allowed token, chosen on a copy of the matcher (so the timed fill does
                # not find the current state's mask computed already) and then accepted; without drafts the next
                # token is chosen from the timed mask itself
                drafted = []
                for m in matchers if drafts else ():
                    one = np.full((1, words), -1, np.int32)
                    fill_next_token_bitmask(m.deep_copy(), one)
                    drafted.append([int(rng.choice(np.flatnonzero(allowed_tokens(one, VOCAB)[0])))])
                rows_of = [(GrammarState(m, (kind, text)), (1 + drafts) * i, drafted[i] if drafts else [])
                           for i, m in enumerate(matchers)]
                t = time.perf_counter()
                if mode == "serial":  # what the engine does below PARALLEL_FROM rows: on the calling thread
                    mask = compiler.fill_masks(rows_of, batch * (1 + drafts))
                else:  # llguidance's executor threads
                    compiler._fill_parallel(rows_of, mask)
                t_mask.append(time.perf_counter() - t)
                nexts = [d[0] for d in drafted] if drafts else [
                    int(rng.choice(np.flatnonzero(allowed_tokens(mask[i], VOCAB)))) for i in range(batch)]
                t = time.perf_counter()
                allowed_tokens(mask[:1 + drafts], VOCAB)
                t_unpack.append(time.perf_counter() - t)
                t = time.perf_counter()
                for m, d in zip(matchers, nexts):
                    assert m.consume_token(d), m.get_error()
                t_commit.append(time.perf_counter() - t)
                n += 1
            rows.append({"grammar": name, "compile_s": round(compile_s, 3), "batch": batch, "fill": mode,
                         "mtp_drafts": drafts, "mask_rows_per_step": batch * (1 + drafts),
                         "mask_fill_per_step": _stats_us(t_mask),
                         "mask_fill_per_row_median_us": round(1e6 * statistics.median(t_mask) / (
                             batch * (1 + drafts)), 1),
                         "commit_per_step": _stats_us(t_commit),
                         "host_unpack_one_request": _stats_us(t_unpack)})
            print(json.dumps(rows[-1]))
    return rows


def device_part(reps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from flashnext_jax.device_sampling import SamplingInputs
    from flashnext_jax.step_programs import with_device_sampling
    from flashnext_jax.sampling import SamplingParams

    vocab = 4096 if SMOKE else VOCAB
    words = (vocab + 31) // 32

    def step(params, store, logits):
        return store, {"logits": logits, "draft_logits": jnp.zeros(logits.shape[:2] + (0, vocab), logits.dtype)}
    run = jax.jit(with_device_sampling(step), static_argnums=(4,))
    rows = []
    for batch, k1 in ((1, 1), (2, 1), (1, 2), (2, 2)):
        logits = jax.random.normal(jax.random.key(0), (batch, k1, vocab), jnp.float32)
        mask_host = np.full((batch, k1, words), -1, np.int32)
        mask_host[0] = np.random.default_rng(0).integers(-2**31, 2**31, (k1, words), dtype=np.int64)
        for sampled in (False, True):
            inputs = None
            if sampled:
                inputs = jax.device_put(SamplingInputs.for_rows(
                    [(SamplingParams(temperature=0.8, seed=1), 0)] * batch, batch))
            timings = {}
            for masked in (False, True):
                def once():
                    mask = jax.device_put(mask_host) if masked else None
                    _, out = run(None, None, logits, inputs, False, None, None, mask)  # run's argument order
                    return jax.block_until_ready(out["logits_argmax"])
                once()
                t = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    once()
                    t.append(time.perf_counter() - t0)
                timings["masked" if masked else "plain"] = _stats_us(t)
            rows.append({"batch": batch, "positions_per_row": k1, "sampled_on_device": sampled, "vocab": vocab,
                         **timings, "mask_adds_median_us": round(timings["masked"]["median_us"]
                                                                 - timings["plain"]["median_us"], 1)})
            print(json.dumps(rows[-1]))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["host", "device"], required=True)
    p.add_argument("--steps", type=int, default=20 if SMOKE else 200)
    p.add_argument("--out", help="JSON path (default $OUT or bench/results/structured_cost[_device].json)")
    args = p.parse_args()
    from bench.results_io import save_result

    if args.part == "host":
        import llguidance
        rows = host_part(args.steps)
        path = save_result("structured_cost.json", rows, args.out, part="host", vocab=VOCAB,
                           llguidance=llguidance.__version__, cpu_count=os.cpu_count(),
                           load_average_at_end=os.getloadavg(),
                           note="host cost: llguidance masks on this machine's CPU; device column = where jax ran")
    else:
        rows = device_part(args.steps)
        path = save_result("structured_cost_smoke.json" if SMOKE else "structured_cost_device.json", rows,
                           args.out, part="device", smoke=SMOKE)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
