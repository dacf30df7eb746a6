"""bench/invariance_layers.py (issue 19): on the CPU, where the engine is batch invariant, every tapped sublayer
output (PLE, hyper-connections, GDN, QSA, MoE, final logits) of a request's step is bitwise the same beside another
request as alone, in each case: its prefill step, its first decode step, and the second chunk of a prompt cut short by
a long request ahead of it; the GPU run of the same script names the first op that is not."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_run_taps_every_sublayer_of_each_case_and_finds_them_equal(tmp_path):
    out = tmp_path / "invariance_layers.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, str(ROOT / "bench" / "invariance_layers.py"), "--tiny", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=900)
    result = json.loads(out.read_text())
    assert sorted(result["cases"]) == ["chunked", "decode", "prefill"]
    for case, res in result["cases"].items():
        taps = [r["tap"] for r in res["rows"]]
        for name in ("ple", "hyper_read", "gdn", "qsa_paged", "hyper_write", "moe", "final_logits"):
            assert name in taps, (case, taps)
        assert all(r["equal"] and r["solo_repeat_equal"] for r in res["rows"]), (case, res["rows"])
        assert res["first_differing_tap"] is None
    start, end = result["cases"]["chunked"]["tokens"]
    assert 0 < start < end == result["cases"]["chunked"]["prompt_lengths"]["A"]  # really A's second chunk
    assert result["cases"]["decode"]["tokens"][1] - result["cases"]["decode"]["tokens"][0] == 1
