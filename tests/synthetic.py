"""Write small random HF-style checkpoints (both layouts) for loader tests that need no transformers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from flashnext_jax.config import from_hf_config
from flashnext_jax.ple import NgramHasher
from flashnext_jax.weights import expected_tensors


def random_tensors(hf: dict, seed: int = 0, scale: float = 0.3) -> tuple[dict, np.ndarray]:
    cfg = from_hf_config(hf)
    rng = np.random.default_rng(seed)
    tensors = {n: (rng.standard_normal(s) * scale).astype(ml_dtypes.bfloat16)
               for n, s in expected_tensors(cfg).items()}
    table = (rng.standard_normal((NgramHasher(cfg).padded_rows, cfg.ngram_row_width))).astype(ml_dtypes.bfloat16)
    return tensors, table


def write_checkpoint(path: Path, hf: dict, tensors: dict, table: np.ndarray, *, layout: str = "release",
                     per_expert: bool = True, parts: int = 2, files: int = 2) -> Path:
    """layout 'release': wrapper config + model.language_model.*; 'causal': qwen4_exp_text + model.*."""
    path.mkdir(parents=True, exist_ok=True)
    text = dict(hf, split_ngram_parts=parts)
    if layout == "release":
        text["layer_types"] = ["full_attention" if t == "indexed_attention" else t
                               for t in from_hf_config(hf).layer_types]
        config = {"model_type": "qwen4_exp", "architectures": ["Qwen4ExpForConditionalGeneration"],
                  "text_config": text}
        prefix = "model.language_model."
    else:
        config, prefix = text, "model."
    (path / "config.json").write_text(json.dumps(config))
    out = {}
    for name, value in tensors.items():
        full = name if name.startswith(("lm_head", "mtp.")) else prefix + name
        m = re.match(r"(.*\.experts)\.(gate_up_proj|down_proj)$", full)
        if m and per_expert:
            inter = value.shape[1] // 2 if m.group(2) == "gate_up_proj" else None
            for e in range(value.shape[0]):
                if inter:
                    out[f"{m.group(1)}.{e}.gate_proj.weight"] = value[e, :inter]
                    out[f"{m.group(1)}.{e}.up_proj.weight"] = value[e, inter:]
                else:
                    out[f"{m.group(1)}.{e}.down_proj.weight"] = value[e]
        else:
            out[full] = value
    ple_layer = from_hf_config(hf).ple_layers[0]
    hasher = NgramHasher(from_hf_config(hf))
    for buf, value in (("layer_multipliers", hasher.multipliers), ("ngram_heads_vocab_sizes", hasher.sizes),
                       ("ngram_heads_offsets", hasher.offsets)):
        out[f"{prefix}layers.{ple_layer}.ple.ple_embedding.{buf}"] = value
    for i, shard in enumerate(np.split(table, parts)):
        out[f"{prefix}layers.{ple_layer}.ple.ple_embedding.ngram_embedding.shard_{i}.weight"] = np.ascontiguousarray(shard)
    if layout == "release":
        out["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    names = sorted(out)
    weight_map = {}
    for f in range(files):
        fname = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        chunk = {n: np.ascontiguousarray(out[n]) for n in names[f::files]}
        save_file(chunk, str(path / fname))
        weight_map |= {n: fname for n in chunk}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path
