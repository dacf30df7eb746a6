"""Gated delta rule kernels vs FLA on the GPU: prefill (chunked, varlen) and decode (slot-indexed, MTP checkpoints).

Run on the device machine (see docs/kernels-gdn.md):
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-*.whl; export PYTHONPATH=/tmp/site
  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 python3 bench/gdn.py [--quick] [--out bench/results/gdn.json]
Real heads: Hk 16, Hv 48, d 128, L2 norm of q/k in kernel, scale 128^-0.5. Prefill: B=1 T=4K/16K/64K and
varlen 4 x 8K; decode: B=1/2/16, T=1/2 inside one jitted step of L layers (distinct states and inputs per layer).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import gdn_reference
from pallas_kernels.gdn_decode import recurrent_gated_delta_rule_slots_pallas
from pallas_kernels.gdn_prefill import chunk_gated_delta_rule_varlen_pallas

HK, HV, D = 16, 48, 128
SMOKE = bool(os.environ.get("GDN_BENCH_SMOKE"))  # CPU smoke test of this script: tiny dims, interpret mode
if SMOKE:
    HK, HV, D = 2, 6, 32
SCALE = D ** -0.5
STATE_BYTES = HV * D * D * 4
ROWS = []


def sz(n):
    return max(1, n // 64) if SMOKE else n


def log(*a):
    print(*a, flush=True)


def rel(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    if not np.all(np.isfinite(a)):
        return float("nan")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def inputs(key, B, T):
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (B, T, HK, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, HK, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, HV, D), jnp.bfloat16)
    g = -jnp.exp(jax.random.uniform(ks[3], (B, T, HV), jnp.float32, -6.0, 0.5))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, HV), jnp.float32) * 2).astype(jnp.bfloat16)
    return q, k, v, g, beta


def bench_host(fn, n_iter, reps=3):
    """fn() -> something to block on; returns median seconds per call over reps blocks of n_iter calls."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(n_iter):
            out = fn()
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / n_iter)
    return statistics.median(ts)


def copy_bandwidth():
    x = jnp.ones((256 * 1024 * 1024,), jnp.float32)  # 1 GiB
    f = jax.jit(lambda x: x * 1.0001)
    jax.block_until_ready(f(x))
    t = bench_host(lambda: f(x), 20)
    return 2 * x.nbytes / t


# ----------------------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------------------
def jax_prefill_fn(lens, tune):
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    N = len(lens)
    slots = jnp.arange(N, dtype=jnp.int32)[::-1]

    tune = dict(tune, interpret=True, block_v=16) if SMOKE else tune

    def run(q, k, v, g, beta, state, stop=False):
        return chunk_gated_delta_rule_varlen_pallas(q, k, v, g, beta, cu_seqlens=cu, state=state, slots=slots,
                                                    scale=SCALE, use_qk_l2norm=True, stop_after_wy=stop, **tune)
    return run, cu, slots


def time_jax_prefill(lens, tune, n_iter, check=False, stop=False):
    T = int(sum(lens))
    q, k, v, g, beta = inputs(jax.random.PRNGKey(T), 1, T)
    run, cu, slots = jax_prefill_fn(lens, tune)
    N = len(lens)
    state0 = jax.random.normal(jax.random.PRNGKey(1), (N, HV, D, D), jnp.float32) * 0.1
    box = [jnp.array(state0, copy=True)]
    err = None
    if check:
        o, st = run(q, k, v, g, beta, box[0])
        o_r, st_r = gdn_reference.chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu_seqlens=cu, state=state0,
                                                                slots=slots, scale=SCALE, use_qk_l2norm=True)
        err = (rel(o, o_r), rel(st, st_r))
        box[0] = st

    def once():
        out, box[0] = run(q, k, v, g, beta, box[0], stop)
        return out

    jax.block_until_ready(once())
    return bench_host(once, n_iter), err


def fla_prefill(lens, n_rep=20):
    import torch
    import triton
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    T = int(sum(lens))
    q, k, v, g, beta = (torch.from_dlpack(jnp.array(a, copy=True)) for a in inputs(jax.random.PRNGKey(T), 1, T))
    N = len(lens)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.long, device="cuda") if N > 1 else None
    h0 = torch.randn(N, HV, D, D, device="cuda", dtype=torch.float32) * 0.1

    def f():
        return fla_chunk(q, k, v, g, beta, scale=SCALE, initial_state=h0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    o, st = f()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(f, warmup=50, rep=200, return_mode="median")
    return ms * 1e-3, (q, k, v, g, beta, h0, o, st)


# ----------------------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------------------
def make_decode_step(L, T, tune, reps):
    """One jitted function running `reps` decode steps of L layers back to back (lax.fori_loop), so the
    measurement is device time of the step, not Python dispatch of ~6L arguments. Only the states are carried:
    no per-layer reduction of the outputs (an earlier version summed every o, ~1.2 us per layer of its own)."""
    tune = dict(tune, interpret=True, block_v=16) if SMOKE else tune

    def layers(states, xs, slots, rc):
        outs, new = [], []
        for l in range(L):
            q, k, v, g, beta = xs[l]
            o, s = recurrent_gated_delta_rule_slots_pallas(q, k, v, g, beta, state=states[l], slots=slots,
                                                           read_col=rc, scale=SCALE, use_qk_l2norm=True, **tune)
            outs.append(o)
            new.append(s)
        return outs, new

    def step(states, xs, slots, rc):
        def body(i, states):
            return layers(states, xs, slots, rc)[1]
        return jax.lax.fori_loop(0, reps, body, states)
    return jax.jit(step, donate_argnums=(0,))


def decode_setup(L, B, T):
    k1 = max(2, T)
    ns = 2 * B + 1
    rng = np.random.default_rng(B * 10 + T)
    slots = jnp.asarray(rng.permutation(ns)[:B], jnp.int32)
    rc = jnp.asarray(rng.integers(0, k1, B), jnp.int32)
    states = [jax.random.normal(jax.random.PRNGKey(100 + l), (ns, k1, HV, D, D), jnp.float32) * 0.1
              for l in range(L)]
    xs = [inputs(jax.random.PRNGKey(200 + l), B, T) for l in range(L)]
    return states, xs, slots, rc


def time_jax_decode(L, B, T, tune, n_iter=5, reps=None):
    reps = reps or (2 if SMOKE else 20)
    states, xs, slots, rc = decode_setup(L, B, T)
    step = make_decode_step(L, T, tune, reps)
    box = [states]

    def once():
        box[0] = step(box[0], xs, slots, rc)
        return box[0]
    jax.block_until_ready(once())
    t = bench_host(once, n_iter, reps=3)
    kernel = None
    if not SMOKE:  # the decode kernel's own device time per layer (profiler), beside the step's wall time
        from bench.quant_matmul import device_time
        _, top = device_time(once, reps=2, top=8)  # seconds per call of once(): L * reps layers
        kernel = sum(v for k, v in top.items() if "decode_kernel" in k) / (L * reps) or None
    return t / (L * reps), kernel


def check_decode(B, T, tune):
    tune = dict(tune, interpret=True, block_v=16) if SMOKE else tune
    states, xs, slots, rc = decode_setup(1, B, T)
    q, k, v, g, beta = xs[0]
    s0 = jnp.array(states[0], copy=True)
    o_r, st_r = gdn_reference.recurrent_gated_delta_rule_slots(q, k, v, g, beta, state=s0, slots=slots, read_col=rc,
                                                               scale=SCALE, use_qk_l2norm=True)
    o, st = recurrent_gated_delta_rule_slots_pallas(q, k, v, g, beta, state=states[0], slots=slots, read_col=rc,
                                                    scale=SCALE, use_qk_l2norm=True, **tune)
    return rel(o, o_r), rel(st, st_r)


def fla_decode(L, B, T):
    import torch
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_rec
    xs = [[torch.from_dlpack(jnp.array(a, copy=True)) for a in inputs(jax.random.PRNGKey(300 + l), B, T)]
          for l in range(L)]
    h0 = [torch.randn(B, HV, D, D, device="cuda") * 0.1 for _ in range(L)]

    def layers():
        outs = []
        for l in range(L):
            q, k, v, g, beta = xs[l]
            outs.append(fla_rec(q, k, v, g, beta=beta, scale=SCALE, initial_state=h0[l], output_final_state=True,
                                use_qk_l2norm_in_kernel=True))
        return outs
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            layers()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            graph.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3 / 20)
    return statistics.median(ts) / L


# ----------------------------------------------------------------------------------------------------------
def dump_partial(path):
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gdn_partial.json"), "w") as f:
            json.dump(ROWS, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tuning sweep only")
    ap.add_argument("--out", default="bench/results/gdn.json")
    ap.add_argument("--decode-tune", default=None, help="json dict")
    ap.add_argument("--prefill-tune", default=None, help="json dict")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--decode-only", action="store_true", help="keep the prefill rows of --out, redo decode")
    args = ap.parse_args()
    dev = jax.devices()[0]
    log("device:", dev.device_kind, "jax", jax.__version__)
    try:
        import fla
        fla_version = getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        fla_version = f"unavailable: {e}"
    log("fla", fla_version)
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    L = args.layers if not SMOKE else 2

    # ---------------- decode: correctness + sweep ----------------
    dtune = json.loads(args.decode_tune) if args.decode_tune else None
    for (B, T) in [(2, 2), (3, 1)]:
        try:
            log(f"decode check B={B} T={T}: rel err o, state =", check_decode(B, T, dtune or {}))
        except Exception:
            traceback.print_exc()
    if dtune is None:
        best = {}
        for B in (1, 16):
            res = []
            for bv in ((16,) if SMOKE else (8, 16, 32, 64)):
                for nw in ((4,) if SMOKE else (1, 2, 4)):
                    tune = dict(block_v=bv, num_warps=nw)
                    try:
                        t, _ = time_jax_decode(L, B, 1, tune, n_iter=2)
                        res.append((t, tune))
                        log(f"  decode sweep B={B} T=1 {tune}: {t * 1e6:.2f} us/layer")
                    except Exception:
                        traceback.print_exc()
            res.sort(key=lambda r: r[0])
            best[B] = res[0][1]
        log("decode best", best)
    else:
        best = {1: dtune, 16: dtune}

    # ---------------- prefill: correctness + sweep ----------------
    ptune = json.loads(args.prefill_tune) if args.prefill_tune else None
    if args.decode_only:
        with open(args.out) as f:
            prev = json.load(f)
        ROWS.extend(r for r in prev["rows"] if r["kind"] == "prefill")
        ptune = prev["summary"]["prefill_tune"]
    try:
        if args.decode_only:
            raise StopIteration
        t, err = time_jax_prefill([sz(4096)], ptune or {}, 3, check=True)
        log(f"prefill check T=4096: rel err o, state = {err}")
        t, err = time_jax_prefill([sz(1000), 64, 1, sz(3031)], ptune or {}, 3, check=True)
        log(f"prefill check varlen 1000,64,1,3031: rel err o, state = {err}")
    except StopIteration:
        pass
    except Exception:
        traceback.print_exc()
    if ptune is None:
        res = []
        for tune in [dict(block_v=32, num_warps=4, num_stages=2, wy_warps=4),
                     dict(block_v=16, num_warps=4, num_stages=2, wy_warps=4),
                     dict(block_v=64, num_warps=4, num_stages=2, wy_warps=4),
                     dict(block_v=32, num_warps=4, num_stages=3, wy_warps=4),
                     dict(block_v=32, num_warps=8, num_stages=2, wy_warps=8),
                     dict(block_v=16, num_warps=2, num_stages=2, wy_warps=2)]:
            try:
                t, _ = time_jax_prefill([sz(16384)], tune, 10)
                tw, _ = time_jax_prefill([sz(16384)], tune, 10, stop=True)
                res.append((t, tune))
                log(f"  prefill sweep T=16K {tune}: {t * 1e3:.3f} ms (K1 alone {tw * 1e3:.3f} ms)")
            except Exception:
                traceback.print_exc()
        res.sort(key=lambda r: r[0])
        ptune = res[0][1]
        log("prefill best", ptune)
    if args.quick:
        return

    # ---------------- full table ----------------
    summary = {}
    for name, lens in [] if args.decode_only else [("B1_T4K", [sz(4096)]), ("B1_T16K", [sz(16384)]), ("B1_T64K", [sz(65536)]),
                       ("varlen_4x8K", [sz(8192)] * 4)]:
        T = sum(lens)
        row = dict(kind="prefill", case=name, T=T, lens=lens, tune=ptune)
        try:
            t, _ = time_jax_prefill(lens, ptune, 10 if T <= 16384 else 4)
            tw, _ = time_jax_prefill(lens, ptune, 10 if T <= 16384 else 4, stop=True)
            row.update(jax_ms=t * 1e3, jax_k1_ms=tw * 1e3, jax_tok_per_s=T / t)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["jax_error"] = repr(e)
        try:
            tf, _ = fla_prefill(lens)
            row.update(fla_ms=tf * 1e3, fla_tok_per_s=T / tf)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row["fla_error"] = repr(e)
        if "jax_ms" in row and "fla_ms" in row:
            row["speedup_vs_fla"] = row["fla_ms"] / row["jax_ms"]
        log(row)
        ROWS.append(row)
        dump_partial(args.out)
    for B in (1, 2, 16):
        for T in (1, 2):
            tune = best[16] if B >= 16 else best[1]
            floor = B * (1 + T) * STATE_BYTES / bw
            row = dict(kind="decode", B=B, T=T, layers=L, tune=tune, floor_us=floor * 1e6,
                       note="pallas writes T checkpoint columns (1 read + T writes); FLA reads 1, writes 1 final")
            try:
                t, tk = time_jax_decode(L, B, T, tune)
                row.update(jax_us_per_layer=t * 1e6, jax_over_floor=t / floor,
                           kernel_device_us_per_layer=tk * 1e6 if tk else None)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row["jax_error"] = repr(e)
            try:
                tf = fla_decode(L, B, T)
                row.update(fla_us_per_layer=tf * 1e6, fla_over_floor_own=tf / (B * 2 * STATE_BYTES / bw))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row["fla_error"] = repr(e)
            log(row)
            ROWS.append(row)
            dump_partial(args.out)

    def get(kind, key, **match):
        for r in ROWS:
            if r["kind"] == kind and all(r.get(a) == b for a, b in match.items()):
                return r.get(key)
        return None
    sp = [r.get("speedup_vs_fla") for r in ROWS if r["kind"] == "prefill" and r["T"] >= sz(16384)]
    sp = [s for s in sp if s is not None]
    summary = dict(
        prefill_min_speedup_vs_fla_t_ge_16k=min(sp) if sp else None,
        decode_us_per_layer_b1=get("decode", "jax_us_per_layer", B=1, T=1),
        decode_us_per_layer_b2=get("decode", "jax_us_per_layer", B=2, T=1),
        decode_over_floor_b1=get("decode", "jax_over_floor", B=1, T=1),
        decode_over_floor_b2=get("decode", "jax_over_floor", B=2, T=1),
        decode_kernel_device_us_per_layer_b1=get("decode", "kernel_device_us_per_layer", B=1, T=1),
        decode_kernel_device_us_per_layer_b2=get("decode", "kernel_device_us_per_layer", B=2, T=1),
        device=dev.device_kind, jax_version=jax.__version__, fla_version=fla_version,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        copy_bandwidth_tb_s=bw / 1e12, decode_tune=best, prefill_tune=ptune,
        decode_timing=("one jit: lax.fori_loop of 20 steps x %d layers (distinct states/inputs per layer, only the "
                       "states carried), median wall time / (20 * %d); kernel_device_us_per_layer: the decode "
                       "kernel's profiler device time in that program / (20 * %d); FLA: CUDA graph of %d layers, "
                       "replay time / %d" % (L, L, L, L, L)),
    )
    out = dict(summary=summary, rows=ROWS)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if os.environ.get("OUT"):  # named after --out: an A/B run with another --out must not overwrite this one
        with open(os.path.join(os.environ["OUT"], os.path.basename(args.out)), "w") as f:
            json.dump(out, f, indent=1)
    log("\n| case | jax | fla | speedup / over floor |")
    for r in ROWS:
        if r["kind"] == "prefill":
            log(f"| prefill {r['case']} | {r.get('jax_ms', float('nan')):.3f} ms | {r.get('fla_ms', float('nan')):.3f} ms"
                f" | {r.get('speedup_vs_fla', float('nan')):.2f}x |")
        else:
            log(f"| decode B={r['B']} T={r['T']} | {r.get('jax_us_per_layer', float('nan')):.2f} us |"
                f" {r.get('fla_us_per_layer', float('nan')):.2f} us | {r.get('jax_over_floor', float('nan')):.2f}x floor"
                f" ({r['floor_us']:.2f} us) |")
    log(json.dumps(summary))


if __name__ == "__main__":
    main()
