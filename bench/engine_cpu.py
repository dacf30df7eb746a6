"""Tokens/s of `flashnext_jax.LLM.generate` vs transformers `generate` on the same tiny model, CPU, batch 1 and 2.

    /work/venv312/bin/python bench/engine_cpu.py [--new-tokens 64] [--out bench/results/engine_cpu.json]

The JAX half runs here (the embedded demo model, float32, through the full engine: scheduler, slot store, tickets,
host-side PLE gather, sampling on the host). The transformers half runs as a subprocess in the transformers venv
(`--hf-python`, default /work/venvfx/bin/python) on `tests/fixtures/tiny_causal`, which holds the same weights.
Both: greedy, float32, fixed prompt lengths, EOS ignored (exactly N new tokens per sequence), warm-up run first
(jit compilation / torch first-call overhead excluded), best of R timed runs. Throughput = generated tokens / s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HF_CHECKPOINT = ROOT / "tests" / "fixtures" / "tiny_causal"

HF_SCRIPT = r"""
import json, sys, time, torch, transformers
from transformers import Qwen4ExpForCausalLM
path, new, reps, prompts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
torch.manual_seed(0)
m = Qwen4ExpForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
res = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads()}
for bs in (1, 2):
    x = torch.tensor(prompts[:bs])
    kw = dict(attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new, min_new_tokens=new)
    with torch.inference_mode():
        m.generate(x, **kw)  # warm-up
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter(); out = m.generate(x, **kw); best = min(best, time.perf_counter() - t0)
    res[str(bs)] = {"seconds": best, "tokens": bs * new, "tokens_per_s": bs * new / best,
                    "first_output": out[0, x.shape[1]:].tolist()}
print(json.dumps(res))
"""


def run_jax(prompts, new, reps, spec_k: int = 0):
    import jax

    import flashnext_jax as fj

    spec = {"method": "mtp", "num_speculative_tokens": spec_k} if spec_k else None
    res = {"jax": jax.__version__, "backend": jax.default_backend()}
    for bs in (1, 2):
        llm = fj.LLM(None, dtype="float32", max_num_seqs=bs, max_num_batched_tokens=max(64, len(prompts[0]) * bs),
                     max_model_len=256, page_size=16, speculative_config=spec)
        sp = fj.SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        llm.generate(prompts[:bs], sp)  # warm-up: compiles every shape bucket this run uses
        best, outs = float("inf"), None
        for _ in range(reps):
            t0 = time.perf_counter()
            outs = llm.generate(prompts[:bs], sp)
            best = min(best, time.perf_counter() - t0)
        toks = sum(len(o.token_ids) for o in outs)
        res[str(bs)] = {"seconds": best, "tokens": toks, "tokens_per_s": toks / best,
                        "engine_steps": llm.engine.counters["steps"], "first_output": outs[0].token_ids,
                        "acceptance_rate": outs[0].metrics["acceptance_rate"]}
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hf-python", default="/work/venvfx/bin/python")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_cpu.json"))
    a = ap.parse_args()
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(1, 509) for _ in range(a.prompt_len)] for _ in range(2)]

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    hf = subprocess.run([a.hf_python, "-c", HF_SCRIPT, str(HF_CHECKPOINT), str(a.new_tokens), str(a.reps),
                         json.dumps(prompts)], capture_output=True, text=True, env=env, check=True)
    hf = json.loads(hf.stdout.strip().splitlines()[-1])
    jx = run_jax(prompts, a.new_tokens, a.reps)
    jx_mtp = run_jax(prompts, a.new_tokens, a.reps, spec_k=1)
    speed = {bs: jx[bs]["tokens_per_s"] / hf[bs]["tokens_per_s"] for bs in ("1", "2")}
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "setup": {"model": "embedded demo model (8 layers, vocab 512) == tests/fixtures/tiny_causal", "dtype": "float32",
                  "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "greedy": True, "reps": a.reps,
                  "timing": "best of reps after a warm-up run; generated tokens / wall seconds"},
        "transformers": hf, "flashnext_jax": jx, "flashnext_jax_mtp_k1": jx_mtp,
        "speedup_vs_transformers": speed, "target": 3.0,
        "target_met": all(v >= 3.0 for v in speed.values()),
        "outputs_equal_transformers": {bs: jx[bs]["first_output"] == hf[bs]["first_output"] for bs in ("1", "2")},
        "notes": ("What bounds flashnext_jax here: the host. A cProfile of batch 1 (64 decode steps, ~3.7 ms/step) "
                  "shows ~1.1 ms/step waiting on the jitted step (device compute on 2 cores) and the rest in "
                  "Python engine work: building the padded batch and its host->device transfers, the ledger's op "
                  "flush, host-side sampling/commit. Batch 2 amortises that overhead (tokens/s rises ~1.6x). "
                  "MTP k=1 is slower on this model because the demo model's MTP head is untrained (acceptance ~0): "
                  "every step pays for the draft and the verify token with no accepted drafts. transformers runs "
                  "eager PyTorch (per-op dispatch over 8 layers incl. MoE, QSA indexer, PLE) with 2 threads."),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"speedup": speed, "jax_tok_s": {b: jx[b]["tokens_per_s"] for b in ("1", "2")},
                      "hf_tok_s": {b: hf[b]["tokens_per_s"] for b in ("1", "2")},
                      "jax_mtp_tok_s": {b: jx_mtp[b]["tokens_per_s"] for b in ("1", "2")},
                      "outputs_equal": result["outputs_equal_transformers"]}, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
