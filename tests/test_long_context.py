"""Decode after a long chunked prefill equals transformers' greedy continuation (tests/fixtures/reference_long.*).

The engine (`LLM` over `RealRunner`, sparse QSA straight from the pages) prefills 600- and 1,500-token prompts of
the tiny checkpoint (budget 16, ratio 4: nearly every query is sparse) in 250-token chunks, whose boundaries fall
inside 4-token blocks and 16-token pages, then decodes 16 tokens. The fixture is recorded by
`tools/make_fixtures.py --long` from tests/fixtures/tiny_causal as it is on disk.
"""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

import flashnext_jax as fj
from flashnext_jax.runner import RealRunner

FIXTURES = Path(__file__).parents[1] / "tests" / "fixtures"
META = json.loads((FIXTURES / "reference_long.json").read_text())
REF = np.load(FIXTURES / "reference_long.npz")


def test_fixture_was_recorded_for_these_weights():
    sha = hashlib.sha256((FIXTURES / "tiny_causal" / "model.safetensors").read_bytes()).hexdigest()
    assert sha == META["checkpoint_sha256"], "tiny_causal changed: re-run tools/make_fixtures.py --long"


def test_decode_after_long_chunked_prefill_equals_transformers():
    model = fj.load(FIXTURES / "tiny_causal", dtype="float32")
    tags = list(META["prompts"])
    prompts = [REF[f"{t}/ids"].tolist() for t in tags]
    lm = fj.LLM(RealRunner(model), max_model_len=2048, page_size=16, max_num_seqs=2, max_num_batched_tokens=250,
                min_batch_bucket=2, min_token_bucket=4)
    outs = lm.generate(prompts, fj.SamplingParams(max_tokens=META["max_new_tokens"], temperature=0.0,
                                                  ignore_eos=True))
    for tag, out in zip(tags, outs):
        assert out.token_ids == REF[f"{tag}/generated"].tolist(), tag
    assert lm.engine.counters["steps"] > 2 * 1500 // 250
