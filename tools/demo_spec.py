"""What the demo model is, shared by tools/train_demo.py (JAX venv) and tools/make_fixtures.py (torch venv).

Only the standard library and `tokenizers` are imported here, so both venvs can use it: the tiny config, the
special tokens and chat template, and the byte-level BPE tokenizer recipe (Qwen3.5's pre-tokenizer regex: the
fixtures assert it equals transformers' `PRETOKENIZE_REGEX`, so AutoTokenizer and raw `tokenizers` agree).
"""
from __future__ import annotations

from typing import Iterable

VOCAB = 512
N_SPECIAL = 3
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 509, 510, 511 (appended after training)
EOS_ID = VOCAB - N_SPECIAL  # 509

TEXT_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=8,
    layer_types=(["linear_attention"] * 3 + ["indexed_attention"]) * 2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    attention_bias=False,
    attention_dropout=0.0,
    partial_rotary_factor=0.25,
    # real: mrope_section [11,11,10] over 32 rotary frequencies; tiny: 4 frequencies -> [2,1,1]
    rope_parameters=dict(
        rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
        mrope_interleaved=True,
    ),
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    output_gate_type="sigmoid",
    mamba_ssm_dtype="float32",
    indexer_n_heads=8,  # real: 4; 8 so relu block scores almost never tie at 0 (see notes)
    indexer_kv_heads=1,
    indexer_head_dim=16,
    indexer_budget=16,
    indexer_compress_ratio=4,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=16,  # I/H = 0.25 as in the release (640/2560)
    shared_expert_intermediate_size=16,
    norm_topk_prob=True,
    router_aux_loss_coef=0.001,
    output_router_logits=False,
    hc_count=4,
    hc_lowrank=16,
    ple_layer_ids=[2],
    ple_embed_dim=64,
    ple_conv_kernel_size=4,
    ngram_size=3,
    heads_per_ngram=8,
    ngram_vocab_size_base=1000,
    make_ngram_vocab_size_divisible_by=128,
    split_ngram_parts=4,
    seed=1234,
    bos_token_id=EOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=None,
    initializer_range=0.02,
    use_cache=True,
)
MTP_CONFIG = dict(hybrid=True, layer_types=["full_attention"], mtp_use_hidden_state_from_layer=None,
                  num_hidden_layers=1, rope_theta=10000000)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen3.5's pre-tokenizer split (transformers models/qwen3_5/tokenization_qwen3_5.py; make_fixtures asserts equality)
PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_tokenizer(texts: Iterable[str]):
    """Byte-level BPE with VOCAB - N_SPECIAL merges-vocabulary + the special tokens appended (ids EOS_ID..)."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(BPE(dropout=None, unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                        fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - N_SPECIAL, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB - N_SPECIAL, tok.get_vocab_size()
    tok.add_special_tokens(SPECIALS)
    assert tok.get_vocab_size() == VOCAB
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == EOS_ID + i
    return tok
