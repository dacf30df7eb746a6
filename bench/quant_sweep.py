"""Sweep of the CUDA-core GEMV decode path (quant_matmul_gemv, routed_experts_gemv) on the GPU (issue 4).

Run on the H200 from the repo root (about 3.5 minutes of GPU time; --quick: one config per shape, ~1 min):
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 bench/quant_sweep.py [--quick] [--budget-s 200] [--only NAME,...]
Writes $OUT/quant_sweep.json when OUT is set (or --out PATH).

Method (bench/quant_matmul.py's helpers): every timed program runs R calls on R distinct weight copies (> 256 MB
in rotation, beyond the 60 MB L2; the 645 MB lm_head rotates 2) with distinct activations, so XLA cannot merge
calls and each call streams its weights from HBM; "us" = GPU time per call from the profiler's device trace
(every kernel of the call, the split-K partial sums and MoE glue included). Bytes are the packed weights at
their source bit width plus scales (MoE: the distinct experts touched). Before timing, each config's output
of the first call is checked against the float32 reference on the GPU: relative error max|y - ref| / max|ref|
is printed and a config above 1e-2 (or non-finite) is dropped, so a miscompile cannot produce a timing.
A config that fails to lower or compile prints its exception and the sweep goes on.

Order (so that the time budget drops the least useful work first): copy bandwidth; the default config of
every (shape, M) and of the MoE; M = 1 variants (fields jnp / no load barrier / unroll 2 / 8 warps / BN 64 and
256 / fewer and more programs); for M = 2, 4 the best M = 1 config re-fitted; MoE variants. A config is not
started once --budget-s seconds have passed. Prints one line per config and a table (best per shape) last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from bench.quant_matmul import copy_bandwidth, device_time, moe_routing, random_qweight
from pallas_kernels.moe_matmul import (MoEConfig, MoEGemvConfig, check_moe_gemv, routed_experts_gemv,
                                       routed_experts_pallas, routed_experts_reference)
from pallas_kernels.quant_gemv import (GemvConfig, _splits_for, check_gemv_config, default_gemv_config,
                                       quant_matmul_gemv)
from pallas_kernels.quant_matmul import DenseConfig, default_config, quant_matmul_pallas, quant_matmul_reference

SHAPES = [  # name, K, N, bits, group, max rotation
    ("int4_8192x28672", 8192, 28672, 4, 128, 4),
    ("lm_head_int8_2560x248320", 2560, 248320, 8, 128, 2),
    ("int6_2560x10240", 2560, 10240, 6, 64, 16),
    ("int6_6144x2560", 6144, 2560, 6, 64, 16),
    ("int8_10240x320", 10240, 320, 8, 64, 16),
]
MS = (1, 2, 4)
MOE = {"E": 512, "H": 2560, "I": 640, "k": 10, "bits": 4, "group": 128}
MOE_MS = (1, 2)
ROTATE_BYTES = 256 << 20
MAX_REL_ERR = 1e-2


def _fit(cfg: GemvConfig, m, k, n, bits, g, target=528) -> GemvConfig | None:
    """cfg with splits re-chosen for `target` programs and rows bumped until the asm packing fits; None if it
    cannot be made valid."""
    splits = _splits_for(k // g, n // cfg.bn, target) if n % cfg.bn == 0 else 1
    cfg = dataclasses.replace(cfg, splits=splits)
    for _ in range(4):
        try:
            check_gemv_config(cfg, m, k, n, bits, g)
            return cfg
        except ValueError:
            cfg = dataclasses.replace(cfg, rows=cfg.rows * 2)
    return None


def dense_variants(m, k, n, bits, g):
    """The M = 1 sweep around the default config (deduplicated, all valid)."""
    base = default_gemv_config(m, k, n, bits, g)
    out = [("default", base)]
    cand = [("jnp_fields", dataclasses.replace(base, fields="jnp")),
            ("no_load_barrier", dataclasses.replace(base, sync_loads=False)),
            ("unroll2", dataclasses.replace(base, unroll=2)),
            ("warps8", _fit(dataclasses.replace(base, num_warps=8), m, k, n, bits, g)),
            ("bn64", _fit(dataclasses.replace(base, bn=64), m, k, n, bits, g)),
            ("bn256", _fit(dataclasses.replace(base, bn=256), m, k, n, bits, g)),
            ("programs264", _fit(base, m, k, n, bits, g, target=264)),
            ("programs1056", _fit(base, m, k, n, bits, g, target=1056))]
    seen = {base}
    for name, c in cand:
        if c is None or c in seen:
            continue
        try:
            check_gemv_config(c, m, k, n, bits, g)
        except ValueError:
            continue
        seen.add(c)
        out.append((name, c))
    return out


class Sweep:
    def __init__(self, args):
        self.args = args
        self.t0 = time.perf_counter()
        self.rows = []
        self.cache = {}
        self.copy_bw = None

    def elapsed(self):
        return time.perf_counter() - self.t0

    def out_of_time(self):
        return self.elapsed() > self.args.budget_s

    # ------------------------------------------------------------------------------------------- dense
    def dense_data(self, name, k, n, bits, g, max_rotate, m):
        key = (name, m)
        if key not in self.cache:
            wkey = ("w", name)
            if wkey not in self.cache:
                base = jax.random.key(abs(hash(name)) % (1 << 30))
                w1 = random_qweight(base, (), k, n, bits, g)
                r = int(min(max_rotate, max(2, math.ceil(ROTATE_BYTES / w1.source_bytes))))
                ws = [w1] + [random_qweight(jax.random.fold_in(base, i), (), k, n, bits, g) for i in range(1, r)]
                self.cache[wkey] = ws
            ws = self.cache[wkey]
            r = len(ws)
            # separate arrays, not slices of one stacked array: a slice would add a copy kernel per call
            xs = [jax.random.normal(jax.random.key(7 + 1000 * m + i), (m, k), jnp.float32).astype(jnp.bfloat16)
                  for i in range(r)]
            ref = jax.jit(quant_matmul_reference)(xs[0], ws[0]).astype(jnp.float32)
            self.cache[key] = (ws, xs, ref)
        return self.cache[key]

    def run_dense(self, shape, m, label, cfg):
        name, k, n, bits, g, max_rotate = shape
        row = {"kind": "dense", "name": name, "K": k, "N": n, "bits": bits, "group": g, "M": m, "label": label,
               "config": dataclasses.asdict(cfg)}
        try:
            ws, xs, ref = self.dense_data(name, k, n, bits, g, max_rotate, m)
            r = len(ws)
            if isinstance(cfg, DenseConfig):  # the tensor-core kernel
                f = jax.jit(lambda xs, ws: [quant_matmul_pallas(xs[i], ws[i], config=cfg) for i in range(r)])
                programs = (n // cfg.bn) * cfg.splits * -(-m // cfg.bm)
            else:
                f = jax.jit(lambda xs, ws: [quant_matmul_gemv(xs[i], ws[i], config=cfg) for i in range(r)])
                programs = (n // cfg.bn) * cfg.splits
            if self.check_and_time(row, f, (xs, ws), ref, r, ws[0].source_bytes):
                row["programs"] = programs
        except Exception as ex:  # noqa: BLE001 - a lowering or compile error: report it and go on
            row["error"] = f"{type(ex).__name__}: {str(ex)[:600]}"
            traceback.print_exc(limit=2)
        self.report(row)
        return row

    def check_and_time(self, row, f, args, ref, r, nbytes) -> bool:
        """Run f (r calls in one program) once, check its first output against ref (a wrong result is reported,
        not timed), then time it from the profiler trace. Fills row; True when it was timed."""
        t = time.perf_counter()
        outs = jax.block_until_ready(f(*args))
        row["compile_run_s"] = time.perf_counter() - t
        y = outs[0].astype(jnp.float32)
        err = float(jnp.max(jnp.abs(y - ref)) / (jnp.max(jnp.abs(ref)) + 1e-30))
        row["rel_err"] = err
        if not math.isfinite(err) or err > MAX_REL_ERR:
            row["error"] = f"wrong result: rel_err {err:.3e} > {MAX_REL_ERR}"
            return False
        dev, top = device_time(f, *args, reps=self.args.reps)
        if dev is None:
            raise RuntimeError("no device events in the profile")
        per = dev / r
        row.update(rotate=r, us=per * 1e6, source_bytes=nbytes, bytes_per_s=nbytes / per,
                   frac_copy_bw=nbytes / per / self.copy_bw, kernels_us={kk: v / r * 1e6 for kk, v in top.items()})
        return True

    # ------------------------------------------------------------------------------------------- MoE
    def moe_data(self, m):
        if ("moe", m) not in self.cache:
            e, h, i, k, bits, g = (MOE[x] for x in ("E", "H", "I", "k", "bits", "group"))
            if "moe_w" not in self.cache:
                key = jax.random.key(4321)
                self.cache["moe_w"] = (random_qweight(jax.random.fold_in(key, 1), (e,), h, 2 * i, bits, g),
                                       random_qweight(jax.random.fold_in(key, 2), (e,), i, h, bits, g))
            wgu, wd = self.cache["moe_w"]
            r = 16
            key = jax.random.key(99 + m)
            routes = [moe_routing(jax.random.fold_in(key, 10 + j), m, e, k) for j in range(r)]
            ids = [a for a, _ in routes]  # separate arrays (slices of a stacked one would add copies)
            wts = [b for _, b in routes]
            xs = [jax.random.normal(jax.random.fold_in(key, 30 + j), (m, h), jnp.float32).astype(jnp.bfloat16)
                  for j in range(r)]
            ref = jax.jit(routed_experts_reference)(xs[0], ids[0], wts[0], wgu, wd).astype(jnp.float32)
            per_expert = (wgu.source_bytes + wd.source_bytes) / e
            uniq = float(np.mean([len(np.unique(np.asarray(ids[j]))) for j in range(r)]))
            self.cache[("moe", m)] = (wgu, wd, ids, wts, xs, ref, uniq * per_expert)
        return self.cache[("moe", m)]

    def run_moe(self, m, label, cfg):
        row = {"kind": "moe", "name": "experts_10of512_int4", "M": m, "label": label,
               "config": dataclasses.asdict(cfg)}
        try:
            wgu, wd, ids, wts, xs, ref, nbytes = self.moe_data(m)
            r = len(xs)
            if isinstance(cfg, MoEConfig):  # the sorted-tiles tensor-core path
                row["resolved_bn_splits"] = None
                f = jax.jit(lambda xs, ids, wts, wgu, wd: [
                    routed_experts_pallas(xs[j], ids[j], wts[j], wgu, wd, config=cfg) for j in range(r)])
            else:
                row["resolved_bn_splits"] = check_moe_gemv(xs[0].shape, ids[0].shape, wgu, wd, cfg)
                f = jax.jit(lambda xs, ids, wts, wgu, wd: [
                    routed_experts_gemv(xs[j], ids[j], wts[j], wgu, wd, config=cfg) for j in range(r)])
            self.check_and_time(row, f, (xs, ids, wts, wgu, wd), ref, r, nbytes)
        except Exception as ex:  # noqa: BLE001
            row["error"] = f"{type(ex).__name__}: {str(ex)[:600]}"
            traceback.print_exc(limit=2)
        self.report(row)
        return row

    # ------------------------------------------------------------------------------------------- output
    def report(self, row):
        self.rows.append(row)
        c = row["config"]
        knobs = " ".join(f"{k}={v}" for k, v in c.items())
        if "error" in row:
            print(f"[{self.elapsed():6.1f}s] {row['kind']} {row['name']} M={row['M']} {row['label']}: FAIL "
                  f"{row['error'][:300]} | {knobs}", flush=True)
        else:
            print(f"[{self.elapsed():6.1f}s] {row['kind']} {row['name']} M={row['M']} {row['label']}: "
                  f"{row['us']:.1f}us {row['bytes_per_s'] / 1e9:.0f}GB/s {row['frac_copy_bw']:.2f} of copy, "
                  f"rel_err {row['rel_err']:.1e} | {knobs} | {row.get('kernels_us')}", flush=True)
        self.write()

    def best(self):
        best = {}
        for r in self.rows:
            if "us" not in r:
                continue
            key = (r["kind"], r["name"], r["M"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
        return best

    def write(self):
        path = self.args.out or (os.path.join(os.environ["OUT"], "quant_sweep.json") if os.environ.get("OUT")
                                 else None)
        if not path:
            return
        best = self.best()
        summary = {
            "copy_bw_bytes_per_s": self.copy_bw, "device": jax.devices()[0].device_kind,
            "jax_version": jax.__version__,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "elapsed_s": self.elapsed(),
            "best": {f"{k[0]}:{k[1]}:M{k[2]}": {"us": v["us"], "frac_copy_bw": v["frac_copy_bw"],
                                                "label": v["label"], "config": v["config"]}
                     for k, v in best.items()},
            "targets": {"dense_m_le_16_copy_bw": 0.75, "moe_decode_copy_bw": 0.60}}
        with open(path, "w") as fh:
            json.dump({"summary": summary, "rows": self.rows}, fh, indent=1, default=str)

    def table(self):
        best = self.best()
        print(f"\ncopy bandwidth {self.copy_bw / 1e12:.2f} TB/s; {len(self.rows)} configs in {self.elapsed():.0f}s; "
              f"{sum('error' in r for r in self.rows)} failed")
        print(f"{'kind':5s} {'shape':26s} {'M':>2s} {'us':>8s} {'GB/s':>6s} {'frac':>5s} {'err':>7s}  best config")
        for (kind, name, m), r in sorted(best.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
            c = r["config"]
            if kind == "dense" and "bm" in c:
                cs = (f"{r['label']}: tensor-core bm={c['bm']} bn={c['bn']} splits={c['splits']} "
                      f"gpi={c['groups_per_iter']} warps={c['num_warps']} stages={c['num_stages']} "
                      f"weights_left={c['weights_left']} programs={r['programs']}")
            elif kind == "dense":
                cs = (f"{r['label']}: bn={c['bn']} splits={c['splits']} rows={c['rows']} warps={c['num_warps']} "
                      f"fields={c['fields']} unroll={c['unroll']} sync={c['sync_loads']} programs={r['programs']}")
            elif "bm" in c:
                cs = f"{r['label']}: sorted tiles bm={c['bm']} bn={c['bn_gate_up']}/{c['bn_down']}"
            else:
                cs = (f"{r['label']}: bn/splits gate_up,down={r['resolved_bn_splits']} rows={c['rows']} "
                      f"warps={c['num_warps']} fields={c['fields']} sync={c['sync_loads']}")
            print(f"{kind:5s} {name:26s} {m:2d} {r['us']:8.1f} {r['bytes_per_s'] / 1e9:6.0f} "
                  f"{r['frac_copy_bw']:5.2f} {r['rel_err']:7.1e}  {cs}")
        failed = [r for r in self.rows if "error" in r]
        if failed:
            print("failed configs:")
            for r in failed:
                print(f"  {r['kind']} {r['name']} M={r['M']} {r['label']}: {r['error'][:200]}")


MOE_CFGS = [("default", MoEGemvConfig()),
            ("fused_glue", MoEGemvConfig(fused_glue=True)),
            ("fused_glue_s10", MoEGemvConfig(fused_glue=True, splits_gate_up=10)),
            ("fused_glue_s4", MoEGemvConfig(fused_glue=True, splits_gate_up=4)),
            ("fused_act_bn64", MoEGemvConfig(bn_gate_up=64, splits_gate_up=1)),
            ("programs264", MoEGemvConfig(target_programs=264)),
            ("programs1056", MoEGemvConfig(target_programs=1056)),
            ("jnp_fields", MoEGemvConfig(fields="jnp")),
            ("warps8_rows32", MoEGemvConfig(num_warps=8, rows=32))]
def small_m(sw, shapes, ms):
    """M = 3..16: the tensor-core kernel's default config (weights as the left operand: wgmma fed from
    registers), the same with the weights on the right (register -> shared memory -> mma.sync: the default
    before stop 9) and the CUDA-core GEMV where it can take M."""
    for shape in shapes:
        _, k, n, bits, g, _ = shape
        for m in ms:
            base = default_config(m, k, n, bits, g)  # weights on the left (wgmma from registers)
            right = dataclasses.replace(base, weights_left=False, num_stages=3,
                                        bn=min(128, base.bn * 2) if n % (base.bn * 2) == 0 else base.bn)
            cands = [("tc_default", base), ("tc_weights_right", right)]
            if m <= 4:
                cands.append(("gemv", default_gemv_config(m, k, n, bits, g)))
            for label, cfg in cands:
                if sw.out_of_time():
                    return
                sw.run_dense(shape, m, label, cfg)


def tc_tune(sw, shapes, ms):
    """The tensor-core kernel (weights on the left) at M = 3..16: split-K (how many programs, i.e. waves of
    resident programs), software-pipeline stages, groups per loop iteration, warps and BN around the default."""
    for shape in shapes:
        _, k, n, bits, g, _ = shape
        ng = k // g
        for m in ms:
            base = default_config(m, k, n, bits, g)
            tiles = -(-m // base.bm) * (n // base.bn)
            cands = [("default", base)]
            for target in (132, 264, 396, 792, 1056, 2112):
                s = _splits_for(ng, tiles, target)
                gpi = 2 if (ng // s) % 2 == 0 else 1
                cands.append((f"programs{target}", dataclasses.replace(base, splits=s, groups_per_iter=gpi)))
            cands += [("stages2", dataclasses.replace(base, num_stages=2)),
                      ("stages4", dataclasses.replace(base, num_stages=4)),
                      ("gpi1", dataclasses.replace(base, groups_per_iter=1)),
                      ("warps8", dataclasses.replace(base, num_warps=8))]
            for bn in (64, 256):
                if bn != base.bn and n % bn == 0:
                    cands.append((f"bn{bn}", dataclasses.replace(
                        base, bn=bn, splits=_splits_for(ng, -(-m // base.bm) * (n // bn) * bn // 128, 528),
                        groups_per_iter=1)))
            seen = set()
            for label, cfg in cands:
                if cfg in seen:
                    continue
                seen.add(cfg)
                if sw.out_of_time():
                    return
                sw.run_dense(shape, m, label, cfg)


def moe_paths(sw, ms):
    """Routed experts at M = 1..32 tokens (10 pairs each): the per-pair GEMV path against the sorted tiles, to
    place routed_experts' MOE_GEMV_MAX_PAIRS."""
    for m in ms:
        for label, cfg in (("gemv", MoEGemvConfig()), ("tiles", MoEConfig())):
            if sw.out_of_time():
                return
            sw.run_moe(m, label, cfg)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one (default) config per shape: compile check")
    ap.add_argument("--budget-s", type=float, default=200.0, help="start no new config after this many seconds")
    ap.add_argument("--reps", type=int, default=5, help="profiled repetitions per config")
    ap.add_argument("--only", default="", help="comma list of shape names (and/or 'moe')")
    ap.add_argument("--out", default="", help="JSON path (default $OUT/quant_sweep.json)")
    ap.add_argument("--plan", default="gemv", choices=("gemv", "small_m", "moe", "tc_tune", "moe_paths"),
                    help="gemv: the GEMV sweep below; small_m: M = 3..16 tensor-core kernel with the weights on "
                         "the right (default) vs on the left (weights_left) vs the GEMV; moe: the MoE decode "
                         "configs only")
    ap.add_argument("--ms", default="4,16", help="token counts of the small_m, tc_tune and moe_paths plans")
    args = ap.parse_args()
    sw = Sweep(args)
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    sw.copy_bw = copy_bandwidth()
    print(f"copy bandwidth {sw.copy_bw / 1e12:.2f} TB/s", flush=True)
    only = set(filter(None, args.only.split(",")))
    order = [v for v in args.only.split(",") if v]
    shapes = sorted((s for s in SHAPES if not only or s[0] in only),  # in --only's order
                    key=lambda s: order.index(s[0]) if s[0] in order else 0)
    do_moe = not only or "moe" in only

    if args.plan == "small_m":
        small_m(sw, shapes, tuple(int(v) for v in args.ms.split(",")))
        sw.write()
        sw.table()
        return
    if args.plan in ("tc_tune", "moe_paths"):
        ms = tuple(int(v) for v in args.ms.split(","))
        if args.plan == "tc_tune":
            tc_tune(sw, shapes, ms)
        else:
            moe_paths(sw, ms)
        sw.write()
        sw.table()
        return
    if args.plan == "moe":
        for m in MOE_MS:
            for label, cfg in MOE_CFGS:
                if not sw.out_of_time():
                    sw.run_moe(m, label, cfg)
        sw.write()
        sw.table()
        return
    # pass 1: the default config everywhere
    for shape in shapes:
        _, k, n, bits, g, _ = shape
        for m in MS:
            if sw.out_of_time():
                break
            sw.run_dense(shape, m, "default", default_gemv_config(m, k, n, bits, g))
    if do_moe:
        for m in MOE_MS:
            if not sw.out_of_time():
                sw.run_moe(m, "default", MoEGemvConfig())
    if not args.quick:
        # pass 2: M = 1 variants
        for shape in shapes:
            _, k, n, bits, g, _ = shape
            for label, cfg in dense_variants(1, k, n, bits, g)[1:]:
                if sw.out_of_time():
                    break
                sw.run_dense(shape, 1, label, cfg)
        # pass 3: M = 2, 4 with the best M = 1 config re-fitted (rows / splits for M)
        best = sw.best()
        for shape in shapes:
            name, k, n, bits, g, _ = shape
            b1 = best.get(("dense", name, 1))
            if not b1 or b1["label"] == "default":
                continue
            for m in MS[1:]:
                if sw.out_of_time():
                    break
                base = default_gemv_config(m, k, n, bits, g)
                c1 = b1["config"]
                cfg = dataclasses.replace(base, bn=c1["bn"], num_warps=c1["num_warps"], fields=c1["fields"],
                                          unroll=c1["unroll"], sync_loads=c1["sync_loads"])
                cfg = _fit(cfg, m, k, n, bits, g)
                if cfg is not None and cfg != base:
                    sw.run_dense(shape, m, "best_m1:" + b1["label"], cfg)
        # pass 4: MoE variants
        if do_moe:
            for m in MOE_MS:
                for label, cfg in MOE_CFGS[1:]:
                    if sw.out_of_time():
                        break
                    sw.run_moe(m, label, cfg)
    if sw.out_of_time():
        print(f"time budget of {args.budget_s:.0f}s reached: remaining configs skipped", flush=True)
    sw.write()
    sw.table()


if __name__ == "__main__":
    main()
