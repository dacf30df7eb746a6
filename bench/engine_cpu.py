"""Tokens/s of `flashnext_jax.LLM.generate` vs transformers `generate` on the same tiny model, CPU, batch 1 and 2.

    .venv/bin/python bench/engine_cpu.py [--new-tokens 64] [--reps 3] [--rounds 3] [--spec-k 1,2] [--hf-python none]

MTP: the engine without MTP and with each `--spec-k` draft count run in turn, `--rounds` times (one engine at a
time; on the shared 2-core machine single runs scatter by 0.85-1.1x and drift between rounds): tokens/s are the
median of the rounds' best-of-reps, MTP's speed-up the median of the per-round ratios to the run without MTP just
before it; greedy MTP output must equal the output without MTP.

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


PROMPT_TEXTS = [
    "The module defines the following functions, which return a new list of the items in the order they were "
    "inserted. If the argument is omitted, the default value is used and an exception is raised.",
    "def read_config(path, encoding='utf-8'):\n    \"\"\"Return the parsed contents of the file at path.\"\"\"\n"
    "    with open(path, encoding=encoding) as f:\n        return f.read()\n",
]


def run_jax(prompts, new, reps, spec_k: int = 0):
    """One engine at a time: two live engines slow each other on 2 cores (their background compiles and threads;
    stop 33 measured a plain batch-1 run at 0.16-0.19 s alone and 0.31-0.40 s with an MTP engine beside it)."""
    import jax

    import flashnext_jax as fj

    spec = {"method": "mtp", "num_speculative_tokens": spec_k} if spec_k else None
    res = {"jax": jax.__version__, "backend": jax.default_backend()}
    for bs in (1, 2):
        llm = fj.LLM(None, dtype="float32", max_num_seqs=bs, max_num_batched_tokens=max(64, len(prompts[0]) * bs),
                     max_model_len=256, page_size=16, speculative_config=spec)
        sp = fj.SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        llm.generate(prompts[:bs], sp)  # warm-up: compiles every shape bucket this run uses
        llm.engine._ahead.wait_all()  # and the wider steps it started compiling in the background (compile_ahead.py):
        # on 2 cores a background compile (~7 s for an MTP step) would share the timed runs' cores
        steps_before = llm.engine.counters["steps"]
        best, outs = float("inf"), None
        for _ in range(reps):
            t0 = time.perf_counter()
            outs = llm.generate(prompts[:bs], sp)
            best = min(best, time.perf_counter() - t0)
        toks = sum(len(o.token_ids) for o in outs)
        res[str(bs)] = {"seconds": best, "tokens": toks, "tokens_per_s": toks / best,
                        "engine_steps_per_run": (llm.engine.counters["steps"] - steps_before) / reps,
                        "first_output": outs[0].token_ids, "acceptance_rate": outs[0].metrics["acceptance_rate"]}
        del llm
    return res


def median_run(runs: list[dict]) -> dict:
    """The run_jax result whose batch-1 tokens/s is the median of `runs` (its batch-2 figures: their median)."""
    pick = sorted(runs, key=lambda r: r["1"]["tokens_per_s"])[len(runs) // 2]
    b2 = sorted(runs, key=lambda r: r["2"]["tokens_per_s"])[len(runs) // 2]
    return pick | {"2": b2["2"]}


LOAD_BEFORE = os.getloadavg()[0]
NOTE_SHARED = ""


def main():
    global NOTE_SHARED
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5, help="runs of every configuration, in turn (median)")
    ap.add_argument("--spec-k", default="1,2", help="MTP draft tokens to time beside no MTP (comma-separated)")
    ap.add_argument("--hf-python", default="/work/venvfx/bin/python",
                    help="the transformers venv's python, or 'none' to time only flashnext_jax (MTP vs no MTP)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_cpu.json"))
    ap.add_argument("--note", default="", help="free text recorded in the notes (e.g. that the machine was shared)")
    a = ap.parse_args()
    NOTE_SHARED = a.note + " " if a.note else ""
    from flashnext_jax.api import DEMO_MODEL
    from flashnext_jax.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(DEMO_MODEL)  # text prompts: the trained demo model's MTP acceptance is about real text
    prompts = [tok.encode(t)[: a.prompt_len] for t in PROMPT_TEXTS]
    assert all(len(p) == a.prompt_len for p in prompts), "prompt texts too short for --prompt-len"

    if a.hf_python == "none":  # no transformers venv on this machine: the JAX half only (MTP vs no MTP)
        hf = None
    else:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
        hf = subprocess.run([a.hf_python, "-c", HF_SCRIPT, str(HF_CHECKPOINT), str(a.new_tokens), str(a.reps),
                             json.dumps(prompts)], capture_output=True, text=True, env=env, check=True)
        hf = json.loads(hf.stdout.strip().splitlines()[-1])
    ks = [int(k) for k in a.spec_k.split(",")]
    rounds: dict[int, list] = {k: [] for k in [0, *ks]}
    for _ in range(a.rounds):  # the configurations in turn, so that a slow spell of the machine hits them all
        for k in rounds:
            rounds[k].append(run_jax(prompts, a.new_tokens, a.reps, spec_k=k))
    runs = {k: median_run(v) for k, v in rounds.items()}
    jx, jx_mtp = runs[0], runs[1 if 1 in ks else ks[0]]
    speed = {bs: jx[bs]["tokens_per_s"] / hf[bs]["tokens_per_s"] if hf else None for bs in ("1", "2")}

    def paired(k, bs):  # MTP's speed-up: the median over rounds of the ratio within each round (drift cancels)
        ratios = sorted(r[bs]["tokens_per_s"] / r0[bs]["tokens_per_s"] for r, r0 in zip(rounds[k], rounds[0]))
        return ratios[len(ratios) // 2]

    by_k = {k: {bs: paired(k, bs) for bs in ("1", "2")} for k in ks}
    mtp_speed = by_k[1 if 1 in ks else ks[0]]
    best_k = max(ks, key=lambda k: by_k[k]["1"])
    result = {
        "summary": {"mtp_k1_speedup_b1": mtp_speed["1"], "mtp_k1_speedup_b2": mtp_speed["2"],
                    "mtp_acceptance_b1": jx_mtp["1"]["acceptance_rate"],
                    "mtp_outputs_equal_no_mtp_b1": jx_mtp["1"]["first_output"] == jx["1"]["first_output"],
                    "tok_s_b1": jx["1"]["tokens_per_s"], "tok_s_b1_mtp": jx_mtp["1"]["tokens_per_s"],
                    "mtp_speedup_b1_by_k": {str(k): by_k[k]["1"] for k in ks},
                    "mtp_speedup_b2_by_k": {str(k): by_k[k]["2"] for k in ks},
                    "mtp_acceptance_b1_by_k": {str(k): runs[k]["1"]["acceptance_rate"] for k in ks},
                    "mtp_best_k_b1": best_k, "mtp_best_speedup_b1": by_k[best_k]["1"],
                    "mtp_outputs_equal_no_mtp_all_k": all(runs[k][bs]["first_output"] == jx[bs]["first_output"]
                                                          for k in ks for bs in ("1", "2")),
                    "speedup_vs_transformers_b1": speed["1"], "machine_load_1min_before": LOAD_BEFORE,
                    "device": "cpu", "date": datetime.date.today().isoformat()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "setup": {"model": "embedded demo model, trained (8 layers, vocab 512) == tests/fixtures/tiny_causal",
                  "prompts": "first prompt_len tokens of PROMPT_TEXTS (English, Python)", "dtype": "float32",
                  "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "greedy": True, "reps": a.reps,
                  "timing": "best of reps after a warm-up run; generated tokens / wall seconds; flashnext_jax: the "
                            "median over rounds, the configurations run in turn; MTP speed-ups: the median of "
                            "the per-round ratios", "rounds": a.rounds},
        "transformers": hf, "flashnext_jax": jx, "flashnext_jax_mtp_k1": jx_mtp,
        "flashnext_jax_mtp_by_k": {str(k): runs[k] for k in ks},
        "tokens_per_s_b1_each_round": {str(k): [r["1"]["tokens_per_s"] for r in v] for k, v in rounds.items()},
        "speedup_vs_transformers": speed, "target": 3.0,
        "target_met": all(v >= 3.0 for v in speed.values()) if hf else None,
        "outputs_equal_transformers": {bs: jx[bs]["first_output"] == hf[bs]["first_output"] if hf else None
                                       for bs in ("1", "2")},
        "mtp_k1_speedup_vs_no_mtp": mtp_speed, "mtp_target": 1.3, "mtp_target_met_batch1": by_k[best_k]["1"] >= 1.3,
        "mtp_outputs_equal_no_mtp": {bs: jx_mtp[bs]["first_output"] == jx[bs]["first_output"] for bs in ("1", "2")},
        "machine_load_1min_before_after": [LOAD_BEFORE, os.getloadavg()[0]],
        "notes": (NOTE_SHARED + "What bounds flashnext_jax here: the host. A cProfile of batch 1 (64 decode steps, ~3.7 ms/step) "
                  "shows ~1.1 ms/step waiting on the jitted step (device compute on 2 cores) and the rest in "
                  "Python engine work: building the padded batch and its host->device transfers, the ledger's op "
                  "flush, host-side sampling/commit. Batch 2 amortises that overhead (tokens/s rises ~1.6x). "
                  "MTP on the trained demo model: see summary.mtp_speedup_b1_by_k and the acceptance rates. "
                  "transformers runs "
                  "eager PyTorch (per-op dispatch over 8 layers incl. MoE, QSA indexer, PLE) with 2 threads."),
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"speedup": speed, "jax_tok_s": {b: jx[b]["tokens_per_s"] for b in ("1", "2")},
                      "hf_tok_s": {b: hf[b]["tokens_per_s"] if hf else None for b in ("1", "2")},
                      "jax_mtp_tok_s": {b: jx_mtp[b]["tokens_per_s"] for b in ("1", "2")},
                      "mtp_speedup": mtp_speed, "acceptance": {b: jx_mtp[b]["acceptance_rate"] for b in ("1", "2")},
                      "mtp_speedup_b1_by_k": {k: by_k[k]["1"] for k in ks},
                      "outputs_equal": result["outputs_equal_transformers"]}, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
