"""Quantized checkpoints through the model: HF quantized directories loaded directly (converted in memory) and
directories written by the converter, against transformers fp32 logits on the libraries' own dequantisation."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import convert
import flashnext_jax
from pallas_kernels.quant_layout import QuantizedWeight

QUANT = Path(__file__).parent / "fixtures" / "quant"
REF = load_file(str(QUANT / "reference_logits.safetensors"))


def check(model, fmt):
    for b, ids in enumerate(REF["input_ids"]):
        ref = REF[fmt][b]
        got = model.logits(ids)
        assert (got.argmax(-1) == ref.argmax(-1)).all()
        assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-4


@pytest.mark.parametrize("fmt", ["ct", "gptq"])
def test_hf_quantized_directory_loads_directly_and_matches_reference(fmt):
    model = flashnext_jax.load(QUANT / fmt, dtype="float32")
    quantized = [leaf for leaf in __import__("jax").tree.leaves(model.params, is_leaf=lambda x: isinstance(
        x, QuantizedWeight)) if isinstance(leaf, QuantizedWeight)]
    assert {q.bits for q in quantized} >= ({4, 6, 8} if fmt == "ct" else {4, 8})  # stays quantized in memory
    check(model, fmt)


@pytest.mark.parametrize("fmt", ["ct", "gptq"])
def test_converted_directory_matches_reference(tmp_path, fmt):
    convert.convert(str(QUANT / fmt), str(tmp_path / "out"))
    check(flashnext_jax.load(tmp_path / "out", dtype="float32"), fmt)


def test_cli_generates_from_a_quantized_hf_directory():
    ids = ",".join(str(int(t)) for t in REF["input_ids"][0][:8])
    proc = subprocess.run([sys.executable, "-m", "flashnext_jax.cli", "generate", "--model", str(QUANT / "ct"),
                           "--token-ids", ids, "--max-new-tokens", "3"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "output_token_ids: [" in proc.stdout


def test_bfloat16_load_of_a_quantized_checkpoint_runs_every_quantized_matmul_in_bfloat16(monkeypatch):
    """A quantized embedding dequantizes to float32 rows; the model must cast them to the load dtype, or every
    layer runs in float32, which `linear` keeps on the exact reference path instead of the kernels (the real-size
    decode step on the H200 was 20x slower than it should be). Records what reaches quant_matmul."""
    import jax

    import pallas_kernels.quant_matmul as qm

    seen = []
    real = qm.quant_matmul

    def spy(x, w, **kw):
        seen.append((x.dtype, kw.get("impl")))
        return real(x, w, **kw)

    monkeypatch.setattr(qm, "quant_matmul", spy)
    jax.clear_caches()  # trace afresh so every call passes through the spy
    model = flashnext_jax.load(QUANT / "ct", dtype="bfloat16")
    ids = REF["input_ids"][0][:8]
    got = model.logits(ids)
    jax.clear_caches()
    assert seen, "no quantized matmul was traced"
    assert {d for d, _ in seen} == {np.dtype("bfloat16")} and {i for _, i in seen} == {None}, set(seen)
    ref = REF["ct"][0][:8]
    assert np.isfinite(got).all() and np.abs(got - ref).max() / np.abs(ref).max() <= 5e-2
