"""bench/qsa_offload.py (issue 14 item 6) runs at its --tiny CPU setting and writes the summary the issue asks for."""

import json

from bench import qsa_offload


def test_tiny_run_writes_the_summary(tmp_path):
    out = tmp_path / "qsa_offload.json"
    qsa_offload.main(["--tiny", "--out", str(out)])
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert {"context", "step_ms_offload", "step_ms_device", "cost_ratio", "device_bytes_saved"} <= set(summary)
    assert summary["context"] == 512 and summary["device_bytes_saved"] > 0
    modes = {r["mode"]: r["page_memory"] for r in result["rows"]}
    assert modes["offload"]["qsa_k"] == "pinned_host" and modes["device"]["qsa_k"] == "device"
