"""The batch-invariant bf16 dense_matmul with and without its fixed K splits (issue 19's cost): device time per call
at decode and prefill row counts for the plain weights of an invariant step, and the rows' bits at every M.

Why: in the H100 profile of an invariant decode step the largest single cost was dense_matmul with BN 16 (in_proj_a
and in_proj_b, N = 48: 3 programs looping 40 K blocks each, ~31 us a call, 2 per GDN layer). `k_splits` cuts K
into S splits by K and N alone (S fp32 partials added in a fixed tree); this bench measures what that buys against
S = 1 (the stop 38 kernel), and checks on the GPU that row i of an M-row call equals row i alone at every M.

    GPU: PYTHONPATH=. python3 bench/dense_matmul_splits.py --out $OUT/dense_matmul_splits.json
    CPU (interpret, small shapes, tests/test_bench_dense_matmul_splits.py):
         JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/dense_matmul_splits.py --quick --out /tmp/dms.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from bench.quant_matmul import measure
from pallas_kernels import dense_matmul as dm
from pallas_kernels.kernel_switch import resolve_impl

SHAPES = {  # name: (N, K) of a plain [N, K] weight in the model
    "in_proj_a_48x2560": (48, 2560),
    "router_32x2560": (32, 2560),
    "router_512x2560": (512, 2560),
    "dense_4096x2560": (4096, 2560),
}
QUICK_SHAPES = {"small_48x512": (48, 512), "wide_128x256": (128, 256)}


def call(x, w, interpret):
    return dm.dense_matmul(x, w, interpret=interpret)


def run(shapes, ms, interpret: bool, time_it: bool) -> list[dict]:
    rows = []
    key = jax.random.key(0)
    for name, (n, k) in shapes.items():
        kx, kw, key = jax.random.split(key, 3)
        w = (jax.random.normal(kw, (n, k), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
        x_all = jax.random.normal(kx, (max(ms), k), jnp.float32).astype(jnp.bfloat16)
        splits = dm.k_splits(k, -(-n // dm.N_ALIGN) * dm.N_ALIGN)
        fn = jax.jit(lambda x, w: call(x, w, interpret))
        alone = np.asarray(fn(x_all[:1], w).astype(jnp.float32))
        for m in ms:
            x = x_all[:m]
            y = np.asarray(fn(x, w).astype(jnp.float32))
            ref = np.asarray(dm.dense_matmul_reference(x, w).astype(jnp.float32))
            err = float(np.abs(y - ref).max() / (np.abs(ref).max() + 1e-6))
            row = dict(shape=name, n=n, k=k, m=m, splits=splits, row0_equal_alone=bool((y[:1] == alone).all()),
                       max_rel_err_vs_xla=err)
            if time_it:
                with mock.patch.object(dm, "k_splits", lambda k, n: 1):
                    fn1 = jax.jit(lambda x, w: call(x, w, interpret))
                    us1 = measure(fn1, x, w, n_calls=1)[0] * 1e6
                row.update(us_split=measure(fn, x, w, n_calls=1)[0] * 1e6, us_one_split=us1)
                row["speedup"] = row["us_one_split"] / row["us_split"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes, interpreted on the CPU, no timing")
    ap.add_argument("--ms", default="1,2,8,16,17,64,512")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    interpret = resolve_impl(None) != "pallas"
    ms = [int(m) for m in args.ms.split(",")] if not args.quick else [1, 2, 17]
    rows = run(QUICK_SHAPES if args.quick else SHAPES, ms, interpret, time_it=not interpret)
    summary = dict(rows_equal_alone_at_every_m=all(r["row0_equal_alone"] for r in rows),
                   speedup_by_shape_at_m1={r["shape"]: round(r["speedup"], 2) for r in rows
                                           if r["m"] == 1 and "speedup" in r})
    res = dict(summary=summary, device=str(jax.devices()[0].device_kind), jax=jax.__version__,
               date=datetime.date.today().isoformat(), interpret=interpret, rows=rows)
    out = args.out or os.path.join(os.environ.get("OUT", "/tmp"), "dense_matmul_splits.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{'shape':<20} {'M':>5} {'S':>3} {'equal':>6} {'us S':>8} {'us S=1':>8} {'x':>6}")
    for r in rows:
        print(f"{r['shape']:<20} {r['m']:>5} {r['splits']:>3} {str(r['row0_equal_alone']):>6} "
              f"{r.get('us_split', float('nan')):8.1f} {r.get('us_one_split', float('nan')):8.1f} "
              f"{r.get('speedup', float('nan')):6.2f}")
    print("summary", json.dumps(summary))
    return res


if __name__ == "__main__":
    main()
