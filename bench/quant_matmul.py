"""Benchmark the W{4,6,8}A16 dense and grouped-MoE Pallas kernels on the GPU (issue 4).

Run on the H200:  PYTHONUNBUFFERED=1 python3 bench/quant_matmul.py --out $OUT/quant_matmul.json [--tune]
Method: "us" is GPU time per call from the profiler's device trace (all kernels of the call, XLA glue
included; host launch gaps excluded), "us_wall" the wall time per call of the same program. Copy bandwidth (x * 1.0001 over 2 GiB, read + write) measured in the same run; every timed
program runs R calls on R distinct weight copies (> 200 MB in rotation, beyond the 60 MB L2) and distinct
random activations, so XLA cannot merge calls and every call streams its weights from HBM; per-call time
= median over reps of (program time / R). Bytes are the packed weights at their source bit width plus
the scales (int6 = 0.75 B/weight). "read_floor_us" is the device time of an XLA kernel that only reads the
same number of bytes in one contiguous buffer (`read_floor`; MoE: two dependent passes, gate/up then down):
what the matrix's size alone allows, since a 3-25 MB pass pays launch, ramp-up and tail that a 2 GiB copy
amortizes.
Prints a table last and writes JSON (every row + "summary").
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant_layout import QuantizedWeight
from pallas_kernels.quant_matmul import (DECODE_MAX_M, DenseConfig, default_config, default_gemv_config,
                                         dequant_dot_xla, dispatch_path, quant_matmul_gemv, quant_matmul_pallas)
from pallas_kernels.moe_matmul import MOE_GEMV_MAX_PAIRS, MoEConfig, routed_experts_gemv, routed_experts_pallas

DENSE_SHAPES = [  # name, K, N, bits, group
    ("gdn_in_proj_qkv", 2560, 10240, 6, 64),
    ("gdn_in_proj_z", 2560, 6144, 6, 64),
    ("gdn_out_proj", 6144, 2560, 6, 64),
    ("qsa_q_proj", 2560, 12288, 6, 64),
    ("qsa_o_proj", 6144, 2560, 6, 64),
    ("lm_head", 2560, 248320, 8, 128),
    ("hc_down", 10240, 320, 8, 64),
    ("hc_up", 320, 10240, 8, 64),
    ("ref_int4_8192x28672", 8192, 28672, 4, 128),
]
MS = [1, 2, 4, 16, 64, 512]
MOE = dict(E=512, H=2560, I=640, k=10, bits=4, group=128)
ROTATE_BYTES = 256 << 20
L2_BYTES = 60 << 20


def timeit(fn, *args, reps=9, warmup=2):
    """Median wall time of one program (host dispatch included)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


_LINES_SHOWN = []


def device_time(fn, *args, reps=5, top=6):
    """GPU time of one program: sum of the durations of every kernel it launched (kernels + XLA glue),
    read from the profiler's device trace, averaged over reps. Excludes host launch gaps between kernels,
    which a jitted decode step hides by dispatching ahead (and which XLA's thunk launches add here)."""
    from jax._src.lib import _profiler
    from jax.profiler import ProfileData
    jax.block_until_ready(fn(*args))
    sess = _profiler.ProfilerSession()
    for _ in range(reps):
        jax.block_until_ready(fn(*args))
    pd = ProfileData.from_serialized_xspace(sess.stop())
    total, names = 0.0, {}
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = list(plane.lines)
        stream_lines = [ln for ln in lines if ln.name.startswith("Stream")]
        if not _LINES_SHOWN:
            _LINES_SHOWN.append(1)
            print("trace lines:", [(ln.name, len(list(ln.events))) for ln in lines], flush=True)
        for ln in stream_lines:
            for ev in ln.events:
                total += ev.duration_ns
                key = ev.name[:48]
                names[key] = names.get(key, 0.0) + ev.duration_ns
    if total == 0.0:
        return None, {}
    return total * 1e-9 / reps, {k: v * 1e-9 / reps for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:top]}


def measure(fn, *args, n_calls):
    """(seconds per call on the device, seconds per call wall, top kernels) for a program of n_calls calls."""
    wall = timeit(fn, *args) / n_calls
    dev, top = device_time(fn, *args)
    return (dev / n_calls if dev else wall), wall, {k: v / n_calls * 1e6 for k, v in top.items()}


def copy_bandwidth(nbytes: int = 2 << 30):
    """Bytes/s of an XLA read + write of an `nbytes` float32 array (device time when the profiler gives it)."""
    x = jax.random.normal(jax.random.key(0), (nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    t = timeit(f, x, reps=15)
    td, _ = device_time(f, x, reps=5)
    print(f"copy: wall {t * 1e6:.0f}us device {td * 1e6 if td else float('nan'):.0f}us", flush=True)
    t = td or t
    del x
    return 2 * nbytes / t


def random_qweight(key, lead, k, n, bits, group, scale_dtype=jnp.bfloat16) -> QuantizedWeight:
    """Random packed planes generated on device (fast); the layout's byte format is all that matters."""
    kq = jax.random.split(key, 3)
    qmax = 1 << (bits - 1)
    planes = []
    if bits == 8:
        planes.append(jax.random.randint(kq[0], (*lead, k, n), -qmax, qmax, jnp.int32).astype(jnp.int8))
    else:
        planes.append(jax.random.randint(kq[0], (*lead, k // 2, n), 0, 256, jnp.int32).astype(jnp.uint8))
        if bits == 6:
            planes.append(jax.random.randint(kq[1], (*lead, k // 4, n), 0, 256, jnp.int32).astype(jnp.uint8))
    scales = (jax.random.normal(kq[2], (*lead, k // group, n), jnp.float32) * 0.01).astype(scale_dtype)
    return QuantizedWeight(planes=tuple(planes), scales=scales, bits=bits, group_size=group, k=k, n=n)


def read_floor(pass_bytes, rotate: int) -> float:
    """Device seconds for XLA to read `pass_bytes` bytes in len(pass_bytes) dependent kernels, each reading ONE
    contiguous buffer of that size (32-bit words in rows of 1 KiB, summed along the rows: vector loads, every SM
    busy, a 1/256-sized output), `rotate` distinct buffers each so that no call finds them in L2. It is what
    the size of a matmul's weights alone costs a single pass over them (launch, ramp-up and tail included), the
    practical floor of any kernel that reads them once."""
    bufs = [[jax.random.bits(jax.random.key(7 * j + i), (max(1, int(n) // 1024), 256), jnp.uint32)
             for i, n in enumerate(pass_bytes)] for j in range(rotate)]
    f = jax.jit(lambda bufs: [[jnp.sum(b, axis=1, dtype=jnp.uint32) for b in per] for per in bufs])
    t = measure(f, bufs, n_calls=rotate)[0]
    del bufs
    return t


def bf16_equiv(w: QuantizedWeight):
    from pallas_kernels.quant_layout import dequantize
    return dequantize(w).astype(jnp.bfloat16)


def xla_dequant_dot(x, w: QuantizedWeight):
    return dequant_dot_xla(x, w)  # the library's prefill path (quant_matmul for M > DECODE_MAX_M)


def bench_dense(name, k, n, bits, group, m, copy_bw, cfg=None, baselines=True, max_rotate=16):
    key = jax.random.key(hash((name, m)) % (1 << 30))
    w1 = random_qweight(key, (), k, n, bits, group)
    wbytes = w1.source_bytes
    r = int(min(max_rotate, max(2, math.ceil(ROTATE_BYTES / wbytes))))
    ws = [random_qweight(jax.random.fold_in(key, i), (), k, n, bits, group) for i in range(r)]
    # separate arrays, not slices of one stacked array: XLA would add a copy kernel per slice
    xs = [jax.random.normal(jax.random.fold_in(key, 999 + i), (m, k), jnp.float32).astype(jnp.bfloat16)
          for i in range(r)]
    path = dispatch_path((m, k), w1)
    if path == "gemv":  # what quant_matmul(path="auto") runs at this M
        cfg = cfg or default_gemv_config(m, k, n, bits, group)
        f = jax.jit(lambda xs, ws: [quant_matmul_gemv(xs[i], ws[i], config=cfg) for i in range(r)])
    else:  # the tensor-core kernel (for M > DECODE_MAX_M it is the kernel's own tiling, reported beside XLA's)
        path = "kernel"
        cfg = cfg or default_config(m, k, n, bits, group)
        f = jax.jit(lambda xs, ws: [quant_matmul_pallas(xs[i], ws[i], config=cfg) for i in range(r)])
    t, t_wall, top = measure(f, xs, ws, n_calls=r)
    t_read = read_floor([wbytes], r)
    row = dict(kind="dense", name=name, K=k, N=n, bits=bits, group=group, M=m, rotate=r, kernel_path=path,
               us=t * 1e6, us_wall=t_wall * 1e6, kernels_us=top, source_bytes=wbytes, bytes_per_s=wbytes / t, frac_copy_bw=wbytes / t / copy_bw,
               tflops=2 * m * k * n / t / 1e12, config=cfg.__dict__, read_floor_us=t_read * 1e6,
               read_floor_frac_copy_bw=wbytes / t_read / copy_bw, frac_of_read_floor=t_read / t)
    if baselines:
        rb = int(min(max_rotate, max(2, math.ceil(ROTATE_BYTES / (2 * k * n)))))
        wb = [bf16_equiv(ws[i % r]) for i in range(rb)]
        xb = [xs[i % r] for i in range(rb)]
        fb = jax.jit(lambda xs, ws: [jnp.dot(xs[i], ws[i], preferred_element_type=jnp.float32)
                                     .astype(jnp.bfloat16) for i in range(rb)])
        tb = measure(fb, xb, wb, n_calls=rb)[0]
        fq = jax.jit(lambda xs, ws: [xla_dequant_dot(xs[i], ws[i]) for i in range(r)])
        tq = measure(fq, xs, ws, n_calls=r)[0]
        row.update(bf16_us=tb * 1e6, xla_dequant_us=tq * 1e6, speedup_vs_bf16=tb / t,
                   speedup_vs_xla_dequant=tq / t, frac_bf16_dot_flops=tb / t)
        del wb
    del ws
    return row


def moe_routing(key, m, e, k):
    # distinct experts per token (top-k), random weights
    ids = jnp.argsort(jax.random.uniform(key, (m, e)), axis=-1)[:, :k].astype(jnp.int32)
    wts = jax.nn.softmax(jax.random.normal(jax.random.fold_in(key, 1), (m, k)), axis=-1)
    return ids, wts


def bench_moe(m, copy_bw, cfg=None):
    e, h, i, k, bits, g = (MOE[x] for x in ("E", "H", "I", "k", "bits", "group"))
    key = jax.random.key(1234 + m)
    wgu = random_qweight(jax.random.fold_in(key, 1), (e,), h, 2 * i, bits, g)
    wd = random_qweight(jax.random.fold_in(key, 2), (e,), i, h, bits, g)
    per_expert = (wgu.source_bytes + wd.source_bytes) / e
    r = 16
    routes = [moe_routing(jax.random.fold_in(key, 10 + j), m, e, k) for j in range(r)]
    ids = [a for a, _ in routes]  # separate arrays (slices of a stacked array would add copy kernels)
    wts = [b for _, b in routes]
    xs = [jax.random.normal(jax.random.fold_in(key, 30 + j), (m, h), jnp.float32).astype(jnp.bfloat16)
          for j in range(r)]
    path = "gemv" if (cfg is None and m * k <= MOE_GEMV_MAX_PAIRS) else "sorted_tiles"
    if path == "gemv":  # what routed_experts(path="auto") runs for this many routed pairs
        f = jax.jit(lambda xs, ids, wts, wgu, wd: [
            routed_experts_gemv(xs[j], ids[j], wts[j], wgu, wd) for j in range(r)])
        cfg_desc = {"path": "gemv (default MoEGemvConfig)"}
    else:
        cfg = cfg or MoEConfig()
        f = jax.jit(lambda xs, ids, wts, wgu, wd: [
            routed_experts_pallas(xs[j], ids[j], wts[j], wgu, wd, config=cfg) for j in range(r)])
        cfg_desc = cfg.__dict__
    t, t_wall, top = measure(f, xs, ids, wts, wgu, wd, n_calls=r)
    uniq = float(np.mean([len(np.unique(np.asarray(ids[j]))) for j in range(r)]))
    wbytes = uniq * per_expert

    # read floor: the two dependent passes of the MLP (gate/up, then down) over the routed experts' bytes
    t_read = read_floor([uniq * wgu.source_bytes / e, uniq * wd.source_bytes / e], r)
    flops = 2 * m * k * (h * 2 * i + i * h)
    return dict(kind="moe", name="experts_10of512_int4", E=e, H=h, I=i, topk=k, bits=bits, group=g, M=m,
                rotate=r, us=t * 1e6, us_wall=t_wall * 1e6, kernels_us=top, unique_experts=uniq, source_bytes=wbytes, bytes_per_s=wbytes / t,
                frac_copy_bw=wbytes / t / copy_bw, tflops=flops / t / 1e12, kernel_path=path, config=cfg_desc,
                read_floor_us=t_read * 1e6, read_floor_frac_copy_bw=wbytes / t_read / copy_bw,
                frac_of_read_floor=t_read / t)


def tune_moe(copy_bw, out_rows):
    for m in (1, 2):
        for bn1, bn2, warps in ((32, 64, 4), (64, 128, 4), (32, 128, 4), (64, 64, 8)):
            cfg = MoEConfig(bn_gate_up=bn1, bn_down=bn2, num_warps=warps)
            try:
                row = bench_moe(m, copy_bw, cfg=cfg)
            except Exception as ex:  # noqa: BLE001
                print("FAIL moe", cfg, repr(ex)[:200], flush=True)
                continue
            row["kind"] = "tune"
            out_rows.append(row)
            print(f"tune moe M={m} {cfg} {row['us']:.1f}us {row['frac_copy_bw']:.2f} {row['kernels_us']}", flush=True)


def tune(copy_bw, out_rows):
    """Small sweep of decode configs on representative shapes; prints the best per shape."""
    shapes = [("gdn_in_proj_qkv", 2560, 10240, 6, 64), ("lm_head", 2560, 248320, 8, 128)]
    for name, k, n, bits, g in shapes:
        ng = k // g
        for m in (16,):
            best = None
            for bn in (128, 256):
                if n % bn:
                    continue
                tiles = n // bn
                seen = set()
                for target in (264, 528, 1056):
                    s = next((d for d in range(1, ng + 1) if ng % d == 0 and tiles * d >= target), ng)
                    for gpi in (1,):
                        if (ng // s) % gpi or (s, gpi) in seen:
                            continue
                        seen.add((s, gpi))
                        for warps, stages in ((4, 3), (8, 3)):
                            cfg = DenseConfig(bm=16, bn=bn, splits=s, groups_per_iter=gpi,
                                              num_warps=warps, num_stages=stages)
                            try:
                                row = bench_dense(name, k, n, bits, g, m, copy_bw, cfg=cfg, baselines=False,
                                                  max_rotate=8)
                            except Exception as ex:  # noqa: BLE001
                                print("FAIL", name, cfg, repr(ex)[:200], flush=True)
                                continue
                            row["kind"] = "tune"
                            out_rows.append(row)
                            print(f"tune {name} M={m} {cfg} {row['us']:.1f}us {row['frac_copy_bw']:.2f}",
                                  flush=True)
                            if best is None or row["us"] < best["us"]:
                                best = row
            if best:
                print("BEST", name, m, best["config"], f"{best['us']:.1f}us", f"{best['frac_copy_bw']:.2f}",
                      flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/quant_matmul.json")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--only", default="")  # comma list of shape names (+ 'moe')
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--merge", action="store_true",
                    help="keep --out's rows for (kind, name, M) not measured in this run (one report, several runs)")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    dev = jax.devices()[0]
    print(dev.device_kind, jax.__version__, flush=True)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    kept = []
    if args.merge and os.path.exists(args.out):
        with open(args.out) as fh:
            kept = [r for r in json.load(fh)["rows"] if r["kind"] != "tune"]
    stamp = dict(copy_bw_bytes_per_s=copy_bw,
                 run_date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))

    def report():  # this run's rows + the kept rows it did not re-measure
        new = {(r["kind"], r["name"], r["M"]) for r in rows if r["kind"] != "tune"}
        return rows + [r for r in kept if (r["kind"], r["name"], r["M"]) not in new]
    only = set(filter(None, args.only.split(",")))
    for name, k, n, bits, g in DENSE_SHAPES:
        if only and name not in only:
            continue
        for m in ms:
            try:
                row = bench_dense(name, k, n, bits, g, m, copy_bw)
            except Exception as ex:  # noqa: BLE001
                print("FAIL", name, m, repr(ex)[:300], flush=True)
                continue
            rows.append(dict(row, **stamp))
            write(args.out, report(), copy_bw, dev)
            print(f"{name:22s} M={m:4d} {row['us']:8.1f}us {row['frac_copy_bw']:.2f} copy "
                  f"bf16 {row['bf16_us']:.1f}us xla-dq {row['xla_dequant_us']:.1f}us wall {row['us_wall']:.1f}us "
                  f"{list(row['kernels_us'].items())[:3]}", flush=True)
    if not only or "moe" in only:
        for m in ms:
            try:
                row = bench_moe(m, copy_bw)
            except Exception as ex:  # noqa: BLE001
                print("FAIL moe", m, repr(ex)[:300], flush=True)
                continue
            rows.append(dict(row, **stamp))
            print(f"moe M={m:4d} {row['us']:8.1f}us (wall {row['us_wall']:.1f}) {row['frac_copy_bw']:.2f} copy "
                  f"{row['kernels_us']}", flush=True)

    if args.tune:
        tune_moe(copy_bw, rows)
        write(args.out, report(), copy_bw, dev)
        tune(copy_bw, rows)
    rows = report()
    summary = write(args.out, rows, copy_bw, dev)
    print("\n" + json.dumps(summary, indent=1))
    print(f"\n{'kind':6s} {'name':22s} {'M':>4s} {'us':>8s} {'TB/s':>6s} {'frac':>5s} {'xbf16':>6s} {'xdq':>6s}")
    for r in rows:
        if r["kind"] == "tune":
            continue
        print(f"{r['kind']:6s} {r['name']:22s} {r['M']:4d} {r['us']:8.1f} {r['bytes_per_s'] / 1e12:6.2f} "
              f"{r['frac_copy_bw']:5.2f} {r.get('speedup_vs_bf16', float('nan')):6.2f} "
              f"{r.get('speedup_vs_xla_dequant', float('nan')):6.2f}")


def _span(values):
    vals = [v for v in values if v is not None]
    return {"min": min(vals), "max": max(vals)} if vals else None


def summarize(rows, copy_bw, device_kind, jax_version, date):
    """The report's summary. The dense figures follow quant_matmul's dispatch: the Pallas kernel ("us": the GEMV
    kernel for M <= GEMV_AUTO_MAX_M, the tensor-core kernel up to DECODE_MAX_M), dequant_dot_xla ("xla_dequant_us",
    the same function) above it. Each row carries its run's date and copy bandwidth (--merge keeps old rows)."""
    dense = [r for r in rows if r["kind"] == "dense"]
    for r in dense:
        prefill = r["M"] > DECODE_MAX_M and "xla_dequant_us" in r
        kernel = "pallas_gemv" if r.get("kernel_path") == "gemv" else "pallas_kernel"
        r["dispatched_path"] = "dequant_dot_xla" if prefill else kernel
        r["dispatched_us"] = r["xla_dequant_us"] if prefill else r["us"]
        if "bf16_us" in r:
            r["dispatched_frac_bf16_dot_flops"] = r["bf16_us"] / r["dispatched_us"]
    big_decode = [r for r in dense if r["M"] <= 16 and r["source_bytes"] >= 8e6]
    moe_dec = [r for r in rows if r["kind"] == "moe" and r["M"] <= 2]
    pre = [r for r in dense if r["M"] == 512 and "bf16_us" in r]
    return dict(
        dense_min_fraction_of_copy_bw_m_le_16=min((r["frac_copy_bw"] for r in big_decode), default=None),
        dense_max_fraction_of_copy_bw_m_le_16=max((r["frac_copy_bw"] for r in big_decode), default=None),
        moe_decode_min_fraction_of_copy_bw=min((r["frac_copy_bw"] for r in moe_dec), default=None),
        prefill_m512_min_fraction_of_bf16_dot=min((r["dispatched_frac_bf16_dot_flops"] for r in pre),
                                                  default=None),
        prefill_m512_path="dequant_dot_xla (quant_matmul dispatch for M > %d)" % DECODE_MAX_M,
        prefill_m512_pallas_kernel_min_fraction_of_bf16_dot=min((r["frac_bf16_dot_flops"] for r in pre),
                                                                default=None),
        prefill_m512_pallas_kernel_max_fraction_of_bf16_dot=max((r["frac_bf16_dot_flops"] for r in pre),
                                                                default=None),
        # what a kernel that only READS the same bytes reaches at the same size (bench_dense's read_floor_us):
        # the ceiling set by the matrix size alone (launch, ramp and tail of one pass over 3-25 MB)
        dense_read_floor_fraction_of_copy_bw_m_le_16=_span(r.get("read_floor_frac_copy_bw") for r in big_decode),
        dense_fraction_of_read_floor_m_le_16=_span(r.get("frac_of_read_floor") for r in big_decode),
        moe_decode_read_floor_fraction_of_copy_bw=_span(r.get("read_floor_frac_copy_bw") for r in moe_dec),
        moe_decode_fraction_of_read_floor=_span(r.get("frac_of_read_floor") for r in moe_dec),
        targets=dict(dense_m_le_16_copy_bw=0.75, moe_decode_copy_bw=0.60, prefill_m512_bf16_dot=0.50),
        timing="us = GPU time per call from the profiler device trace (all kernels of the call incl. XLA "
               "glue, host launch gaps excluded); us_wall = wall time per call of an R-call program",
        copy_bw_bytes_per_s=copy_bw, device=device_kind, jax_version=jax_version, date=date)


def write(path, rows, copy_bw, dev, date=None):
    date = date or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    summary = summarize(rows, copy_bw, dev.device_kind, jax.__version__, date)
    with open(path, "w") as fh:
        json.dump(dict(summary=summary, rows=rows), fh, indent=1)
    return summary


if __name__ == "__main__":
    main()
