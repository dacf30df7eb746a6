"""Which op of the whole engine step first rounds a request's row differently beside another request (issue 19,
the GPU part after bench/invariance_probe.py found every probed op row-invariant).

The engine (`LLM` over `RealRunner`, as bench/batch_invariance.py builds it: real config cut to --layers layers,
random INT4-Mixed weights, bf16, batch-invariant mode) runs request A alone, then A beside B. Each sublayer output
of the decoder (PLE, hyper read, GDN / QSA mixer, hyper write, MoE, and the final logits) is tapped with
`jax.debug.callback` in both runs; A's rows of one step (`--case`: its first prefill step, its first decode step,
or the second chunk of its prompt cut short by a long B ahead of it) are compared bitwise, tap by tap, in the
order the step computes them. The first tap that differs names the op; everything before it is shown equal.
(A tap forces its value into memory; both runs carry the same taps, so they compare like with like.)

    GPU:  PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/invariance_layers.py --out $OUT/x.json
          (--case prefill|decode|chunked; default all three, one engine)
    CPU:  JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/invariance_layers.py --tiny
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from bench import batch_invariance as bi
from bench import decode_step
from flashnext_jax import api, model as model_mod
from flashnext_jax.sampling import SamplingParams

TAPS: list[tuple[str, np.ndarray]] = []  # (name, value) in the order the step computes them


def _tap(name: str, value):
    """Record `value` under `name`, in the order the step computes it (ordered callbacks)."""
    def record(v):
        TAPS.append((name, np.asarray(v)))
    jax.debug.callback(record, value, ordered=True)


def _tapped(fn, name: str, pick=lambda out: out):
    def run(*a, **k):
        out = fn(*a, **k)
        _tap(name, pick(out))
        return out
    return run


def install_taps():
    """Wrap the sublayers `model.decoder_layer` calls (its module-level names), the final logits, and the steps
    inside the paged QSA layer (the first sublayer whose difference survives on the H100, stop 40)."""
    m = model_mod
    m.ple_forward = _tapped(m.ple_forward, "ple", lambda o: o[0])
    m.hyper_read = _tapped(m.hyper_read, "hyper_read", lambda o: o[0])
    m.gdn_forward = _tapped(m.gdn_forward, "gdn", lambda o: o[0])
    m.qsa_paged_forward = _tapped(m.qsa_paged_forward, "qsa_paged", lambda o: o[0])
    m.qsa_forward = _tapped(m.qsa_forward, "qsa_dense", lambda o: o[0])
    m.hyper_write = _tapped(m.hyper_write, "hyper_write")
    m.moe_forward = _tapped(m.moe_forward, "moe")
    from flashnext_jax import qsa_paged, runner
    from pallas_kernels import qsa_sparse
    runner.final_logits = _tapped(runner.final_logits, "final_logits")
    # inside the paged QSA layer: the projections, the chosen blocks, the attention (a tap on the indexer's scores,
    # which also run inside select_blocks' tile loop, made XLA's GPU compiler abort: shape_util IsArray check)
    qsa_paged.project = _tapped(_tapped(qsa_paged.project, "qsa.q", lambda o: o[0]), "qsa.q_index", lambda o: o[4])
    qsa_paged.select_blocks = _tapped(qsa_paged.select_blocks, "qsa.chosen_blocks",
                                      lambda o: jnp.where(o[1], o[0], -1))
    qsa_sparse.sparse_attention = _tapped(qsa_sparse.sparse_attention, "qsa.attention")


def tapped_step(lm, prompts, sp, step: int, watch: int):
    """Submit `prompts` in order, run `step` engine steps untapped, tap the next one; finish them all.

    Returns the taps and where request `prompts[watch]` sits in the tapped step: its batch row and the range of its
    tokens (start, end) that step computed."""
    reqs = [lm._add(p, sp) for p in prompts]
    for _ in range(step):
        lm.engine.step()
    jax.effects_barrier()
    TAPS.clear()
    start = reqs[watch].num_computed
    lm.engine.step()
    jax.effects_barrier()
    taps = list(TAPS)
    slot = reqs[watch].slot.slot
    row = [s for s, _ in lm.engine._last_rows].index(slot)
    end = max(reqs[watch].num_computed, start + 1)  # a decode row computes one token
    while not all(r.finished for r in reqs):
        lm.engine.step()
    for r in reqs:
        lm._forget(r.request_id)
    return taps, row, start, end


CASES = {
    "prefill": "A alone vs A beside B, the first step (both prompts prefill in it, whole)",
    "decode": "A alone vs A beside B, the first decode step (1 x 1 vs 2 x 1 rows)",
    "chunked": "A prefilled whole vs A's second chunk, cut short because a long B came first (mixed with B's decode)",
}


def compare_case(lm, cfg, plan, case: str, seed: int) -> dict:
    """Tap the step of `case` with A alone, beside B, and alone again; compare A's rows tap by tap."""
    rng = np.random.default_rng(seed)
    a_len, b_len = plan["prompt_max"] // 2, plan["prompt_max"] // 3  # both fit one chunk: one prefill step together
    if case == "chunked":  # B first and long: A gets the rest of B's chunk, then its own second chunk
        b_len = plan["chunk"] - plan["chunk"] // 8
    prompt_a, prompt_b = (rng.integers(1, cfg.vocab_size - 1, size=n).tolist() for n in (a_len, b_len))
    sp = SamplingParams(max_tokens=plan["tokens"], temperature=0.0, ignore_eos=True)

    solo_step = 1 if case == "decode" else 0
    together = ([prompt_b, prompt_a], sp, 1, 1) if case == "chunked" else ([prompt_a, prompt_b], sp, solo_step, 0)
    solo, _, _, _ = tapped_step(lm, [prompt_a], sp, solo_step, 0)
    pair, row, start, end = tapped_step(lm, *together)
    again, _, _, _ = tapped_step(lm, [prompt_a], sp, solo_step, 0)
    print(f"case {case}: A ({a_len} tokens) is row {row} of the tapped step beside B ({b_len}), its tokens "
          f"{start}..{end}", flush=True)
    rows = []
    first = None
    for i, ((name, a), (name2, b), (_, c)) in enumerate(zip(solo, pair, again)):
        assert name == name2, (name, name2)
        if case == "decode" or a.ndim >= 2 and a.shape[1] == 1:  # [B, ...]: A's row (decode; a row's last token)
            a, b, c = a[0], b[row], c[0]
        elif a.ndim >= 2:  # [B, T, ...]: A's row, the tokens the tapped step computed for A
            a, b, c = a[0, start:end], b[row, : end - start], c[0, start:end]
        equal = a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))
        af, bf = a.astype(np.float32), b.astype(np.float32)  # equal entries (-inf scores too) count as 0
        diff = float(np.max(np.where(af == bf, 0.0, np.abs(af - bf)), initial=0.0)) if a.shape == b.shape else None
        repeat = np.array_equal(a.view(np.uint8), c.view(np.uint8))
        rows.append(dict(index=i, tap=name, shape=list(a.shape), equal=bool(equal), max_abs_diff=diff,
                         solo_repeat_equal=bool(repeat)))
        if not equal and first is None:
            first = rows[-1]
        print(f"{i:3d} {name:14s} {str(tuple(a.shape)):22s} {'EQUAL' if equal else 'differs'} "
              f"{diff if diff else 0:.3g}  solo again: {'equal' if repeat else 'DIFFERS'}", flush=True)
    print(f"case {case}: first differing tap: {first}", flush=True)
    return dict(first_differing_tap=first, taps=len(rows), prompt_lengths=dict(A=a_len, B=b_len), row=row,
                tokens=[start, end], rows=rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prompt-min", type=int, default=64)
    ap.add_argument("--prompt-max", type=int, default=400)
    ap.add_argument("--tokens", type=int, default=2)
    ap.add_argument("--warm", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--case", choices=sorted(CASES) + ["all"], default="all",
                    help="; ".join(f"{k}: {v}" for k, v in CASES.items()))
    ap.add_argument("--non-invariant", action="store_true", help="the fast mode instead (a control)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    install_taps()
    cfg = bi.model_config(args)
    plan = bi.plan_of(args)
    params, _, _ = decode_step.build(cfg, jax.random.key(args.seed))
    model = api.Model(cfg, params, table=None, dtype=jnp.bfloat16)
    del params
    lm = bi.make_llm(model, not args.non_invariant, plan)
    cases = sorted(CASES) if args.case == "all" else [args.case]
    results = {case: compare_case(lm, cfg, plan, case, args.seed) for case in cases}
    res = dict(summary=dict(first_differing_tap={c: r["first_differing_tap"] for c, r in results.items()},
                            mode="non_invariant" if args.non_invariant else "invariant",
                            device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                            date=datetime.date.today().isoformat()),
               cases=results, config=dict(layers=cfg.num_hidden_layers, experts=cfg.num_experts, tiny=args.tiny))
    out = args.out or os.path.join(os.environ.get("OUT", "/tmp"), "invariance_layers.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
