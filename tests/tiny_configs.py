"""Small random configs for unit tests that do not need transformers fixtures."""

from flashnext_jax.config import from_hf_config


def tiny_hf_config(**overrides) -> dict:
    hf = dict(
        model_type="qwen4_exp_text", vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_parameters=dict(rope_theta=1e7, partial_rotary_factor=0.5),
        indexer_n_heads=3, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=8,
        output_gate_type="sigmoid", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, hc_count=4, hc_lowrank=8, ple_layer_ids=[2], ple_embed_dim=32,
        ngram_vocab_size_base=100, eos_token_id=1, mtp_num_hidden_layers=1,
    )
    hf.update(overrides)
    return hf


def tiny_config(**overrides):
    return from_hf_config(tiny_hf_config(**overrides))
