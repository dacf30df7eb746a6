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

# String content renders exactly as before content parts existed; an image part becomes the Qwen-VL placeholder
# (the processor expands <|image_pad|> to one token per merged patch).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Vision tokens (issue 21) take the ids of four byte-level tokens no valid UTF-8 text can produce (bytes 0xFC-0xFF
# never occur in UTF-8, so no merge uses them either): adding them changes neither the weights nor the tokenization
# of any text. The real release has them after its BPE vocabulary (248053, 248054, 248056, 248057).
VISION_TOKENS = {"<|vision_start|>": 184, "<|vision_end|>": 185, "<|image_pad|>": 186, "<|video_pad|>": 187}
VISION_CONFIG_IDS = {"vision_start_token_id": 184, "vision_end_token_id": 185, "image_token_id": 186,
                     "video_token_id": 187}

# preprocessor_config.json: the release's Qwen2VLImageProcessor settings (mean/std 0.5, bicubic, 1/255) with the
# pixel limits scaled to the tiny patch: the release allows 256..65536 patches of 16x16 (65536..16777216 pixels);
# the demo the same patch counts of 4x4, so an image costs the same number of tokens as in the release.
PREPROCESSOR_CONFIG = {
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
    "do_convert_rgb": True, "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
    "size": {"shortest_edge": 256 * 4 * 4, "longest_edge": 65536 * 4 * 4},
}

def add_vision_tokens(tok):
    """The byte-level tokenizer with VISION_TOKENS as special tokens at their ids (idempotent)."""
    import json

    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    by_id = {i: s for s, i in vocab.items()}
    for content, idx in VISION_TOKENS.items():
        if by_id[idx] != content:
            assert by_id[idx] in _UNREACHABLE_BYTE_CHARS, (idx, by_id[idx])
            del vocab[by_id[idx]]
            vocab[content] = idx  # the added token then keeps this id (a new one would collide with the BPE ids)
    have = {a["content"] for a in spec["added_tokens"]}
    spec["added_tokens"] += [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for c, i in VISION_TOKENS.items() if c not in have]
    spec["added_tokens"].sort(key=lambda a: a["id"])
    return Tokenizer.from_str(json.dumps(spec))


_UNREACHABLE_BYTE_CHARS = {chr(c) for c in range(0xFC, 0x100)}  # ByteLevel maps bytes 0xA1-0xFF to themselves


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
    return add_vision_tokens(tok)
