"""bench/invariance_probe.py on the CPU: it covers every op at every row count and finds what it must find."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_invariance_probe_quick_on_cpu(tmp_path):
    out = tmp_path / "probe.json"
    subprocess.run([sys.executable, "bench/invariance_probe.py", "--quick", "--ms", "3,32,33", "--rows-checked", "2",
                    "--out", str(out)],
                   cwd=ROOT, check=True, env={"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
                                             "PATH": "/usr/bin:/bin", "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}, capture_output=True)
    result = json.loads(out.read_text())
    rows = result["rows"]
    ops = {r["op"] for r in rows}
    assert len(ops) == 10 and {r["m"] for r in rows} == {2, 3, 32, 33}  # either side of each path threshold
    assert len(rows) == 10 * 2 * 4
    # a row-wise norm cannot depend on the other rows: the probe must call it invariant everywhere
    assert all(r["equal"] and r["equal_to_m2"] for r in rows if r["op"] == "rms_norm")
    # dense_matmul keeps one reduction order for every M (interpreted here): it must come out invariant
    assert all(r["equal"] for r in rows if r["op"] == "dense_matmul_4096")
    # the MoE reference on the CPU is row-wise (per-row expert gathers): solo rows must carry their own routing
    assert all(r["equal"] for r in rows if r["op"] == "moe_int4_64x2560x512" and r["m"] <= 3), \
        [r for r in rows if r["op"].startswith("moe")]
    # every M=2 row equals itself: the M=2 comparison is wired to the M=2 call
    assert all(r["equal_to_m2"] for r in rows if r["m"] == 2)
    # the quant matmul's path labels follow the dispatch thresholds (GEMV to 2, the kernel to 32, XLA above)
    paths = {r["m"]: r["path"] for r in rows if r["op"] == "quant_int4_2560x4096"}
    assert paths[33] == "dequant_dot"
    assert set(result["summary"]) == {"row_counts_that_differ", "row_counts_that_differ_from_m2"}
