"""Which ops round a row differently when other rows run beside it (issue 19, the GPU part).

For each op at a real-size shape and each row count M, row i of one M-row call is compared bitwise with row i run
alone (M = 1), for the first few rows. An op is batch invariant when every row matches at every M. The matmul paths
switch by M (`quant_matmul.dispatch_path`: GEMV for M <= 2, the tensor-core kernel up to 32, XLA dequant + dot
above), so every op is tried across those thresholds, with XLA's excess precision on (the default) and off (the
per-compile option `xla_allow_excess_precision`).

    H200:  PYTHONPATH=. python3 bench/invariance_probe.py [--invariant] [--ms 4,8,32,512] [--only OPS]
           (--invariant: the ops as a batch-invariant step traces them, one kernel configuration for every M; the
           default 14 row counts up to 8,192 take more than 150 s at the real size: bound a run with --ms / --only;
           on the GPU the GDN kernels are an op too, rows of 128 tokens, up to 32 rows)
    CPU:   JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/invariance_probe.py --quick
"""
from __future__ import annotations

import argparse
import datetime
import functools
import inspect
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.quant_matmul import random_qweight  # noqa: E402
from flashnext_jax.gdn import delta_rule_kernels  # noqa: E402
from flashnext_jax.layers import linear, rms_norm  # noqa: E402
from pallas_kernels import fixed_order  # noqa: E402
from pallas_kernels.dense_matmul import dense_matmul  # noqa: E402
from pallas_kernels.kernel_switch import resolve_impl  # noqa: E402
from pallas_kernels.moe_matmul import routed_experts  # noqa: E402
from pallas_kernels.quant_matmul import dispatch_path, quant_matmul  # noqa: E402

H = 2560


def ops(key):
    """name -> (function of (its weights, x [M, K]) (and, for MoE and GDN, `start`: the batch index of x's first
    row), its weights, K, a description of the path by M). The weights are the jitted call's arguments, as in the
    engine's step: captured as constants, XLA folded through them at compile time (a MoE op compiled for a minute)."""
    k = jax.random.split(key, 8)
    q4_up = random_qweight(k[0], (), H, 4096, 4, 128)       # an attention-sized projection, INT4 g128
    q4_down = random_qweight(k[1], (), 4096, H, 4, 128)
    q8 = random_qweight(k[2], (), H, 1280, 8, 128)
    router = (jax.random.normal(k[3], (512, H), jnp.float32) * 0.02).astype(jnp.bfloat16)   # [out, in]
    small = (jax.random.normal(k[4], (48, H), jnp.float32) * 0.02).astype(jnp.bfloat16)      # in_proj_a/b-sized
    dense = (jax.random.normal(k[5], (4096, H), jnp.float32) * 0.02).astype(jnp.bfloat16)
    norm_w = jax.random.normal(k[6], (H,), jnp.float32).astype(jnp.bfloat16) * 0.1
    experts, inter, top = 64, 512, 8
    moe_gu = random_qweight(k[7], (experts,), H, 2 * inter, 4, 128)
    moe_down = random_qweight(jax.random.fold_in(k[7], 1), (experts,), inter, H, 4, 128)
    ids_all = jax.vmap(lambda r: jax.random.permutation(r, experts)[:top])(
        jax.random.split(jax.random.fold_in(k[7], 2), 8192)).astype(jnp.int32)  # row i's experts, whatever M
    wts_all = jax.random.uniform(jax.random.fold_in(k[7], 3), (8192, top), jnp.float32, 0.05, 0.2)

    def moe(p, x, start=0):
        """Rows start.. of the batch: row i is routed to the same experts whether it runs alone or beside others."""
        ids, wts, gu, down = p
        m = x.shape[0]
        return routed_experts(x, ids[start:start + m], wts[start:start + m], gu, down)

    def quant(p, x):
        return quant_matmul(x, p)
    table = {
        "moe_int4_64x2560x512": (moe, (ids_all, wts_all, moe_gu, moe_down), H, lambda m: "moe"),
        "quant_int4_2560x4096": (quant, q4_up, H, lambda m: dispatch_path((m, H), q4_up)),
        "quant_int4_4096x2560": (quant, q4_down, 4096, lambda m: dispatch_path((m, 4096), q4_down)),
        "quant_int8_2560x1280": (quant, q8, H, lambda m: dispatch_path((m, H), q8)),
        "linear_bf16_router_512": (lambda p, x: linear(x, p), router, H, lambda m: "reduce" if m <= 8 else "dot"),
        "linear_bf16_small_48": (lambda p, x: linear(x, p), small, H, lambda m: "reduce" if m <= 8 else "dot"),
        "linear_bf16_4096": (lambda p, x: linear(x, p), dense, H, lambda m: "dot"),
        "dense_matmul_4096": (lambda p, x: dense_matmul(x, p, interpret=resolve_impl(None) != "pallas"), dense, H,
                              lambda m: "pallas"),
        "rms_norm": (lambda p, x: rms_norm(x, p, 1e-6), norm_w, H, lambda m: "xla"),
        "log_softmax_f32": (lambda p, x: jax.nn.log_softmax(x.astype(jnp.float32), axis=-1), None, H,
                            lambda m: "xla"),
    }
    if resolve_impl(None) == "pallas":  # the GDN kernels have no CPU lowering (interpreted they take minutes here)
        gdn, inputs = gdn_rows(jax.random.fold_in(key, 7))
        table["gdn_kernels_store_t128"] = (gdn, inputs, H, lambda m: "gdn kernels")
    return table


GDN_ROWS, GDN_T = 32, 128  # the GDN op's rows (sequences) and tokens per row: two 64-token chunks


def gdn_rows(key):
    """The delta rule as the engine runs it on the GPU (`gdn.delta_rule_kernels` with a checkpoint column: the
    store path) over rows of GDN_T tokens at the real head sizes; row i's inputs are the same whatever M (x's
    values are not used, only its row count and `start`). Rows past GDN_ROWS are not tried. -> (the op, its
    inputs: q, k, v, g, beta)."""
    hk, hv, d = 16, 48, 128
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (GDN_ROWS, GDN_T, hk, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (GDN_ROWS, GDN_T, hk, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (GDN_ROWS, GDN_T, hv, d), jnp.float32).astype(jnp.bfloat16)
    g = -jax.random.uniform(ks[3], (GDN_ROWS, GDN_T, hv), jnp.float32, 0.01, 0.5)
    beta = jax.random.uniform(ks[4], (GDN_ROWS, GDN_T, hv), jnp.float32, 0.1, 0.9)

    def gdn(p, x, start=0):
        m = x.shape[0]
        rows = lambda a: a[start:start + m]  # noqa: E731
        state = jnp.zeros((m, hv, d, d), jnp.float32)
        base = jnp.full((m,), GDN_T - 1, jnp.int32)
        out, _ = delta_rule_kernels(*(rows(a) for a in p), state, base, 1,
                                    impl="pallas" if resolve_impl(None) == "pallas" else "interpret")
        return out.reshape(m, -1)
    gdn.max_rows = GDN_ROWS
    return gdn, (q, k, v, g, beta)


def _bits_equal(a, b) -> bool:
    return a.tobytes() == b.tobytes()


INVARIANT = None  # --invariant: trace every op as a batch-invariant engine step does (fixed_order)


def run(fn, weights, x, excess: bool, start: int = 0) -> np.ndarray:
    """fn(weights, x) jitted for x's shape and run; `start` (the batch index of x's first row) reaches only the ops
    that take it."""
    if start and "start" in inspect.signature(fn).parameters:
        fn = functools.partial(fn, start=start)
    with fixed_order.batch_invariant(bool(INVARIANT)):
        call = jax.jit(fn).lower(weights, x).compile(compiler_options={"xla_allow_excess_precision": excess})
    return np.asarray(call(weights, x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer row counts (CPU smoke)")
    ap.add_argument("--rows-checked", type=int, default=4)
    ap.add_argument("--ms", default=None, help="comma-separated row counts to try (default: 1 to 8192)")
    ap.add_argument("--only", default=None, help="comma-separated op names (default: all)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--invariant", action="store_true",
                    help="trace under fixed_order.batch_invariant(True): one kernel configuration for every M")
    args = ap.parse_args()
    global INVARIANT
    INVARIANT = args.invariant
    ms = [1, 2, 3, 8, 9, 32, 33] if args.quick else [1, 2, 3, 4, 8, 9, 16, 32, 33, 64, 128, 256, 1024, 8192]
    key = jax.random.PRNGKey(0)
    table = ops(key)
    if args.ms:
        ms = sorted({1, 2, *(int(m) for m in args.ms.split(","))})
    if args.only:
        unknown = set(args.only.split(",")) - set(table)
        if unknown:
            ap.error(f"unknown ops {sorted(unknown)}; known: {sorted(table)}")
        table = {name: table[name] for name in args.only.split(",")}
    rows = []
    for name, (fn, weights, k, path_of) in table.items():
        x_all = jax.random.normal(jax.random.fold_in(key, 99), (max(ms), k), jnp.float32).astype(jnp.bfloat16)
        for excess in (True, False):
            solo = [run(fn, weights, x_all[i:i + 1], excess, start=i)[0] for i in range(args.rows_checked)]
            pair = run(fn, weights, x_all[:2], excess)
            for m in ms[1:]:
                if m > getattr(fn, "max_rows", m):
                    continue
                y = run(fn, weights, x_all[:m], excess)
                n = min(m, args.rows_checked)
                diffs = [np.max(np.abs(y[i].astype(np.float32) - solo[i].astype(np.float32))) for i in range(n)]
                equal = all(_bits_equal(y[i], solo[i]) for i in range(n))
                equal_m2 = all(_bits_equal(y[i], pair[i]) for i in range(2))
                rows.append(dict(op=name, excess_precision=excess, m=m, path=path_of(m), path_m1=path_of(1),
                                 equal=bool(equal), equal_to_m2=bool(equal_m2), max_abs_diff=float(max(diffs))))
                print(f"{name:24s} excess={str(excess):5s} M={m:5d} path={path_of(m):12s} "
                      f"vs M=1: {'EQUAL' if equal else 'differs'} {max(diffs):.3g}  "
                      f"vs M=2: {'EQUAL' if equal_m2 else 'differs'}", flush=True)
    dev = jax.devices()[0]
    summary = {op: {f"excess_{e}": [r["m"] for r in rows if r["op"] == op and r["excess_precision"] == e
                                    and not r["equal"]] for e in (True, False)} for op in table}
    summary_m2 = {op: {f"excess_{e}": [r["m"] for r in rows if r["op"] == op and r["excess_precision"] == e
                                       and not r["equal_to_m2"]] for e in (True, False)} for op in table}
    result = dict(device=getattr(dev, "device_kind", str(dev)), jax_version=jax.__version__, invariant=INVARIANT,
                  date=datetime.date.today().isoformat(), rows=rows, summary={"row_counts_that_differ": summary,
                                                                      "row_counts_that_differ_from_m2": summary_m2})
    out = args.out or os.path.join(os.environ.get("OUT", "bench/results"), "invariance_probe.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("\nrow counts M whose rows differ from the same rows alone (per op: excess precision on / off)")
    for op, s in summary.items():
        print(f"{op:24s} on: {s['excess_True']}  off: {s['excess_False']}")
    print("\nthe same against rows 0-1 of the M=2 call (is only M=1 the odd one out?)")
    for op, s in summary_m2.items():
        print(f"{op:24s} on: {s['excess_True']}  off: {s['excess_False']}")
    print("wrote", out)


if __name__ == "__main__":
    main()
