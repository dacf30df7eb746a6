"""Converter benchmark: throughput and peak RSS on a synthetic >= 4 GB compressed-tensors checkpoint.

    /work/venv312/bin/python bench/convert.py [--workdir /work/bench_convert] [--layers 3] [--keep]

The checkpoint has real-size tensors (Qwen3.8-Flash-Next text config, `--layers` decoder layers, 512 experts per
layer int4 g128 per-expert tensors, int6 GDN/attention/shared expert, int8 embed/lm_head/mixers, a bf16 n-gram
table of `--ngram-gb`, random packed words); MTP is left out (its bf16 experts alone are 5 GB). The conversion
runs in a child process (`python -m convert SRC DST --verify`) so that its peak RSS is the child's ru_maxrss;
restore (load_converted, every tensor to host numpy) is timed in a second child. Results go to
bench/results/convert.json; the synthetic data is deleted unless --keep.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RESTORE = """
import sys, time, json
import numpy as np
from convert import load_converted
t = time.time(); n = 0
cfg, it, table, scale = load_converted(sys.argv[1])
for name, v in it:
    arrs = list(v.planes) + [v.scales] if hasattr(v, "planes") else [v]
    n += sum(np.asarray(a).nbytes for a in arrs)
print(json.dumps({"seconds": time.time() - t, "bytes": n}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/work/bench_convert")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--ngram-gb", type=float, default=1.0)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="reuse an existing synthetic source in --workdir")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "convert.json"))
    args = ap.parse_args()

    from convert.spec import ngram_table_shape
    from convert.testing import write_synthetic_checkpoint

    with open("/work/shared/reference/qwen38_text_config.json") as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = args.layers
    cfg["layer_types"] = cfg["layer_types"][: args.layers - 1] + ["full_attention"]
    cfg["mtp_num_hidden_layers"] = 0
    cfg["mtp"] = {"num_hidden_layers": 0}
    # shrink only the n-gram table: rows = 16 heads x ~base
    cfg["ngram_vocab_size_base"] = int(args.ngram_gb * 1e9 / (160 * 2) / 16)
    rows, width = ngram_table_shape(cfg)
    cfg["split_ngram_parts"] = 8

    src, dst = os.path.join(args.workdir, "src"), os.path.join(args.workdir, "dst")
    t = time.time()
    if not (args.reuse and os.path.exists(os.path.join(src, "config.json"))):
        shutil.rmtree(args.workdir, ignore_errors=True)
        write_synthetic_checkpoint(src, cfg, "ct", shard_bytes=4 << 30, ngram_shards=8, seed=0)
    shutil.rmtree(dst, ignore_errors=True)
    gen_s = time.time() - t
    src_bytes = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src) if f.endswith(".safetensors"))
    with open(os.path.join(src, "model.safetensors.index.json")) as f:
        n_src_tensors = len(json.load(f)["weight_map"])
    print(f"synthetic checkpoint: {src_bytes / 1e9:.2f} GB, {n_src_tensors} tensors, generated in {gen_s:.0f} s",
          file=sys.stderr)
    subprocess.run(["sync"], check=False)

    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    t = time.time()
    r = subprocess.run([sys.executable, "-m", "convert", src, dst, "--no-progress"], env=env,
                       capture_output=True, text=True)
    conv_s = time.time() - t
    if r.returncode:
        raise SystemExit(r.stderr)
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    t = time.time()
    r = subprocess.run([sys.executable, "-c", "import sys; from convert.writer import verify_converted; "
                        "verify_converted(sys.argv[1])", dst], env=env, capture_output=True, text=True)
    verify_s = time.time() - t
    if r.returncode:
        raise SystemExit(r.stderr)
    m = json.load(open(os.path.join(dst, "manifest.json")))

    def tbytes(info):
        if info["kind"] == "quantized":
            q = info["quant"]
            parts = q["planes"] + [q["scales"]]
        else:
            parts = [info]
        import numpy as np
        from convert.writer import _np_dtype

        return sum(int(np.prod(p["shape"])) * _np_dtype(p["dtype"]).itemsize for p in parts)

    largest_out = max(tbytes(i) for i in m["tensors"].values())
    from convert.safetensors_io import open_checkpoint_files

    largest_src = max(t.nbytes for t in open_checkpoint_files(src).values())
    largest = max(largest_out, largest_src)
    dst_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(dst) for f in fs)

    t = time.time()
    rr = subprocess.run([sys.executable, "-c", RESTORE, dst], env=env, capture_output=True, text=True)
    if rr.returncode:
        raise SystemExit(rr.stderr)
    restore = json.loads(rr.stdout.strip().splitlines()[-1])

    import importlib.metadata as md

    versions = {"python": platform.python_version()}
    for p in ("numpy", "jax", "orbax-checkpoint", "tensorstore", "ml_dtypes"):
        try:
            versions[p] = md.version(p)
        except md.PackageNotFoundError:
            pass
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
        "versions": versions,
        "checkpoint": {"format": "compressed-tensors pack-quantized (synthetic, real-size tensors)",
                       "layers": args.layers, "experts_per_layer": cfg["num_experts"], "mtp": False,
                       "ngram_table_shape": [rows, width], "source_bytes": src_bytes,
                       "source_tensors": n_src_tensors, "canonical_tensors": len(m["tensors"]),
                       "dst_bytes": dst_bytes, "generate_seconds": round(gen_s, 1)},
        "verify": {"what": "verify_converted(dst): re-read every group + n-gram part, shapes/dtypes (no digests "
                             "without --verify at convert time)", "seconds": round(verify_s, 2)},
        "disk": {"note": "dd 2 GiB with conv=fdatasync on this VM: ~166 MB/s; conversion is write-bound here"},
        "convert": {"command": "python -m convert SRC DST", "seconds": round(conv_s, 2),
                    "gb_per_s": round(src_bytes / 1e9 / conv_s, 3), "peak_rss_bytes": peak_rss,
                    "peak_rss_gib": round(peak_rss / 2**30, 3), "largest_tensor_bytes": largest,
                    "rss_target_bytes": 2 * largest + 2**30, "rss_within_target": peak_rss <= 2 * largest + 2**30},
        "restore": {"what": "load_converted(dst): every weight group restored by Orbax to host numpy",
                    "seconds": round(restore["seconds"], 2), "bytes": restore["bytes"],
                    "gb_per_s": round(restore["bytes"] / 1e9 / restore["seconds"], 3)},
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
