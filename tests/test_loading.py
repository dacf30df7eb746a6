"""Loading checkpoints: both layouts, both expert forms, and every bad-input error."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import flashnext_jax
from flashnext_jax import CheckpointError, ConfigError
from synthetic import random_tensors, write_checkpoint
from tiny_configs import tiny_hf_config

PROMPT = [5, 9, 1, 17, 33, 2, 64, 1, 1, 90, 12, 3]


@pytest.fixture(scope="module")
def tensors():
    return random_tensors(tiny_hf_config())


def test_release_and_causal_layouts_with_per_expert_and_fused_experts_load_the_same(tmp_path, tensors):
    hf = tiny_hf_config()
    a = flashnext_jax.load(write_checkpoint(tmp_path / "a", hf, *tensors, layout="release", per_expert=True),
                           dtype="float32")
    b = flashnext_jax.load(write_checkpoint(tmp_path / "b", hf, *tensors, layout="causal", per_expert=False,
                                            parts=4, files=3), dtype="float32")
    la, lb = a.logits(PROMPT), b.logits(PROMPT)
    assert la.shape == (len(PROMPT), hf["vocab_size"]) and la.dtype == np.float32
    np.testing.assert_array_equal(la, lb)
    assert a.has_mtp and a.table.shape == b.table.shape


def _first_file(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / sorted(set(index["weight_map"].values()))[0]


def test_missing_and_unexpected_tensors_are_listed_in_one_error(tmp_path, tensors):
    path = write_checkpoint(tmp_path / "m", tiny_hf_config(), *tensors, files=1)
    file = _first_file(path)
    data = load_file(str(file))
    del data["model.language_model.layers.0.linear_attn.A_log"]
    del data["lm_head.weight"]
    data["model.language_model.layers.0.linear_attn.surprise.weight"] = np.zeros(3, np.float32)
    save_file(data, str(file))
    index = {"metadata": {}, "weight_map": {name: file.name for name in data}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        flashnext_jax.load(path)
    msg = str(err.value)
    assert "layers.0.linear_attn.A_log" in msg and "lm_head.weight" in msg and "surprise" in msg


def test_shape_mismatch_is_reported(tmp_path, tensors):
    tens, table = tensors
    bad = dict(tens)
    bad["layers.0.linear_attn.norm.weight"] = np.zeros(7, np.float32)
    with pytest.raises(CheckpointError, match=r"layers\.0\.linear_attn\.norm\.weight is \[7\], expected \[8\]"):
        flashnext_jax.load(write_checkpoint(tmp_path / "s", tiny_hf_config(), bad, table))


def test_truncated_shard_is_an_error(tmp_path, tensors):
    path = write_checkpoint(tmp_path / "t", tiny_hf_config(), *tensors)
    file = _first_file(path)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated|cannot read"):
        flashnext_jax.load(path)


def test_config_with_a_missing_field_names_it(tmp_path, tensors):
    path = write_checkpoint(tmp_path / "c", tiny_hf_config(), *tensors)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["text_config"]["hc_lowrank"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="hc_lowrank"):
        flashnext_jax.load(path)


def test_token_ids_out_of_range_or_empty_are_rejected(tmp_path, tensors):
    model = flashnext_jax.load(write_checkpoint(tmp_path / "r", tiny_hf_config(), *tensors))
    for bad in ([], [0, 128], [-1], [[1, 2]]):
        with pytest.raises(ValueError):
            model.logits(bad)
    with pytest.raises(ValueError, match="out of range"):
        model.generate([3, 4, 500], max_new_tokens=2)


def test_llm_without_a_model_is_the_embedded_demo_model():
    """LLM() serves the demo model (what the README's first command runs), not the tests' toy oracle."""
    from flashnext_jax.api import DEMO_MODEL
    from flashnext_jax.runner import RealRunner

    llm = flashnext_jax.LLM(max_model_len=64, max_num_batched_tokens=64)
    assert isinstance(llm.runner, RealRunner) and llm.runner.model.path == DEMO_MODEL
    assert llm.tokenizer is not None
    assert type(flashnext_jax.LLM("toy").runner).__name__ == "ToyRunner"
