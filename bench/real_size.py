"""Decode speed of the real engine at the real model size (issue 16): tokens/s per stream at B = 1 and 2, at 4K and 32K
context, greedy and sampled (temperature 0.7, top-p 0.9), MTP off and on (one draft token); what a step moves and
where its time goes.

What runs: `LLM` over `RealRunner` (scheduler, tickets, store, kernels, commit: what `flashnext serve` runs) on the
real config with random weights in the INT4-Mixed layout (`decode_step.build`: all 512 routed experts by default,
~67 GB, and the MTP head in BF16 as the release stores it, ~5 GB; `--mtp-quantized`: the head in the decoder's
scheme) and random PLE rows (`engine_step.RandomPleRunner`: no n-gram table at this size). One engine per MTP
setting: "plain" (k = 0) for 4K and 32K, "mtp" (k = 1) for 4K; `--mtp-32k` adds an MTP engine for 32K;
`--async-scheduling` adds "async", the plain engine's twin (its runner, pool and compiled steps) with
EngineConfig.async_scheduling, run right after each plain configuration ("ratios": async_tokens_per_s_over_plain).

The BF16 head's routed experts go through `moe.routed_experts_reference`, an XLA gather of every token's 10 experts
(~0.1 GB per token), but only where the head drafts (the tail columns): in a prefill step it folds the chunk's
pairs into its cache, and XLA drops its attention and MoE there (tests/test_mtp_prefill_memory.py), so the MTP
engines prefill in the plain engine's chunk unless `--mtp-chunk` says otherwise (before stop 46: 64).

Few compiled shapes (~1 minute each at the real size): every engine compiles, before any request, one prefill step
(B = 1, its chunk: the only prefill bucket) and one decode step per B, with the engine's own `precompile`
(`--compile-threads` of them at once), then runs its `warm_up`. Each engine has one page-table width
(`page_table_width="max"`, so nothing compiles as contexts grow); its max_model_len is its longest context plus what
the runs decode, so that width is the bucket a request at that context gets anyway (plain: max_model_len's, as the
engine always does without MTP; mtp: the bucket of a 4K context). A context is reached with no B = 2 prefill step:
one request prefills the context's prompt alone (B = 1: the prefill figure; prefix caching on, a snapshot every
4K tokens), and every decode run's rows are that prompt plus one token of their own, restored from the snapshot, so
their first step already has the decode shape (the last tokens differ: so does their routing, as two users' would).

Acceptance: with random weights the MTP head's drafts are almost never the model's choice. `forced_acceptance`
(bench only: a monkeypatch of the two verification functions the engine's commit calls, restored on exit) makes the
engine accept the drafts by a pattern: "none", "all" or "alternate" (all, none, all, ... per request), so the
verify step (2 tokens per row) and the draft (computed in every MTP step) are timed with the engine's own
bookkeeping for each outcome. Greedy rows take the model's argmax after the accepted drafts; sampled rows (verified
on the device since stop 49) take the accepted drafts and the device's token of the column after them. Random-weight
logits are flat, so top-p (sampled rows) takes its full-sort fallback: slower than a trained model's peaked
distributions.

Per configuration (engine, context, B, sampling, pattern): `--warm` steps untimed (the rows' first token, first
launches, a new sampler), `--steps` steps timed one by one (ms per step: median; tokens/s: tokens emitted over the
timed steps' wall time), `--phase-steps` steps with the host phases timed (`engine_step.time_phases`), and
`--profile-steps` steps under the profiler (`device_profile.timeline`: kernels per step, device busy time; host gap
= the step's mean wall time minus the device's busy time). Weight bytes per step (`WeightBytes.per_step`): every
weight read whatever the routing once, each routed expert a step's tokens can pick once per layer (top-10 x tokens,
at most 512), and with MTP the head once for the step's pairs and once per draft call (K1 = 2 columns x 1 draft),
each draft call also reading lm_head; against the copy bandwidth measured in the same run
(`quant_matmul.copy_bandwidth`).

Configurations run in ORDER (the summary's first); past `--deadline-s` (540 s, the device runs a command for at
most 600) the rest are skipped, and the JSON is rewritten after every configuration. Writes `--out` (default
bench/results/real_size.json, or $OUT/real_size.json) with the issue's "summary"
(SUMMARY_KEYS: B = 1 figures plain greedy; verify_over_decode_cost: the MTP step, pattern all, over the plain step;
kernels_per_step: the plain B = 1 4K step), "ratios" (sampled over greedy, MTP step over plain step, MTP speed-up per
pattern, two streams over one) and one row per configuration; prints a table last.

  H200, one call (~7-9 min: weights ~2 min, 6 compiles 3 at a time ~2.5 min, runs ~2 min; `--quick`: B = 1, greedy,
  4K, pattern all, 4 compiles; `--experts 32` draws ~1 min less, same bytes per step):
    PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 bench/real_size.py
  CPU check of the whole path on a 2-layer demo-sized model (~1 min on 2 cores; tests/test_bench_real_size.py):
    JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/real_size.py --tiny --out /tmp/real_size_tiny.json
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # before jax starts: with jax's 0.75 the 512-expert weights do not fit (lessons-learned)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax
import jax.numpy as jnp
import numpy as np

from bench import decode_step, device_profile
from bench.engine_step import RandomPleRunner, time_phases
from bench.quant_matmul import copy_bandwidth
from bench.results_io import save_result
from flashnext_jax import api, sampling
from flashnext_jax.config import from_hf_config
from flashnext_jax.llm import LLM
from flashnext_jax.sampling import SamplingParams

SUMMARY_KEYS = ("decode_tok_s_b1_4k", "decode_tok_s_b1_32k", "two_stream_aggregate_over_one",
                "verify_over_decode_cost", "kernels_per_step", "fraction_of_copy_bw_b1_4k", "prefill_32k_s",
                "device", "jax_version", "date")
SAMPLINGS = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.9}}
PATTERNS = ("all", "none", "alternate")
# (engine, context, sampling) in the order they run, the summary's first, so that a --deadline-s cut drops the least
ORDER = (("plain", "4k", "greedy"), ("async", "4k", "greedy"), ("mtp", "4k", "greedy"), ("plain", "4k", "sampled"),
         ("async", "4k", "sampled"), ("plain", "32k", "greedy"), ("async", "32k", "greedy"), ("mtp", "4k", "sampled"),
         ("plain", "32k", "sampled"), ("mtp_32k", "32k", "greedy"), ("mtp_32k", "32k", "sampled"))

_COMPILES: list[float] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: _COMPILES.append(secs) if event == "/jax/core/compile/backend_compile_duration" else None)


# ------------------------------------------------------------------------------------------ forced acceptance


@contextlib.contextmanager
def forced_acceptance(pattern: str | None):
    """Inside the block, the engine's MTP verification accepts drafts by `pattern` instead of by the logits:
    "none" (0 accepted), "all" (every draft), "alternate" (all, none, all, ... counted per request). pattern None:
    nothing changes.

    Bench only: replaces `sampling.verify_argmax` (greedy rows: the tokens are the accepted drafts and the device's
    argmax after them, as the real function returns them), `sampling.verify_sampled` (sampled rows verified on the
    device: the accepted drafts and the device's token of the column after them) and `sampling.verify` (rows
    sampled on the host, with penalties: the real function, given draft probabilities q with q[d] = 0, which its
    test always accepts, or q[d] = inf, which it always rejects and resamples from p without d) on the module,
    which `Engine._commit_row` reads at each call; all are put back on exit, so engines outside the block run
    exactly as without it."""
    if pattern is None:
        yield
        return
    if pattern not in PATTERNS:
        raise ValueError(f"acceptance pattern must be one of {PATTERNS}, got {pattern!r}")
    real_verify, real_verify_argmax, real_verify_sampled = sampling.verify, sampling.verify_argmax, \
        sampling.verify_sampled
    calls: collections.Counter = collections.Counter()

    def accepted(rid: str, nd: int) -> int:
        n, calls[rid] = calls[rid], calls[rid] + 1
        return {"none": 0, "all": nd, "alternate": nd if n % 2 == 0 else 0}[pattern]

    def verify_argmax(argmax, finite, drafts, rid="?"):
        m = accepted(rid, len(drafts))
        sampling.check_finite_flags(finite, rid)
        return m, list(drafts[:m]) + [int(argmax[m])]

    def verify_sampled(tokens, accepted_, finite, drafts, rid="?"):
        m = accepted(rid, len(drafts))
        sampling.check_finite_flags(finite, rid)
        return m, list(drafts[:m]) + [int(tokens[m])]

    def verify(target, drafts, draft_probs, params, tokens, num_out, rid="?", allowed=None):
        if params.greedy:
            raise ValueError("forced acceptance covers greedy rows through verify_argmax only (no penalties)")
        m = accepted(rid, len(drafts))
        forced = []
        for i, d in enumerate(drafts):
            q = np.zeros(target.shape[-1])
            q[d] = np.inf if i == m else 0.0
            forced.append(q)
        return real_verify(target, drafts, forced, params, tokens, num_out, rid, allowed)

    sampling.verify, sampling.verify_argmax, sampling.verify_sampled = verify, verify_argmax, verify_sampled
    try:
        yield
    finally:
        sampling.verify, sampling.verify_argmax, sampling.verify_sampled = (real_verify, real_verify_argmax,
                                                                            real_verify_sampled)


# ------------------------------------------------------------------------------------------------ the plan


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one invocation runs (from the flags; `--tiny` scales the contexts and steps down)."""

    contexts: dict  # "4k" / "32k" -> prompt tokens of that context (the 32K one absent when skipped)
    chunk: int  # max_num_batched_tokens of the plain engine: its one prefill bucket
    mtp_chunk: int  # the MTP engines' (--mtp-chunk, default the plain engine's)
    page_size: int
    batches: tuple[int, ...]
    samplings: tuple[str, ...]
    patterns: tuple[str, ...]
    mtp: bool  # the MTP engine at 4K
    mtp_long: bool  # an MTP engine at 32K as well
    warm: int
    steps: int
    phase_steps: int
    profile_steps: int
    profile: str  # "key" (greedy rows; MTP: pattern "all"), "all", "none"
    batch_invariant: bool | None = None  # EngineConfig.batch_invariant (None: the engine's default, on)

    @property
    def decode_tokens(self) -> int:
        """Tokens a run's request can reach beyond its prompt (MTP emits up to 2 per step), with room to spare."""
        return (self.warm + self.steps + self.phase_steps + self.profile_steps + 2) * 2 + 8

    def profiled(self, sampling_name: str, pattern: str | None) -> bool:
        if self.profile == "none" or not self.profile_steps:
            return False
        return self.profile == "all" or (sampling_name == "greedy" and pattern in (None, "all"))


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """Weight bytes a decode step must read at least (each read once per step; how often the kernels really read
    them is what the fraction of the copy bandwidth says)."""

    always: int  # decoder + final mixer + lm_head, whatever the routing (decode_step.build; not the embedding)
    per_expert: int  # one routed expert summed over the decoder layers
    num_experts: int
    top_k: int
    lm_head: int
    mtp_dense: int  # the MTP head without its routed experts (its fc, layer, final mixer; it shares lm_head)
    mtp_per_expert: int

    @staticmethod
    def of(params: dict, cfg, always: int, per_expert: int) -> "WeightBytes":
        nbytes = lambda tree: sum(int(x.nbytes) for x in jax.tree.leaves(tree))  # noqa: E731
        mtp = params.get("mtp")
        experts = nbytes(mtp["layers"][0]["mlp"]["experts"]) if mtp else 0
        return WeightBytes(always, per_expert, cfg.num_experts, cfg.num_experts_per_tok, nbytes(params["lm_head"]),
                           nbytes(mtp) - experts if mtp else 0, experts // cfg.num_experts)

    def per_step(self, rows: int, k1: int, drafts: int) -> int:
        """A step of `rows` rows of k1 tokens each (1, or 1 + drafts with MTP): the decoder once, with the distinct
        experts rows * k1 tokens can route to; with MTP the head for the step's pairs (rows * k1 tokens) and once
        per draft call (k1 columns x drafts, rows tokens each), each draft call with lm_head for its logits."""
        experts = lambda tokens: min(self.num_experts, self.top_k * tokens)  # noqa: E731
        total = self.always + experts(rows * k1) * self.per_expert
        if drafts:
            calls = k1 * drafts
            total += (1 + calls) * self.mtp_dense + calls * self.lm_head
            total += (experts(rows * k1) + calls * experts(rows)) * self.mtp_per_expert
        return total


# ------------------------------------------------------------------------------------------------- engines


@dataclasses.dataclass
class Bench:
    """One engine of the run and what it measures."""

    name: str  # "plain", "mtp", "mtp_32k", "async"
    k: int  # MTP draft tokens
    contexts: tuple[str, ...]  # plan.contexts keys it decodes at
    chunk: int  # max_num_batched_tokens: its one prefill bucket
    lm: LLM | None = None
    async_scheduling: bool = False  # "async": the plain engine's runner and shapes (its compiled steps), chained

    def keys(self, plan: Plan) -> list:
        """The model steps it compiles: the decode step of each B in the plan and the B = 1 prefill step."""
        eng = self.lm.engine
        decode = [key for key in eng.decode_shapes() if key.rows in plan.batches]
        return decode + [eng.decode_shapes()[0]._replace(tokens=self.chunk)]


def make_llm(model, bench: Bench, plan: Plan, runner: RandomPleRunner | None = None) -> LLM:
    ps, longest = plan.page_size, max(plan.contexts[c] for c in bench.contexts)
    mml = longest + plan.decode_tokens
    warm = min(bench.chunk, mml - 3)  # Engine.warm_up's prompt
    pages = lambda n: -(-n // ps)  # noqa: E731
    prompts = [plan.contexts[c] for c in bench.contexts] + ([plan.contexts["32k"]] if "32k" in bench.contexts else [])
    # every prompt's snapshots keep their pages; each decoding row adds its own (and a copied partial page); slack
    num_pages = pages(warm) + sum(pages(n) for n in prompts) + max(plan.batches) * (pages(plan.decode_tokens) + 2)
    num_pages += max(8, num_pages // 16)
    return LLM(runner or RandomPleRunner(model, bench.k), max_num_seqs=max(plan.batches),
               max_num_batched_tokens=bench.chunk, async_scheduling=bench.async_scheduling,
               max_model_len=mml, page_size=ps, num_pages=num_pages, num_snapshots=16,
               enable_prefix_caching=True, block_size=min(plan.contexts.values()),
               speculative_config={"method": "mtp", "num_speculative_tokens": bench.k} if bench.k else None,
               prefill_buckets=(bench.chunk,), page_table_width="max", compile_ahead=False,
               batch_invariant=plan.batch_invariant)


def precompile(benches: list[Bench], plan: Plan, threads: int) -> dict:
    """Every engine's model steps through its own `Engine.precompile`, `threads` compiles at a time (XLA's
    compile releases the GIL; lowering holds it)."""
    jobs = [(b.lm.engine, key) for b in benches for key in b.keys(plan)]
    n0, t0 = len(_COMPILES), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for f in [pool.submit(eng.precompile, [key], False) for eng, key in jobs]:
            f.result()
    info = dict(programs=len(jobs), wall_s=time.perf_counter() - t0, backend_compiles=len(_COMPILES) - n0,
                backend_compile_s=sum(_COMPILES[n0:]), threads=threads)
    print(f"precompiled {len(jobs)} model steps in {info['wall_s']:.1f} s ({threads} at a time)", flush=True)
    return info


# ----------------------------------------------------------------------------------------------- measuring


def prefill(lm: LLM, prompt: list[int]) -> float:
    """Seconds from adding a request of `prompt` to its first token (its chunks run alone: B = 1); its prompt's
    snapshots stay published for the decode runs."""
    t0 = time.perf_counter()
    req = lm._add(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while not req.output:
        lm.engine.step()
    seconds = time.perf_counter() - t0
    while lm.engine.has_unfinished():
        lm.engine.step()
    lm._forget(req.request_id)
    return seconds


def decode_run(lm: LLM, bench: Bench, context: str, prefix: list[int], bsz: int, sampling_name: str,
               pattern: str | None, plan: Plan, wbytes: WeightBytes, copy_bw: float, vocab: int) -> dict:
    """B requests (the context's prompt + one token of their own), decoding; see the module docstring."""
    eng = lm.engine
    k1 = eng.K1
    rng = np.random.default_rng(len(prefix) * 10 + bsz)
    last = rng.choice(vocab, size=bsz, replace=False)
    max_tokens = plan.decode_tokens - 4
    reqs = [lm._add(prefix + [int(t)], SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i,
                                                      **SAMPLINGS[sampling_name]))
            for i, t in enumerate(last)]
    emitted = lambda: sum(len(r.output) for r in reqs)  # noqa: E731
    row = dict(engine=bench.name, mtp=bool(bench.k), context=context, context_tokens=len(prefix) + 1, batch=bsz,
               sampling=sampling_name, pattern=pattern)
    try:
        with forced_acceptance(pattern):
            for _ in range(plan.warm):
                eng.step()
            n0, drafts0, accepted0 = emitted(), eng.counters["drafts"], eng.counters["accepted"]
            times = []
            for _ in range(plan.steps):
                t0 = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t0)
            produced = emitted() - n0
            drafts, accepted = eng.counters["drafts"] - drafts0, eng.counters["accepted"] - accepted0
            phases, restore = time_phases(eng)
            try:
                for _ in range(plan.phase_steps):
                    eng.step()
            finally:
                restore()
            profile = None
            if plan.profiled(sampling_name, pattern):
                with device_profile.capture() as trace:
                    t0 = time.perf_counter()
                    for _ in range(plan.profile_steps):
                        eng.step()
                    profiled_wall = time.perf_counter() - t0
                profile = (trace.xspace, profiled_wall)
        if any(r.finished for r in reqs):
            raise RuntimeError(f"a request finished during the run: {[r.finish_reason for r in reqs]}")
    finally:
        for r in reqs:
            eng.abort(r.request_id)
            lm._forget(r.request_id)

    mean_s = sum(times) / len(times)
    step_bytes = wbytes.per_step(bsz, k1, bench.k)
    row.update(ms_per_step=statistics.median(times) * 1e3, mean_ms_per_step=mean_s * 1e3,
               p90_ms_per_step=float(np.percentile(times, 90)) * 1e3, steps_timed=len(times),
               tokens_per_s=produced / sum(times), tokens_per_step_per_row=produced / len(times) / bsz,
               acceptance=accepted / drafts if drafts else None,
               weight_bytes_per_step=step_bytes, weight_bytes_per_token=step_bytes * len(times) / produced,
               fraction_of_copy_bw=step_bytes / mean_s / copy_bw,
               host_phase_median_ms={k: statistics.median(v) * 1e3 for k, v in phases.items() if v})
    if profile is not None:
        xspace, wall = profile
        n = plan.profile_steps
        tl = device_profile.timeline(xspace)
        top = device_profile.summarize(xspace, None, top=12)["top_kernels"]
        row["profile"] = dict(
            steps=n, kernels_per_step=tl["kernels"] / n, device_kernel_ms_per_step=tl["kernel_ms"] / n,
            device_busy_ms_per_step=tl["busy_ms"] / n, copies_per_step=tl["copies"] / n,
            copy_ms_per_step=tl["copy_ms"] / n,
            # the device idles while the host builds, launches and commits: the step's wall time minus busy time
            host_gap_ms_per_step=mean_s * 1e3 - tl["busy_ms"] / n, wall_ms_per_step_under_profiler=wall * 1e3 / n,
            kernels_per_step_by_module={m: c / n for m, c in tl["kernels_by_module"].items()},
            top_kernels=[dict(kernel=t["kernel"], ms_per_step=t["ms"] / n, calls_per_step=t["calls"] / n)
                         for t in top])
    print(_line(row), flush=True)
    return row


# ------------------------------------------------------------------------------------------------ the report


def _find(rows, **match) -> dict | None:
    return next((r for r in rows if "error" not in r and all(r.get(k) == v for k, v in match.items())), None)


def _ratio(a, b):
    return a / b if a is not None and b else None


def summarize(rows: list[dict], prefills: dict) -> tuple[dict, dict]:
    """The issue's summary (SUMMARY_KEYS; None where a configuration was not run) and the ratios behind it."""
    plain = lambda ctx, b, s="greedy": _find(rows, engine="plain", context=ctx, batch=b, sampling=s)  # noqa: E731
    b1, b1_32k, b2 = plain("4k", 1), plain("32k", 1), plain("4k", 2)
    verify = _find(rows, mtp=True, context="4k", batch=1, sampling="greedy", pattern="all")
    get = lambda row, key: row.get(key) if row else None  # noqa: E731
    summary = dict(
        decode_tok_s_b1_4k=get(b1, "tokens_per_s"), decode_tok_s_b1_32k=get(b1_32k, "tokens_per_s"),
        two_stream_aggregate_over_one=_ratio(get(b2, "tokens_per_s"), get(b1, "tokens_per_s")),
        verify_over_decode_cost=_ratio(get(verify, "ms_per_step"), get(b1, "ms_per_step")),
        kernels_per_step=get(get(b1, "profile"), "kernels_per_step"),
        fraction_of_copy_bw_b1_4k=get(b1, "fraction_of_copy_bw"), prefill_32k_s=prefills.get("32k"),
        device=jax.devices()[0].device_kind, jax_version=jax.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"))
    ratios: dict = {"sampled_over_greedy": {}, "mtp_step_over_plain_step": {}, "mtp_tokens_per_s_over_plain": {},
                    "two_streams_over_one": {}}
    for r in rows:
        if "error" in r:
            continue
        tag = f"{r['engine']}_{r['context']}_b{r['batch']}" + (f"_{r['pattern']}" if r["pattern"] else "")
        if r["sampling"] == "sampled":
            greedy = _find(rows, engine=r["engine"], context=r["context"], batch=r["batch"], sampling="greedy",
                           pattern=r["pattern"])
            ratios["sampled_over_greedy"][tag] = _ratio(r["ms_per_step"], get(greedy, "ms_per_step"))
        if r["mtp"]:
            base = plain(r["context"], r["batch"], r["sampling"])
            tag = f"{r['context']}_b{r['batch']}_{r['sampling']}_{r['pattern']}"
            ratios["mtp_step_over_plain_step"][tag] = _ratio(r["ms_per_step"], get(base, "ms_per_step"))
            ratios["mtp_tokens_per_s_over_plain"][tag] = _ratio(r["tokens_per_s"], get(base, "tokens_per_s"))
        elif r["batch"] == 2:
            one = _find(rows, engine=r["engine"], context=r["context"], batch=1, sampling=r["sampling"])
            ratios["two_streams_over_one"][f"{r['context']}_{r['sampling']}"] = _ratio(r["tokens_per_s"],
                                                                                       get(one, "tokens_per_s"))
    ratios["decode_32k_over_4k_b1"] = _ratio(get(b1_32k, "ms_per_step"), get(b1, "ms_per_step"))
    ratios["async_tokens_per_s_over_plain"] = {
        f"{r['context']}_b{r['batch']}_{r['sampling']}": _ratio(r["tokens_per_s"], get(
            plain(r["context"], r["batch"], r["sampling"]), "tokens_per_s"))
        for r in rows if r["engine"] == "async" and "error" not in r}
    return summary, ratios


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['engine']:<8} {r['context']:<4} {r['batch']:2d} {r['sampling']:<8} {r['pattern'] or '-':<9} " \
               f"ERROR {r['error'][:150]}"
    p = r.get("profile") or {}
    f = lambda v, w, d: f"{v:{w}.{d}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"  # noqa: E731
    return (f"{r['engine']:<8} {r['context']:<4} {r['batch']:2d} {r['sampling']:<8} {r['pattern'] or '-':<9} "
            f"{f(r['ms_per_step'], 8, 2)} {f(r['tokens_per_s'], 8, 1)} {f(r['tokens_per_step_per_row'], 6, 2)} "
            f"{f(r['weight_bytes_per_token'] / 1e9, 7, 2)} {f(r['fraction_of_copy_bw'], 5, 2)} "
            f"{f(p.get('kernels_per_step'), 7, 0)} {f(p.get('device_busy_ms_per_step'), 7, 2)} "
            f"{f(p.get('host_gap_ms_per_step'), 7, 2)}")


HEADER = (f"{'engine':<8} {'ctx':<4} {'B':>2} {'sampling':<8} {'accept':<9} {'ms/step':>8} {'tok/s':>8} "
          f"{'tok/st':>6} {'GB/tok':>7} {'bw':>5} {'kern/st':>7} {'busy ms':>7} {'gap ms':>7}")


# ------------------------------------------------------------------------------------------------------ main


def tiny_config():
    """The demo model's config cut to 2 layers (a GDN layer with the PLE module, a QSA layer) and its MTP head:
    every layer kind, in a model that compiles quickly on the CPU (the check of this script)."""
    with open(decode_step.DEMO_CONFIG) as f:
        hf = json.load(f)
    hf["text_config"].update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                             ple_layer_ids=[1])
    return from_hf_config(hf)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="2-layer demo-sized model, contexts 64/256: the CPU check")
    ap.add_argument("--quick", action="store_true", help="B = 1, greedy, 4K, pattern all only (4 compiles)")
    ap.add_argument("--experts", type=int, default=512, help="routed experts kept (real: 512)")
    ap.add_argument("--mtp-quantized", action="store_true",
                    help="the MTP head in the decoder's scheme (default: BF16, as the INT4-Mixed release)")
    ap.add_argument("--batch", default="1,2")
    ap.add_argument("--no-32k", action="store_true", help="skip the 32K context (its prefill and decode runs)")
    ap.add_argument("--no-mtp", action="store_true", help="skip the MTP engine")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                    help="EngineConfig.batch_invariant (default: the engine's, on; GPU results before stop 46 ran with it off)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="also the plain engine with async scheduling (EngineConfig.async_scheduling), beside it")
    ap.add_argument("--mtp-32k", action="store_true", help="also an MTP engine at 32K (2-3 more compiles)")
    ap.add_argument("--sampling", default="greedy,sampled", help="of " + ",".join(SAMPLINGS))
    ap.add_argument("--patterns", default=",".join(PATTERNS), help="MTP acceptance patterns, of " + ",".join(PATTERNS))
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens, the one prefill bucket")
    ap.add_argument("--mtp-chunk", type=int, default=None,
                    help="the MTP engines' chunk (default: --chunk; a prefill step computes none of the head's MoE)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32, help="timed steps per configuration")
    ap.add_argument("--phase-steps", type=int, default=8, help="steps with the host phases timed")
    ap.add_argument("--profile-steps", type=int, default=4, help="steps under the profiler")
    ap.add_argument("--profile", default="key", choices=("key", "all", "none"),
                    help="which configurations to profile: key = greedy (MTP: pattern all)")
    ap.add_argument("--compile-threads", type=int, default=3,
                    help="model steps compiled at once (1: one after the other, autotuning undisturbed)")
    ap.add_argument("--compilation-cache", default=None,
                    help="JAX persistent compilation cache directory (a re-run compiles nothing); default: jax's "
                         "own setting")
    ap.add_argument("--deadline-s", type=float, default=540,
                    help="skip the configurations left once this many seconds have passed since the start (the\n"
                         "device runs a command for at most 600 s; the JSON is written after every configuration)")
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT or bench/results, real_size.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.no_32k, args.sampling, args.patterns = "1", True, "greedy", "all"
    return args


def make_plan(args) -> Plan:
    contexts = {"4k": 64, "32k": 256} if args.tiny else {"4k": 4096, "32k": 32768}
    if args.no_32k:
        del contexts["32k"]
    steps = dict(warm=args.warm, steps=args.steps, phase_steps=args.phase_steps, profile_steps=args.profile_steps)
    if args.tiny:
        steps = dict(warm=3, steps=6, phase_steps=2, profile_steps=2)
    chunk = 64 if args.tiny else args.chunk
    mtp_chunk = 16 if args.tiny else args.mtp_chunk or chunk
    return Plan(contexts=contexts, chunk=chunk, mtp_chunk=mtp_chunk, page_size=16 if args.tiny else args.page_size,
                batches=tuple(sorted(int(b) for b in args.batch.split(","))),
                samplings=tuple(args.sampling.split(",")), patterns=tuple(args.patterns.split(",")),
                mtp=not args.no_mtp, mtp_long=args.mtp_32k and "32k" in contexts and not args.no_mtp,
                profile=args.profile, batch_invariant=args.batch_invariant, **steps)


def main(argv=None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(threadName)s %(name)s: %(message)s")
    logging.getLogger("flashnext_jax").setLevel(logging.INFO)  # the engine's compiles
    if args.compilation_cache:
        from serving.cli import configure_compilation_cache

        configure_compilation_cache(args.compilation_cache)
    plan = make_plan(args)
    if set(plan.batches) - {1, 2} or set(plan.samplings) - set(SAMPLINGS) or set(plan.patterns) - set(PATTERNS):
        raise SystemExit("--batch takes 1,2; --sampling and --patterns their listed names")
    block = min(plan.contexts.values())  # the snapshot grid: every prefill chunk must end on it
    if any(c % block and block % c for c in (plan.chunk, plan.mtp_chunk)) or \
            any(n % plan.page_size for n in plan.contexts.values()):
        raise SystemExit("the contexts must be multiples of the page size, and a chunk a multiple or a divisor of "
                         "the 4K context")
    t_start = time.perf_counter()
    if args.tiny:
        cfg = tiny_config()
    else:
        with open(decode_step.REAL_CONFIG) as f:
            cfg = from_hf_config(json.load(f))
    cfg = dataclasses.replace(cfg, num_experts=min(args.experts, cfg.num_experts))
    dev = jax.devices()[0]
    print(f"{dev.device_kind} jax {jax.__version__} kernels={os.environ.get('FLASHNEXT_KERNELS', 'auto')} "
          f"experts={cfg.num_experts} plan={plan}", flush=True)
    copy_bw = copy_bandwidth(32 << 20 if args.tiny else 2 << 30)
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s", flush=True)

    t0 = time.perf_counter()
    params, always, per_expert = decode_step.build(cfg, jax.random.key(0), with_mtp=True,
                                                   mtp_quantized=args.mtp_quantized)
    jax.block_until_ready(params)
    wbytes = WeightBytes.of(params, cfg, always, per_expert)
    build_s = time.perf_counter() - t0
    print(f"built params in {build_s:.1f} s: {wbytes}", flush=True)
    model = api.Model(cfg, params, table=None, dtype=jnp.bfloat16)
    del params

    benches = [Bench("plain", 0, tuple(plan.contexts), plan.chunk)]
    if plan.mtp:
        benches.append(Bench("mtp", 1, ("4k",), plan.mtp_chunk))
    if plan.mtp_long:
        benches.append(Bench("mtp_32k", 1, ("32k",), plan.mtp_chunk))
    for b in benches:
        b.lm = make_llm(model, b, plan)
    if args.async_scheduling:  # the plain engine's twin (same runner, pool and widths: no compile of its own)
        benches.append(Bench("async", 0, tuple(plan.contexts), plan.chunk, async_scheduling=True))
        benches[-1].lm = make_llm(model, benches[-1], plan, runner=benches[0].lm.runner)
    compile_info = precompile(benches, plan, args.compile_threads)

    rng = np.random.default_rng(0)
    prompts = {c: rng.integers(0, cfg.vocab_size, n).tolist() for c, n in plan.contexts.items()}
    rows, prefills, engines = [], {}, {}

    def save():  # after every row: a run stopped by the device's time limit keeps what it measured
        summary, ratios = summarize(rows, prefills)
        path = save_result("real_size.json", rows, args.out, summary=summary, ratios=ratios, prefill_s=prefills,
                           plan=dataclasses.asdict(plan), tiny=args.tiny, experts=cfg.num_experts,
                           mtp_layout="quantized" if args.mtp_quantized else "bf16",
                           weight_bytes=dataclasses.asdict(wbytes), copy_bw_bytes_per_s=copy_bw, build_s=build_s,
                           compile=compile_info, engines=engines, total_s=time.perf_counter() - t_start)
        return path, summary, ratios

    primed: set = set()
    for name, ctx, sname in ORDER:
        b = next((b for b in benches if b.name == name), None)
        if b is None or ctx not in b.contexts or sname not in plan.samplings:
            continue
        eng = b.lm.engine
        configs = [(bsz, pattern) for bsz in plan.batches for pattern in (plan.patterns if b.k else (None,))]
        for bsz, pattern in configs:
            row = dict(engine=b.name, mtp=bool(b.k), context=ctx, batch=bsz, sampling=sname, pattern=pattern)
            if time.perf_counter() - t_start > args.deadline_s:
                rows.append(row | dict(error="skipped: past --deadline-s"))
                continue
            try:
                if b.name not in engines:
                    engines[b.name] = dict(k=b.k, chunk=b.chunk, max_model_len=eng.cfg.max_model_len,
                                           num_pages=eng.cfg.num_pages, page_table_width=eng.max_pages_per_row,
                                           batch_invariant=eng.cfg.batch_invariant, token_kinds=eng.cfg.token_kinds,
                                           steps_precompiled=len(b.keys(plan)), warm_up_s=eng.warm_up())
                if (b.name, ctx) not in primed:  # the context's prompt, prefilled alone, its snapshot kept
                    if ctx == "32k" and b.name == "plain":  # the 32K prefill figure: the second of two prompts
                        prefills["32k_first"] = prefill(b.lm, rng.integers(0, cfg.vocab_size,
                                                                           plan.contexts[ctx]).tolist())
                    seconds = prefill(b.lm, prompts[ctx])
                    primed.add((b.name, ctx))
                    prefills.setdefault(ctx, seconds)
                    engines[b.name][f"prefill_{ctx}_s"] = seconds
                    print(f"{b.name}: prefill of {plan.contexts[ctx]} tokens in {seconds:.2f} s", flush=True)
                rows.append(decode_run(b.lm, b, ctx, prompts[ctx], bsz, sname, pattern, plan, wbytes, copy_bw,
                                       cfg.vocab_size))
            except Exception as e:  # noqa: BLE001 - one failed configuration must not hide the others
                rows.append(row | dict(error=repr(e)[:400]))
                print(_line(rows[-1]), flush=True)
            engines.setdefault(b.name, {}).update(model_steps_compiled_in_runs=eng.counters["compiles"],
                                                  sampler_compiles=eng.counters["sampler_compiles"])
            save()

    path, summary, ratios = save()
    print(f"\nwrote {path} in {time.perf_counter() - t_start:.0f} s\nratios {json.dumps(ratios)}\n"
          f"summary {json.dumps(summary)}\n\n{HEADER}")
    for r in rows:
        print(_line(r))
    return dict(summary=summary, ratios=ratios, rows=rows, path=path)


if __name__ == "__main__":
    main()
