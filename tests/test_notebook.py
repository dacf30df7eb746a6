"""Execute examples/quickstart.ipynb end to end (nbclient) so it never rots."""

import json
import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).parents[1]


def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    # kernel "python3" = the interpreter running the tests (a kernelspec in a private JUPYTER_PATH takes priority)
    spec_dir = tmp_path / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    NotebookClient(nb, kernel_name="python3", timeout=600,
                   resources={"metadata": {"path": str(ROOT / "examples")}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "acceptance" in outputs and "bytes/slot" in outputs and "drained" in outputs


def test_committed_notebook_keeps_its_outputs_streams_and_ends_with_the_internals():
    """The notebook is committed executed (readers see results without running it), shows `llm.stream`, and keeps
    engine internals in its last, marked section."""
    nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("outputs") for c in code), [c.source[:40] for c in code if not c.get("outputs")]
    assert any("llm.stream" in c.source for c in code)
    marks = [i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and c.source.startswith("## ")]
    internals = next(i for i in marks if "internals" in nb.cells[i].source.lower())
    assert internals == marks[-1]
    assert all(".engine" not in c.source and "runner" not in c.source for c in nb.cells[:internals])
