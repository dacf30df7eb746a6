"""See what the GPU compiler makes of a Pallas (Triton backend) kernel without a GPU.

Lowers a jitted function for CUDA on the CPU (Pallas -> Triton TTIR, with the GPU info patched to an H200),
then compiles each pallas_call's TTIR with upstream Triton for sm_90 and writes TTGIR / PTX / SASS next to it,
printing registers, spills and the SASS instruction histogram of the innermost loop. jaxlib's own Triton
pipeline is close to, not identical with, upstream Triton: numbers are indicative (they were in stops 8-9).

Needs a separate environment with `triton` (Triton 3.9 was used; it bundles ptxas / nvdisasm / cuobjdump):
    python3.11 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install triton==3.9.0
Usage (from the repo root, jax venv):
    PYTHONPATH=. python tools/sass_offline.py OUT_PREFIX  # after editing `build()` below, or import and call
    from tools.sass_offline import ttir_of, compile_ttir
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys

TRITON_PY = os.environ.get("TRITON_PY", "/tmp/tvenv/bin/python")
_COMPILE = r'''
import sys, triton, subprocess, os
from triton.backends.compiler import GPUTarget
src, nw, ns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=nw, num_stages=ns))
for ext in ("ptx", "ttgir"):
    open(src + "." + ext, "w").write(k.asm[ext])
open(src + ".cubin", "wb").write(k.asm["cubin"])
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
open(src + ".sass", "w").write(subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", src + ".cubin"],
                                              capture_output=True, text=True).stdout)
print(subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", src + ".cubin"],
                     capture_output=True, text=True).stdout)
'''


def ttir_of(f, *args) -> list[str]:
    """TTIR text of every pallas_call in jax.jit(f)(*args), lowered for CUDA on this (CPU) machine."""
    import jax
    from jax._src.pallas.triton import gpu_info, lowering, pallas_call_registration as pcr

    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    pcr.gpu_info_lib.get_gpu_info = lambda *a, **k: h200
    captured, orig = [], lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        r = orig(*a, **k)
        captured.append(r.module.operation.get_asm(enable_debug_info=False))
        return r
    pcr.lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        pcr.lowering.lower_jaxpr_to_triton_module = orig
    return captured


def compile_ttir(path: str, num_warps: int = 4, num_stages: int = 1) -> str:
    """Compiles path (TTIR) for sm_90; returns cuobjdump's resource usage (REG / LOCAL = spills / SHARED)."""
    out = subprocess.run([TRITON_PY, "-c", _COMPILE, path, str(num_warps), str(num_stages)], capture_output=True,
                         text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return " ".join(re.findall(r"(REG:\d+|LOCAL:\d+|SHARED:\d+)", out.stdout))


def loop_histogram(sass_path: str):
    """(instructions, opcode counts) of each backward-branch loop body in the SASS."""
    ins, labels = [], {}
    for line in open(sass_path).read().splitlines():
        m = re.match(r"\.L_x_(\d+):", line.strip())
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if m:
            ins.append(m.group(2))
    loops = []
    for i, text in enumerate(ins):
        m = re.search(r"BRA `\(\.L_x_(\d+)\)", text)
        if m and labels.get(m.group(1), 1 << 30) < i:
            body = ins[labels[m.group(1)]:i + 1]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            loops.append((len(body), ops))
    return loops


def build():
    """Example: the dense tensor-core kernel at M = 16, int6 g64, weights on the left."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import quant_layout as ql
    from pallas_kernels.quant_matmul import DenseConfig, quant_matmul_pallas
    k, n = 2560, 1024
    w = jax.tree_util.tree_map(jnp.asarray, ql.pack(np.zeros((k, n), np.int8), np.ones((k // 64, n), np.float16), 6, 64))
    cfg = DenseConfig(bm=16, bn=128, splits=4, groups_per_iter=1, num_stages=3, weights_left=True)
    return ttir_of(lambda x, w: quant_matmul_pallas(x, w, config=cfg), jnp.ones((16, k), jnp.bfloat16), w), 4, 3


if __name__ == "__main__":
    prefix = sys.argv[1] if len(sys.argv) > 1 else "/tmp/kernel"
    modules, warps, stages = build()
    for i, text in enumerate(modules):
        path = f"{prefix}_{i}.ttir"
        open(path, "w").write(text)
        print(path, compile_ttir(path, warps, stages))
        for n_ins, ops in loop_histogram(path + ".sass"):
            print(f"  loop: {n_ins} instructions; {dict(ops.most_common(10))}")
