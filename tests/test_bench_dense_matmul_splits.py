"""bench/dense_matmul_splits.py on the CPU (interpreted, small shapes): it runs, uses more than one K split where N
is small, and row 0 of every M-row call equals row 0 alone (the GPU run of the same script times the splits)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_checks_rows_at_every_m(tmp_path):
    out = tmp_path / "dms.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, str(ROOT / "bench" / "dense_matmul_splits.py"), "--quick", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=600)
    res = json.loads(out.read_text())
    assert res["summary"]["rows_equal_alone_at_every_m"] is True
    assert {r["m"] for r in res["rows"]} == {1, 2, 17}
    assert max(r["splits"] for r in res["rows"]) > 1
    assert all(r["max_rel_err_vs_xla"] < 1e-2 for r in res["rows"])
