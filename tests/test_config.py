import copy
import json
from pathlib import Path

import pytest

from flashnext_jax.config import GDN, QSA, ConfigError, from_hf_config, load_config, real_config

REAL = Path(__file__).parents[1] / "flashnext_jax" / "reference" / "qwen38_text_config.json"


def real_dict():
    return json.loads(REAL.read_text())


def test_real_config_parses_with_expected_values():
    cfg = real_config()
    assert cfg.num_hidden_layers == 48 and cfg.hidden_size == 2560 and cfg.vocab_size == 248320
    assert cfg.qsa_layers == tuple(range(3, 48, 4)) and len(cfg.gdn_layers) == 36
    assert cfg.rotary_dim == 64 and cfg.rope_theta == 1e7 and cfg.block_topk == 512
    assert cfg.ple_layers == (1,) and cfg.ngram_heads == 16 and cfg.ngram_row_width == 160
    assert cfg.output_gate_type == "sigmoid" and cfg.num_experts == 512 and cfg.num_experts_per_tok == 10
    assert cfg.mtp_num_hidden_layers == 1 and cfg.eos_token_id == 248044


def test_wrapper_config_and_indexed_attention_spelling_parse_the_same():
    text = real_dict()
    wrapped = {"model_type": "qwen4_exp", "architectures": ["Qwen4ExpForConditionalGeneration"], "text_config": text}
    renamed = copy.deepcopy(text)
    renamed["layer_types"] = ["indexed_attention" if t == "full_attention" else t for t in text["layer_types"]]
    assert from_hf_config(wrapped) == from_hf_config(text) == from_hf_config(renamed)
    assert from_hf_config(text).layer_types[3] == QSA and from_hf_config(text).layer_types[0] == GDN


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_attention_heads", "linear_num_value_heads",
                                   "moe_intermediate_size", "hc_lowrank", "indexer_budget"])
def test_missing_field_is_named(field):
    d = real_dict()
    del d[field]
    with pytest.raises(ConfigError, match=field):
        from_hf_config(d)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"layer_types": ["linear_attention"] * 47}, "layer_types"),
        ({"layer_types": ["linear_attention"] * 47 + ["sliding_attention"]}, "layer_types"),
        ({"indexer_kv_heads": 2}, "indexer_kv_heads"),
        ({"indexer_budget": 2047}, "indexer_budget"),
        ({"output_gate_type": "tanh"}, "output_gate_type"),
        ({"num_experts_per_tok": 513}, "num_experts_per_tok"),
        ({"ple_layer_ids": [4]}, "ple_layer_ids"),
        ({"hidden_size": "2560"}, "hidden_size"),
        ({"model_type": "llama"}, "model_type"),
    ],
)
def test_contradictory_or_bad_field_is_named(change, field):
    d = real_dict()
    d.update(change)
    with pytest.raises(ConfigError, match=field):
        from_hf_config(d)


def test_wrapper_without_text_config_is_an_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen4_exp"}))
    with pytest.raises(ConfigError, match="text_config"):
        load_config(tmp_path)


def test_config_is_frozen_and_hashable():
    cfg = real_config()
    with pytest.raises(Exception):
        cfg.hidden_size = 1  # type: ignore[misc]
    assert hash(cfg) == hash(real_config())
