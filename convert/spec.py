"""The canonical tensor set of a checkpoint, derived from its HF config through the model's own description.

Canonical names are the HF text-model names without `model.language_model.` / `model.`; `lm_head.weight` and
`mtp.*` unchanged; routed experts stacked per layer (`...mlp.experts.gate_up_proj` [E, 2I, H] with gate rows
first, `...mlp.experts.down_proj` [E, H, I]). Shapes here are torch orientation ([out, in] for linears); a
QuantizedWeight stores the transpose of its last two dims (logical [..., K=in, N=out]). The shapes come from
`flashnext_jax.weights.expected_tensors` (one description of the model for loader, converter and tests); this
module adds what only the converter needs: which tensors may be stored quantized and which write group owns them.
The n-gram table is not a canonical tensor (see `ngram_table_shape`).
"""

from __future__ import annotations

import dataclasses

from convert.errors import ConvertError
from flashnext_jax.config import ConfigError, ModelConfig, from_hf_config, text_config_dict
from flashnext_jax.ple import NgramHasher
from flashnext_jax.weights import PLE_BUFFERS
from flashnext_jax.weights import expected_tensors as model_tensors


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    quantizable: bool  # a linear / embedding / expert stack that a checkpoint may store quantized
    group: str  # "embed", "layer_007", "head", "mtp": the unit the converter writes and the PP stage owns
    optional: bool = False


def model_config(hf_config: dict) -> ModelConfig:
    if "model_type" not in hf_config:  # a bare text config, or a wrapper written without model_type
        hf_config = dict(hf_config.get("text_config") or hf_config, model_type="qwen4_exp_text")
    try:
        return from_hf_config(hf_config)
    except ConfigError as e:
        raise ConvertError(str(e)) from None


def text_config(hf_config: dict) -> dict:
    """The text config: `text_config` of the multimodal wrapper (model_type qwen4_exp) or the config itself."""
    try:
        return text_config_dict(hf_config)
    except ConfigError as e:
        raise ConvertError(str(e)) from None


def ngram_table_shape(hf_config: dict) -> tuple[int, int]:
    """[rows, width] of the concatenated n-gram table of the (single) PLE layer."""
    cfg = model_config(hf_config)
    return NgramHasher(cfg).padded_rows, cfg.ngram_row_width


def ple_layers(hf_config: dict) -> list[int]:
    """0-based decoder-layer indices holding a PLE module (config uses 1-based `ple_layer_ids`)."""
    return list(model_config(hf_config).ple_layers)


def layer_group(i: int) -> str:
    return f"layer_{i:03d}"


def group_of(name: str) -> str:
    """The write/stage group of a canonical name (also for names outside the expected set). The vision tower
    ("vision") belongs with the embeddings' stage: its rows replace image pads' embeddings."""
    if name.startswith("visual."):
        return "vision"
    if name.startswith("mtp."):
        return "mtp"
    if name.startswith("layers."):
        return layer_group(int(name.split(".")[1]))
    if name.startswith("embed_tokens."):
        return "embed"
    return "head"


def expected_tensors(hf_config: dict, *, with_mtp: bool = True) -> dict[str, TensorSpec]:
    """Canonical name -> TensorSpec for every tensor the model has (MTP ones when with_mtp)."""
    cfg = model_config(hf_config)
    out = {}
    for name, shape in model_tensors(cfg, with_mtp=with_mtp).items():
        quantizable = len(shape) >= 2 and not name.endswith("conv1d.weight")
        out[name] = TensorSpec(tuple(shape), quantizable, group_of(name))
    for layer in cfg.ple_layers:
        sizes = {"layer_multipliers": cfg.ngram_size, "ngram_heads_vocab_sizes": cfg.ngram_heads,
                 "ngram_heads_offsets": cfg.ngram_heads}
        for buf in PLE_BUFFERS:
            name = f"layers.{layer}.ple.{buf}"
            out[name] = TensorSpec((sizes[buf.rsplit(".", 1)[-1]],), False, group_of(name))
    if with_mtp and cfg.mtp_num_hidden_layers:
        # vLLM drops a block_inject_weight on the MTP final mixer if a checkpoint carries one: accept it.
        name = "mtp.hyper_connection_mixer.block_inject_weight.weight"
        out[name] = TensorSpec((cfg.hc_count, cfg.hc_hidden_size), True, "mtp", optional=True)
    return out
