"""bench/invariance_layers.py (issue 19): on the CPU, where the engine is batch invariant, every tapped sublayer
output (PLE, hyper-connections, GDN, QSA, MoE, final logits) of a request's prefill step is bitwise the same beside
another request as alone; the GPU run of the same script names the first op that is not."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_run_taps_every_sublayer_and_finds_them_equal(tmp_path):
    out = tmp_path / "invariance_layers.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, str(ROOT / "bench" / "invariance_layers.py"), "--tiny", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=900)
    result = json.loads(out.read_text())
    taps = [r["tap"] for r in result["rows"]]
    for name in ("ple", "hyper_read", "gdn", "qsa_paged", "hyper_write", "moe", "final_logits"):
        assert name in taps, taps
    assert all(r["equal"] and r["solo_repeat_equal"] for r in result["rows"]), result["rows"]
    assert result["summary"]["first_differing_tap"] is None
