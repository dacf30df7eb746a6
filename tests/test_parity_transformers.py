"""fp32 parity with HF transformers' qwen4_exp on the committed fixtures (recorded by tools/make_fixtures.py).

Prompts: a short one, one with EOS inside (PLE segment rule), a 250-token one where QSA's sparse path acts
(budget 16, ratio 4), and one whose length is a multiple of 4 (the own-token-in-block rule). Both checkpoint
layouts are loaded: the CausalLM layout written by transformers and the release layout of the demo model.
"""

import json
from pathlib import Path

import numpy as np
import pytest

import flashnext_jax

ROOT = Path(__file__).parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
REF = np.load(FIXTURES / "reference_tiny.npz")
PROMPTS = list(json.loads((FIXTURES / "reference_tiny.json").read_text())["prompts"])
CHECKPOINTS = {"release": ROOT / "flashnext_jax" / "demo_model", "causal": FIXTURES / "tiny_causal"}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def model(request):
    return flashnext_jax.load(CHECKPOINTS[request.param], dtype="float32")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_fp32_logits_match_transformers(model, prompt):
    ref = REF[f"{prompt}/logits"]
    got = model.logits(REF[f"{prompt}/ids"])
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-5
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_generate_matches_transformers(model, prompt):
    ref = REF[f"{prompt}/generated"].tolist()
    assert len(ref) >= 32
    assert model.generate(REF[f"{prompt}/ids"], max_new_tokens=len(ref)) == ref


def test_ple_ngram_ids_match_transformers(model):
    for prompt in PROMPTS:
        ids = REF[f"{prompt}/ids"]
        np.testing.assert_array_equal(model.hasher.ids(model.hasher.initial_context(), ids), REF[f"{prompt}/ple_ngram_ids"])


def test_mtp_draft_logits_match_the_torch_reimplementation():
    """MTP is not in transformers: the fixture builds it from transformers' own decoder layer per the spec."""
    model = flashnext_jax.load(CHECKPOINTS["release"], dtype="float32")
    for prompt in ("short", "long"):
        ids = REF[f"{prompt}/ids"]
        hidden, _ = model.hidden_and_logits(ids)
        ref_h = REF[f"{prompt}/mtp_hidden"]
        assert np.abs(hidden - ref_h).max() / np.abs(ref_h).max() <= 1e-5
        ref = REF[f"{prompt}/mtp_logits"]
        got = model.mtp_logits(ids)
        assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-5
        assert (got.argmax(-1) == ref.argmax(-1)).all()
