#!/usr/bin/env python
"""Retrain a checkpoint's MTP head on the model's own greedy continuations (self-distillation), issue 20.

A draft is accepted when it equals the model's own next-next greedy token, and the engine drafts along the model's
own output, not along human text. So the head is trained (`training.train_mtp`, target="model") on what the model
writes: greedy continuations of `--prompts` random 32-token snippets of the demo corpus (tools/train_demo.py
CORPUS_FILES; the bench prompts of bench/engine_cpu.py are not among them). Acceptance is measured before and after
along the model's greedy continuation of each bench prompt (`training.mtp_acceptance`).

    PYTHONPATH=. JAX_PLATFORMS=cpu .venv/bin/python tools/distill_mtp.py [--prompts 1024] [--steps 1500]
        [--write CHECKPOINT_DIR] [--out result.json]

Measured on the 2-core machine (stop 38, demo model, float32, the defaults: bench/results/distill_mtp_cpu.json):
1,024 prompts x 64 tokens (51 s to generate), 1,500 steps of 16 x 96 tokens (110 s): acceptance along the bench
prompts 0.54 -> 0.71 and 0.65 -> 0.71. `--write` replaces the checkpoint's mtp.* tensors atomically
(`mtp_checkpoint.write_mtp`); the demo model's transformers fixtures hold MTP logits, so re-record them
(tools/make_fixtures.py) after writing into flashnext_jax/demo_model/.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import flashnext_jax as fj  # noqa: E402
from bench.engine_cpu import PROMPT_TEXTS  # noqa: E402
from flashnext_jax import mtp_checkpoint  # noqa: E402
from flashnext_jax.tokenizer import Tokenizer  # noqa: E402
from flashnext_jax.training import mtp_acceptance, train_mtp  # noqa: E402
from train_demo import CORPUS_FILES, read_files  # noqa: E402

PROMPT_LEN = 32


def corpus_prompts(tok: Tokenizer, n: int, seed: int) -> list[list[int]]:
    """n random PROMPT_LEN-token snippets of the training corpus."""
    texts = read_files(CORPUS_FILES)
    encoded = [tok.encode(t) for t in texts]
    encoded = [e for e in encoded if len(e) > PROMPT_LEN + 8]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = encoded[rng.integers(len(encoded))]
        s = int(rng.integers(0, len(ids) - PROMPT_LEN - 8))
        out.append(ids[s:s + PROMPT_LEN])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the embedded demo model)")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--learning-rate", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", default=None, help="write the new head into this checkpoint directory")
    ap.add_argument("--out", default=None, help="JSON with the acceptances before and after")
    a = ap.parse_args()

    model = fj.load(a.checkpoint, dtype="float32")
    llm = fj.LLM(model, dtype="float32", max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256, page_size=16)
    tok = Tokenizer.from_dir(model.path)
    sp = fj.SamplingParams(temperature=0.0, max_tokens=a.new_tokens, ignore_eos=True)

    t0 = time.perf_counter()
    prompts = corpus_prompts(tok, a.prompts, a.seed)
    seqs = [p + list(o.token_ids) for p, o in zip(prompts, llm.generate(prompts, sp))]
    gen_s = time.perf_counter() - t0
    bench = [tok.encode(t)[:PROMPT_LEN] for t in PROMPT_TEXTS]
    bench_out = [list(o.token_ids) for o in llm.generate(bench, sp)]
    # along the model's output: the last prompt token and the continuation (what the engine drafts on)
    along = [p[-1:] + o for p, o in zip(bench, bench_out)]
    before = [mtp_acceptance(model, s) for s in along]

    t0 = time.perf_counter()
    res = train_mtp(model, seqs, steps=a.steps, seq_len=96, batch_size=16, learning_rate=a.learning_rate,
                    seed=a.seed, target="model")
    train_s = time.perf_counter() - t0
    after = [mtp_acceptance(model, s, res.params) for s in along]
    result = {"device": jax.default_backend(), "jax_version": jax.__version__,
              "date": datetime.date.today().isoformat(), "prompts": a.prompts, "new_tokens": a.new_tokens,
              "steps": a.steps, "learning_rate": a.learning_rate,
              "generate_s": gen_s, "train_s": train_s, "loss_first_last": [res.losses[0], res.losses[-1]],
              "acceptance_before": before, "acceptance_after": after}
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    if a.write:
        print("rewrote", mtp_checkpoint.write_mtp(a.write, model.cfg, res.params))


if __name__ == "__main__":
    main()
