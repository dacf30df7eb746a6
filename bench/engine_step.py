"""The serving engine at the real model size: decode tokens/s as users of `LLM` / `flashnext serve` get them.

bench/decode_step.py times `model.forward` alone. This runs the whole engine (`LLM` over `RealRunner`): scheduler,
tickets, the store (GDN state updated in place by the kernels, QSA K/V in pages), the host side (PLE rows, greedy
tokens, commit), with the same random INT4-Mixed weights (`decode_step.build`, 32 of 512 experts
kept: bytes per step as the full model). There is no real n-gram table here, so `host_prepare` returns random PLE
rows of the right shape (the real one gathers 8 rows per token from a host table). For each batch size: B
requests with `--prompt`-token prompts, greedy, `--tokens` new tokens each; reported: ms per engine step and
tokens/s over the steps where every request is decoding (compiles and prefill excluded), and the same step's
jitted device time.

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 bench/engine_step.py    # JSON to $OUT or bench/results
  ENGINE_BENCH_SMOKE=1 JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/engine_step.py # CPU check of this script

`--structured` (issue 17: a step with a constrained row <= 5% slower than without) times full engine decode steps
with all rows unconstrained vs row 0 constrained by a grammar (llguidance over a synthetic byte-level tokenizer of
the model's 248,320 tokens, bench/structured_cost.py: the random-weight model emits arbitrary allowed tokens), at
B = 1 and 2, greedy and sampled (temperature 0.7, top_p 0.9: device sampling), on ONE engine: 1-token prompts, so
the prompt's step has the decode shape, and page tables at their full width, so the whole run compiles two model
steps (B = 1, 2) plus a few small samplers. Rounds alternate plain and constrained runs; reported: the median ms
per step of each, their ratio (summary "constrained_over_plain_b{B}_{greedy|sampled}", the JSON-schema grammar)
and the host time of the masks. Grammars: "json" = an object with one string field of minLength 3000 (what a
JSON answer's text field costs: cheap masks), "regex" = [a-z ]{0,4000} (a lexeme admitting most word pieces:
llguidance's worst case, docs/structured-output.md "Cost"); neither can end within the steps timed. MTP is not
measured here (the model is built without MTP tensors; MTP decode steps at the real size: bench/real_size.py; the
epilogue with draft masks: bench/structured_cost.py --part device).

  PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/engine_step.py --structured  # H200, one run, ~6 min
  ENGINE_BENCH_SMOKE=1 JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/engine_step.py --structured  # CPU check
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import logging
import os
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from bench import decode_step
from bench.results_io import save_result
from flashnext_jax import api
from flashnext_jax.config import from_hf_config
from flashnext_jax.llm import LLM
from flashnext_jax.runner import RealRunner
from flashnext_jax.sampling import SamplingParams

SMOKE = bool(os.environ.get("ENGINE_BENCH_SMOKE"))


class RandomPleRunner(RealRunner):
    """RealRunner whose PLE rows come from a small random table (no n-gram table at this size here); everything
    else is the engine's. A row's PLE input depends only on its own token and position, as the real table's does,
    so a request's tokens do not change with the batch it is in (bench/pp_gpus.py compares PP=2 with PP=1)."""

    TABLE_ROWS = 4096

    @functools.cached_property
    def _random_table(self) -> np.ndarray:
        rng = np.random.default_rng(0)
        return (rng.standard_normal((self.TABLE_ROWS, self.cfg.ple_embed_dim)) * 0.02).astype(np.float32)

    def _ngram_rows(self, rows, T: int):
        if not self.n_ple:
            return {}
        out = np.zeros((len(rows), T, self.cfg.ple_embed_dim), np.float32)
        for b, row in enumerate(rows):
            if row is not None and len(row.tokens):
                pos = row.start + np.arange(len(row.tokens))
                out[b, : len(row.tokens)] = self._random_table[(np.asarray(row.tokens) * 7919 + pos) % self.TABLE_ROWS]
        return {"ple_rows": out}

    # async scheduling: the same rows for a chained token, on the device
    chain_context_len = 0

    def place_chain_inputs(self) -> dict:
        return {"table": jax.device_put(self._random_table)} if self.n_ple else {}

    def chained_host_inputs(self, chain_params: dict, tokens, positions, context) -> dict:
        if not self.n_ple:
            return {}
        return {"ple_rows": chain_params["table"][(tokens * 7919 + positions) % self.TABLE_ROWS]}


_PHASED = ("_build_batch", "_launch_model_step", "_choose_tokens", "_commit")


def time_phases(eng) -> tuple[dict[str, list[float]], Callable[[], None]]:
    """Host-time breakdown of the engine's steps: wraps the step's phases (on the instance) so that each call
    appends its wall time in seconds to phases[name] (build_batch, dispatch, device_wait: the host waiting for the
    model step after launching it, sampler: the second program of a step (step_programs.choose_tokens: device sampling,
    logprobs, bias) launch to result, commit). The waits serialise host and device within a step (what a step
    costs, phase by phase). Returns (phases, restore), restore() removing the wrappers."""
    phases = {"build_batch": [], "dispatch": [], "device_wait": [], "sampler": [], "commit": []}

    def timed(name, fn, wait=None):
        def run(*a):
            t0 = time.perf_counter()
            out = fn(*a)
            phases[name].append(time.perf_counter() - t0)
            if wait:
                t0 = time.perf_counter()
                jax.block_until_ready(out)
                phases[wait].append(time.perf_counter() - t0)
            return out
        return run

    eng._build_batch = timed("build_batch", eng._build_batch)
    eng._launch_model_step = timed("dispatch", eng._launch_model_step, wait="device_wait")
    eng._choose_tokens = timed("sampler", eng._choose_tokens, wait="sampler")
    eng._commit = timed("commit", eng._commit)

    def restore():
        for attr in _PHASED:
            eng.__dict__.pop(attr, None)
    return phases, restore


def run_batch(model, bsz: int, prompt_len: int, new_tokens: int, page_size: int = 16,
              sampling: dict | None = None) -> dict:
    sampling = sampling or {"temperature": 0.0}
    max_len = prompt_len + new_tokens + 16
    lm = LLM(RandomPleRunner(model, 0), max_num_seqs=bsz, max_num_batched_tokens=bsz * prompt_len,
             max_model_len=max_len, page_size=page_size,  # all prompts in one prefill step
             num_pages=bsz * -(-max_len // page_size) + 8)  # a pool of what the rows need: runs stay independent
    eng = lm.engine
    phases, _ = time_phases(eng)
    rng = np.random.default_rng(bsz)
    reqs = [lm._add(rng.integers(0, model.cfg.vocab_size, prompt_len).tolist(),
                    SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=i, **sampling)) for i in range(bsz)]
    step_times, profile, phase_ms, t_start = [], {}, {}, time.perf_counter()
    while any(not r.finished for r in reqs):
        decoding = all(len(r.output) >= 2 for r in reqs)  # every row past its prompt and its first decode step
        if decoding and len(step_times) == 8 and not profile and not SMOKE:
            # device time of a decode engine step (4 steps: 1 warm + 3 profiled; host work excluded)
            from bench.quant_matmul import device_time
            dev, top = device_time(lambda: lm.engine.step() and jnp.zeros(()), reps=3, top=8)
            profile = {"device_ms_per_step": dev * 1e3 if dev else None,
                       "top_kernels_ms_per_step": {k: v * 1e3 for k, v in top.items()}}
            continue
        for v in phases.values():
            v.clear()
        t0 = time.perf_counter()
        lm.engine.step()
        if decoding and not any(r.finished for r in reqs):
            step_times.append(time.perf_counter() - t0)
            for name, v in phases.items():
                phase_ms.setdefault(name, []).append(sum(v) * 1e3)
    total_s = time.perf_counter() - t_start
    ms = float(np.median(step_times)) * 1e3 if step_times else float("nan")
    row = dict(batch=bsz, prompt=prompt_len, new_tokens=new_tokens, sampling=sampling,
               decode_steps_timed=len(step_times), compiles_ahead=eng.counters["compiles_ahead"],
               ms_per_step=ms, mean_ms_per_step=float(np.mean(step_times)) * 1e3 if step_times else float("nan"),
               tokens_per_s=bsz / ms * 1e3, total_s=total_s, engine_steps=lm.engine.counters["steps"],
               host_phase_median_ms={k: float(np.median(v)) for k, v in phase_ms.items()}, **profile)
    return row


STRUCTURED_GRAMMARS = {
    "json": {"json": {"type": "object", "properties": {"text": {"type": "string", "minLength": 3000,
                                                                "maxLength": 4000}},
                      "required": ["text"], "additionalProperties": False}},
    "regex": {"regex": "[a-z ]{0,4000}"},
}
STRUCTURED_SAMPLING = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.9}}


def structured_runs(model, batches: list[int], grammars: list[str], steps: int, rounds: int,
                    page_size: int = 16) -> tuple[list[dict], dict]:
    """Per (B, sampling, grammar): median ms per engine decode step with no constrained row and with row 0
    constrained, over `rounds` alternating runs of `steps` timed steps each, all on one LLM (see the docstring)."""
    import llguidance

    from bench.structured_cost import SyntheticTokenizer
    from flashnext_jax.structured_output import GrammarCompiler, StructuredOutputsParams

    vocab = model.cfg.vocab_size
    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(SyntheticTokenizer(vocab)), n_vocab=vocab)
    print(f"llguidance tokenizer of {vocab} tokens built in {time.perf_counter() - t0:.1f} s", flush=True)
    warm = 3  # steps before timing: the prompt's step, the first decode step, one more
    max_len = 1 + warm + steps + 16
    bmax = max(batches)
    lm = LLM(RandomPleRunner(model, 0), max_num_seqs=bmax, max_num_batched_tokens=bmax, max_model_len=max_len,
             page_size=page_size, num_pages=bmax * -(-max_len // page_size) + 8, page_table_width="max",
             compile_ahead=False)
    eng = lm.engine
    eng.grammar_compiler = GrammarCompiler(None, vocab, lltokenizer=lltok)
    mask_s: list[float] = []
    token_masks = eng._token_masks

    def timed_masks(t):  # host time of the masks (inside the step's wall time)
        t0 = time.perf_counter()
        out = token_masks(t)
        if out is not None:
            mask_s.append(time.perf_counter() - t0)
        return out
    eng._token_masks = timed_masks
    rng = np.random.default_rng(0)

    def one_run(bsz, sampling, grammar):
        reqs = []
        for i in range(bsz):
            so = StructuredOutputsParams(**STRUCTURED_GRAMMARS[grammar]) if grammar and i == 0 else None
            reqs.append(lm._add([int(rng.integers(0, vocab))], SamplingParams(
                max_tokens=warm + steps, ignore_eos=True, seed=i, structured_outputs=so, **sampling)))
        times, n_masks = [], len(mask_s)
        while any(not r.finished for r in reqs):
            t0 = time.perf_counter()
            eng.step()
            if all(len(r.output) >= warm for r in reqs) and not any(r.finished for r in reqs):
                times.append(time.perf_counter() - t0)
        return times, mask_s[n_masks:], [r.finish_reason for r in reqs]

    rows, summary = [], {}
    for bsz in batches:
        for sname, sampling in STRUCTURED_SAMPLING.items():
            for grammar in grammars:
                one_run(bsz, sampling, grammar)  # compiles (model step at the first B, samplers), untimed
                one_run(bsz, sampling, None)
                plain, constrained, masks, finish = [], [], [], []
                for _ in range(rounds):
                    plain += one_run(bsz, sampling, None)[0]
                    t, m, f = one_run(bsz, sampling, grammar)
                    constrained += t
                    masks += m
                    finish.append(f[0])
                p_ms, c_ms = float(np.median(plain)) * 1e3, float(np.median(constrained)) * 1e3
                row = dict(batch=bsz, sampling=sname, grammar=grammar, plain_ms_per_step=p_ms,
                           constrained_ms_per_step=c_ms, constrained_over_plain=c_ms / p_ms,
                           plain_p90_ms=float(np.percentile(plain, 90)) * 1e3,
                           constrained_p90_ms=float(np.percentile(constrained, 90)) * 1e3,
                           mask_host_median_ms=float(np.median(masks)) * 1e3 if masks else float("nan"),
                           steps_timed=[len(plain), len(constrained)], constrained_finish=finish)
                print(row, flush=True)
                rows.append(row)
                if grammar == "json":
                    summary[f"constrained_over_plain_b{bsz}_{sname}"] = round(c_ms / p_ms, 4)
    summary.update(compiles=eng.counters["compiles"], sampler_compiles=eng.counters["sampler_compiles"])
    return rows, summary


def print_structured(rows: list[dict]):
    print(f"\n{'B':>3} {'sampling':<8} {'grammar':<7} {'plain ms':>9} {'constr ms':>9} {'ratio':>7} {'mask ms':>8} "
          f"{'steps':>9}")
    for r in rows:
        if "error" in r:
            print(r)
            continue
        print(f"{r['batch']:3d} {r['sampling']:<8} {r['grammar']:<7} {r['plain_ms_per_step']:9.3f} "
              f"{r['constrained_ms_per_step']:9.3f} {r['constrained_over_plain']:7.4f} "
              f"{r['mask_host_median_ms']:8.3f} {'/'.join(map(str, r['steps_timed'])):>9}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--batch", default="1,2")
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--structured", action="store_true", help="plain vs one constrained row (see the docstring)")
    ap.add_argument("--grammars", default="json,regex", help="--structured: of " + ",".join(STRUCTURED_GRAMMARS))
    ap.add_argument("--steps", type=int, default=64, help="--structured: timed steps per run")
    ap.add_argument("--rounds", type=int, default=3, help="--structured: plain/constrained run pairs")
    ap.add_argument("--sampling", action="append", default=None,
                    help='SamplingParams fields, e.g. "temperature=0.7,top_p=0.9"; repeat for several runs (default '
                         'greedy)')
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(threadName)s %(name)s: %(message)s")
    logging.getLogger("flashnext_jax").setLevel(logging.INFO)  # the engine's compiles (ahead or not)
    with open(decode_step.DEMO_CONFIG if SMOKE else decode_step.REAL_CONFIG) as f:
        cfg = from_hf_config(json.load(f))
    cfg = dataclasses.replace(cfg, num_experts=min(args.experts, cfg.num_experts))
    dev = jax.devices()[0]
    print(f"{dev.device_kind} jax {jax.__version__} kernels={os.environ.get('FLASHNEXT_KERNELS', 'auto')}", flush=True)
    t0 = time.perf_counter()
    params, always, per_expert = decode_step.build(cfg, jax.random.key(0))
    jax.block_until_ready(params)
    print(f"built params in {time.perf_counter() - t0:.1f} s", flush=True)
    model = api.Model(cfg, params, table=None, dtype=jnp.bfloat16)
    if args.structured:
        t0 = time.perf_counter()
        rows, summary = structured_runs(model, [int(b) for b in args.batch.split(",")], args.grammars.split(","),
                                        4 if SMOKE else args.steps, 1 if SMOKE else args.rounds, args.page_size)
        summary.update(device=dev.device_kind, jax_version=jax.__version__,
                       date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       seconds=round(time.perf_counter() - t0, 1))
        print("summary", json.dumps(summary), flush=True)
        path = save_result("engine_step_structured.json", rows, args.out, smoke=SMOKE, summary=summary,
                           steps=args.steps, rounds=args.rounds, grammars=STRUCTURED_GRAMMARS)
        print(f"wrote {path}")
        print_structured(rows)
        return
    rows = []
    samplings = [{k: float(v) if "." in v else int(v) for k, v in (kv.split("=") for kv in spec.split(","))}
                 for spec in args.sampling or ["temperature=0.0"]]
    for bsz, sampling in ((int(b), sp) for b in args.batch.split(",") for sp in samplings):
        try:
            row = run_batch(model, bsz, 16 if SMOKE else args.prompt, 6 if SMOKE else args.tokens, args.page_size,
                            sampling)
            row["weight_bytes_per_step"] = always + min(cfg.num_experts, cfg.num_experts_per_tok * bsz) * per_expert
        except Exception as e:  # noqa: BLE001
            row = dict(batch=bsz, error=repr(e)[:400])
        print(row, flush=True)
        rows.append(row)
    save_result("engine_step.json", rows, args.out, smoke=SMOKE, prompt=args.prompt, page_size=args.page_size)
    print(f"\n{'B':>3} {'sampling':<28} {'ms/step':>8} {'tok/s':>8} {'device ms':>9} {'steps timed':>11}")
    for r in rows:
        sp = ",".join(f"{k}={v}" for k, v in r.get("sampling", {}).items())
        print(f"{r['batch']:3d} {sp:<28} {r.get('ms_per_step', float('nan')):8.2f} "
              f"{r.get('tokens_per_s', float('nan')):8.1f} {r.get('device_ms_per_step', float('nan')):9.2f} "
              f"{r.get('decode_steps_timed', 0):11d}")


if __name__ == "__main__":
    main()
