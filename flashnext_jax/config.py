"""Model configuration: one frozen dataclass, parsed from HF `config.json` with precise errors.

Accepts the multimodal wrapper (`model_type: qwen4_exp` with a `text_config`) and the bare text config
(`qwen4_exp_text`). QSA layers may be written `full_attention` (the release) or `indexed_attention`
(what transformers writes back). Every required field is checked; a missing or contradictory field raises
`ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that cannot describe a Qwen3.8-Flash-Next text model."""


GDN = "linear_attention"
QSA = "indexed_attention"
_LAYER_TYPE_ALIASES = {"linear_attention": GDN, "full_attention": QSA, "indexed_attention": QSA}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    # gated GQA attention (QSA layers)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # QSA indexer; `indexer_budget is None` means plain dense causal attention
    indexer_n_heads: int | None
    indexer_head_dim: int | None
    indexer_budget: int | None
    indexer_compress_ratio: int | None
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    output_gate_type: str
    # MoE
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    # hyper-connections
    hc_count: int
    hc_lowrank: int
    # PLE / hashed n-gram table (0-based decoder layer indices)
    ple_layers: tuple[int, ...]
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    split_ngram_parts: int
    seed: int
    # MTP
    mtp_num_hidden_layers: int
    eos_token_id: int
    bos_token_id: int | None
    max_position_embeddings: int

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == GDN)

    @property
    def qsa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == QSA)

    @property
    def hc_hidden_size(self) -> int:
        return self.hc_count * self.hidden_size

    @property
    def qsa_enabled(self) -> bool:
        return self.indexer_budget is not None

    @property
    def block_topk(self) -> int:
        return self.indexer_budget // self.indexer_compress_ratio

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ngram_row_width(self) -> int:
        return self.ple_embed_dim // self.ngram_heads

    @property
    def ple_conv_dilation(self) -> int:
        return self.ngram_size  # hard-wired in the reference: dilation = ngram_size

    @property
    def ple_conv_state_len(self) -> int:
        return (self.ple_conv_kernel_size - 1) * self.ple_conv_dilation


def _pick(d: dict, name: str, *, default: Any = dataclasses.MISSING, kind: type | tuple = (int,)) -> Any:
    if name not in d or d[name] is None:
        if default is dataclasses.MISSING:
            raise ConfigError(f"config field '{name}' is missing")
        return default
    value = d[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ConfigError(f"config field '{name}' has type {type(value).__name__}, expected {kinds[0].__name__}")
    return value


def text_config_dict(hf: dict) -> dict:
    """The text part of an HF config: `text_config` of the wrapper, or the config itself."""
    model_type = hf.get("model_type")
    if model_type == "qwen4_exp":
        if not isinstance(hf.get("text_config"), dict):
            raise ConfigError("config field 'text_config' is missing (model_type qwen4_exp)")
        return hf["text_config"]
    if model_type == "qwen4_exp_text":
        return hf
    raise ConfigError(f"config field 'model_type' is {model_type!r}, expected 'qwen4_exp' or 'qwen4_exp_text'")


def from_hf_config(hf: dict) -> ModelConfig:
    """Parse an HF config dict (wrapper or text) into a validated ModelConfig."""
    t = text_config_dict(hf)
    num_layers = _pick(t, "num_hidden_layers")
    if "layer_types" in t and t["layer_types"] is not None:
        raw_types = t["layer_types"]
        unknown = sorted({x for x in raw_types if x not in _LAYER_TYPE_ALIASES})
        if unknown:
            raise ConfigError(f"config field 'layer_types' has unknown layer types {unknown}")
        layer_types = tuple(_LAYER_TYPE_ALIASES[x] for x in raw_types)
    else:
        interval = _pick(t, "full_attention_interval", default=4)
        layer_types = tuple(GDN if (i + 1) % interval else QSA for i in range(num_layers))
    if len(layer_types) != num_layers:
        raise ConfigError(
            f"config field 'layer_types' has {len(layer_types)} entries but num_hidden_layers is {num_layers}"
        )

    rope = t.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ConfigError("config field 'rope_parameters' must be an object")
    rope_theta = rope.get("rope_theta", t.get("rope_theta"))
    if rope_theta is None:
        raise ConfigError("config field 'rope_parameters.rope_theta' is missing")
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"config field 'rope_parameters.rope_type' is {rope.get('rope_type')!r}; only 'default'")
    partial = rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 1.0))
    head_dim = _pick(t, "head_dim")
    rotary_dim = int(head_dim * partial)
    if "partial_rotary_factor" in t and "partial_rotary_factor" in rope and t["partial_rotary_factor"] != partial:
        raise ConfigError("config fields 'partial_rotary_factor' and 'rope_parameters.partial_rotary_factor' differ")

    qsa_names = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
    qsa_given = {n: t.get(n) for n in qsa_names}
    if any(v is not None for v in qsa_given.values()):
        for n, v in qsa_given.items():
            if v is None:
                raise ConfigError(f"config field '{n}' is missing (QSA needs all of {', '.join(qsa_names)})")
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"config field '{n}' must be a positive integer, got {v!r}")
        if qsa_given["indexer_kv_heads"] != 1:
            raise ConfigError("config field 'indexer_kv_heads' must be 1")
        if qsa_given["indexer_budget"] % qsa_given["indexer_compress_ratio"]:
            raise ConfigError("config field 'indexer_budget' must be divisible by 'indexer_compress_ratio'")
        if rotary_dim > qsa_given["indexer_head_dim"]:
            raise ConfigError("config field 'indexer_head_dim' is smaller than the rotary dimension")

    hidden = _pick(t, "hidden_size")
    eos = t.get("eos_token_id", hf.get("eos_token_id"))
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    ple_ids = t.get("ple_layer_ids") or []
    if ple_ids and eos is None:
        raise ConfigError("config field 'eos_token_id' is missing (needed by the PLE n-gram hash)")
    for pid in ple_ids:
        if not 1 <= pid <= num_layers:
            raise ConfigError(f"config field 'ple_layer_ids' has {pid}, outside 1..{num_layers}")
        if layer_types[pid - 1] != GDN:
            raise ConfigError(f"config field 'ple_layer_ids' puts PLE on layer {pid}, which is not linear_attention")
    ngram_size = _pick(t, "ngram_size", default=3)
    heads_per_ngram = _pick(t, "heads_per_ngram", default=8)
    ple_embed_dim = _pick(t, "ple_embed_dim", default=hidden)
    if ple_ids and ple_embed_dim % ((ngram_size - 1) * heads_per_ngram):
        raise ConfigError("config field 'ple_embed_dim' is not divisible by the number of n-gram heads")

    gate = t.get("output_gate_type") or t.get("hidden_act", "silu")
    if gate not in ("sigmoid", "silu"):
        raise ConfigError(f"config field 'output_gate_type' is {gate!r}, expected 'sigmoid' or 'silu'")
    if t.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config field 'hidden_act' is {t.get('hidden_act')!r}; only 'silu' is supported")
    mamba_dtype = t.get("mamba_ssm_dtype", "float32")
    if mamba_dtype != "float32":
        raise ConfigError(f"config field 'mamba_ssm_dtype' is {mamba_dtype!r}; only float32 is supported")

    n_heads = _pick(t, "num_attention_heads")
    n_kv = _pick(t, "num_key_value_heads")
    if n_heads % n_kv:
        raise ConfigError("config field 'num_attention_heads' must be a multiple of 'num_key_value_heads'")
    lk = _pick(t, "linear_num_key_heads")
    lv = _pick(t, "linear_num_value_heads")
    if lv % lk:
        raise ConfigError("config field 'linear_num_value_heads' must be a multiple of 'linear_num_key_heads'")
    n_experts = _pick(t, "num_experts")
    topk = _pick(t, "num_experts_per_tok")
    if not 0 < topk <= n_experts:
        raise ConfigError("config field 'num_experts_per_tok' must be in [1, num_experts]")
    hc_count = _pick(t, "hc_count", default=4)
    if hc_count < 2:
        raise ConfigError("config field 'hc_count' must be > 1")
    mtp = t.get("mtp") or {}
    mtp_layers = t.get("mtp_num_hidden_layers", mtp.get("num_hidden_layers", 0)) or 0
    if t.get("mtp_use_dedicated_embeddings"):
        raise ConfigError("config field 'mtp_use_dedicated_embeddings' is true; only shared embeddings are supported")
    if t.get("tie_word_embeddings", hf.get("tie_word_embeddings", False)):
        raise ConfigError("config field 'tie_word_embeddings' is true; this model has an untied lm_head")

    return ModelConfig(
        vocab_size=_pick(t, "vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        layer_types=layer_types,
        rms_norm_eps=float(_pick(t, "rms_norm_eps", default=1e-6, kind=(float, int))),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=float(rope_theta),
        indexer_n_heads=qsa_given["indexer_n_heads"],
        indexer_head_dim=qsa_given["indexer_head_dim"],
        indexer_budget=qsa_given["indexer_budget"],
        indexer_compress_ratio=qsa_given["indexer_compress_ratio"],
        linear_num_key_heads=lk,
        linear_num_value_heads=lv,
        linear_key_head_dim=_pick(t, "linear_key_head_dim"),
        linear_value_head_dim=_pick(t, "linear_value_head_dim"),
        linear_conv_kernel_dim=_pick(t, "linear_conv_kernel_dim", default=4),
        output_gate_type=gate,
        num_experts=n_experts,
        num_experts_per_tok=topk,
        moe_intermediate_size=_pick(t, "moe_intermediate_size"),
        shared_expert_intermediate_size=_pick(t, "shared_expert_intermediate_size"),
        norm_topk_prob=bool(t.get("norm_topk_prob", True)),
        hc_count=hc_count,
        hc_lowrank=_pick(t, "hc_lowrank"),
        ple_layers=tuple(sorted(p - 1 for p in set(ple_ids))),
        ple_embed_dim=ple_embed_dim,
        ple_conv_kernel_size=_pick(t, "ple_conv_kernel_size", default=4),
        ngram_size=ngram_size,
        heads_per_ngram=heads_per_ngram,
        ngram_vocab_size_base=_pick(t, "ngram_vocab_size_base", default=20_000_000),
        make_ngram_vocab_size_divisible_by=_pick(t, "make_ngram_vocab_size_divisible_by", default=128),
        split_ngram_parts=_pick(t, "split_ngram_parts", default=512),
        seed=_pick(t, "seed", default=1234),
        mtp_num_hidden_layers=int(mtp_layers),
        eos_token_id=eos,
        bos_token_id=t.get("bos_token_id", hf.get("bos_token_id")),
        max_position_embeddings=_pick(t, "max_position_embeddings", default=262144),
    )


def load_config(path: str | Path) -> ModelConfig:
    """Read `config.json` from a checkpoint directory (or a path to the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"no config.json at {file}")
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from None
    return from_hf_config(hf)


def real_config() -> ModelConfig:
    """The released Qwen3.8-Flash-Next text config, shipped in the package."""
    return load_config(Path(__file__).parent / "reference" / "qwen38_text_config.json")


__all__ = ["ModelConfig", "ConfigError", "from_hf_config", "load_config", "real_config", "GDN", "QSA"]
