"""Synthetic checkpoints for tests and benchmarks (no libraries, no downloads).

`write_safetensors` writes tensors one at a time from producers (bounded memory; producer None leaves a sparse
hole of zeros); `write_synthetic_checkpoint` writes a whole Qwen4Exp checkpoint directory for a config in one of
the layouts the converter reads: "bf16" (per-expert or fused experts), "fp8" (block FP8, FP8 n-gram table with one
scale) or "ct" (compressed-tensors pack-quantized, Minachist-like recipe, random packed words).
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable

import ml_dtypes
import numpy as np

from convert import spec as specmod
from convert.safetensors_io import DTYPE_NAMES

Producer = Callable[[], np.ndarray] | None


def write_safetensors(path: str, items: list[tuple[str, np.dtype, tuple[int, ...], Producer]]) -> int:
    """Write a safetensors file; returns its size. Each producer is called once, when its tensor is written."""
    header, off = {}, 0
    for name, dt, shape, _ in items:
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
        header[name] = {"dtype": DTYPE_NAMES[np.dtype(dt)], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(len(hb).to_bytes(8, "little"))
        f.write(hb)
        start = f.tell()
        for name, dt, shape, prod in items:
            b, e = header[name]["data_offsets"]
            if prod is None:
                continue
            a = np.ascontiguousarray(prod(), dtype=dt)
            if a.shape != tuple(shape):
                raise ValueError(f"{name}: producer gave {a.shape}, declared {shape}")
            f.seek(start + b)
            f.write(a.reshape(-1).view(np.uint8).data)
        f.truncate(start + off)
    return start + off


def tiny_text_config(**over) -> dict:
    cfg = {
        "model_type": "qwen4_exp_text", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "hc_count": 4, "hc_lowrank": 64, "ple_layer_ids": [2], "ple_embed_dim": 64,
        "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 8, "ngram_vocab_size_base": 100,
        "make_ngram_vocab_size_divisible_by": 128, "split_ngram_parts": 4, "indexer_n_heads": 2,
        "indexer_kv_heads": 1, "indexer_head_dim": 32, "indexer_budget": 64, "indexer_compress_ratio": 4,
        "eos_token_id": 1, "tie_word_embeddings": False, "mtp_num_hidden_layers": 1,
        "mtp": {"num_hidden_layers": 1, "layer_types": ["full_attention"]},
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    }
    cfg.update(over)
    return cfg


# Minachist-like recipe: module regex -> (bits, group_size); None = kept 16-bit
CT_RECIPE = [
    (r"\.mlp\.experts\.\d+\.", (4, 128)),
    (r"\.(linear_attn\.(in_proj_qkv|in_proj_z|out_proj)|self_attn\.[qkvo]_proj|shared_expert\.\w+_proj)$", (6, 64)),
    (r"(hyper_connection\w*\.input_mix_weight_(down|up)|lm_head|embed_tokens|index_qk_proj|ple\.(key|value)_proj)$",
     (8, 128)),
]


def _ct_scheme(module: str, k: int) -> tuple[int, int] | None:
    if module.startswith("mtp."):
        return None
    for rx, (b, g) in CT_RECIPE:
        if re.search(rx, module):
            g = min(g, k)
            while k % g:
                g //= 2
            return b, g
    return None


def write_synthetic_checkpoint(path: str, text_cfg: dict, fmt: str = "bf16", *, fused_experts: bool = False,
                               release_layout: bool = True, seed: int = 0, random_data: bool = True,
                               shard_bytes: int = 1 << 30, ngram_shards: int | None = None) -> dict:
    """Writes config.json, shards and index; returns {source_name: np.ndarray} for tensors it kept (small runs
    only: random_data and a total below 64 MB), else {}."""
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    keep = {}
    bf16, f8 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)
    prefix = "model.language_model." if release_layout else "model."
    exp = specmod.expected_tensors({"text_config": text_cfg, "tie_word_embeddings": False}
                                   if release_layout else text_cfg)
    items: list[tuple[str, np.dtype, tuple[int, ...], Producer]] = []
    ct_groups: dict[tuple[int, int], list[str]] = {}

    def rnd(dt, shape):
        if not random_data:
            return None
        if np.dtype(dt).kind in "iu":
            return lambda: rng.integers(np.iinfo(dt).min, np.iinfo(dt).max, size=shape, dtype=dt, endpoint=True)
        if np.dtype(dt) == f8:
            return lambda: (rng.standard_normal(shape, np.float32) * 0.5).astype(f8)
        return lambda: (rng.standard_normal(shape, np.float32) * 0.05).astype(dt)

    def src_name(c: str) -> str:
        return c if c.startswith(("lm_head", "mtp.")) else prefix + c

    def add_linear(module: str, shape: tuple[int, int], quantizable: bool):
        n, k = shape
        if fmt == "ct" and quantizable and (sch := _ct_scheme(module, k)):
            b, g = sch
            ct_groups.setdefault((b, g), []).append(module)
            items.append((f"{module}.weight_packed", np.dtype(np.int32), (n, -(-k * b // 32)),
                          rnd(np.int32, (n, -(-k * b // 32)))))
            items.append((f"{module}.weight_scale", np.dtype(np.float16), (n, k // g),
                          (lambda s=(n, k // g): (rng.standard_normal(s, np.float32) * 0.01).astype(np.float16))
                          if random_data else None))
            items.append((f"{module}.weight_shape", np.dtype(np.int64), (2,), lambda s=(n, k): np.array(s, np.int64)))
        elif fmt == "fp8" and quantizable and not module.endswith(("lm_head", "embed_tokens")):
            items.append((f"{module}.weight", f8, shape, rnd(f8, shape)))
            ss = (-(-n // 128), -(-k // 128))
            items.append((f"{module}.weight_scale_inv", np.dtype(np.float32), ss,
                          (lambda ss=ss: rng.uniform(0.5, 2.0, ss).astype(np.float32)) if random_data else None))
        else:
            items.append((f"{module}.weight", bf16, shape, rnd(bf16, shape)))

    for c, sp in exp.items():
        if c.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            continue
        sn = src_name(c)
        if c.endswith(".weight") and len(sp.shape) == 2:
            add_linear(sn[: -len(".weight")], sp.shape, sp.quantizable)
        elif c.endswith(("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")):
            items.append((sn, np.dtype(np.int64), sp.shape, lambda s=sp.shape: np.arange(s[0], dtype=np.int64) + 7))
        else:
            items.append((sn, bf16, sp.shape, rnd(bf16, sp.shape)))
    for c, sp in exp.items():  # experts
        if not c.endswith("mlp.experts.gate_up_proj"):
            continue
        base = src_name(c[: -len(".gate_up_proj")])
        e, i2, h = sp.shape
        i = i2 // 2
        if fused_experts and fmt == "bf16":
            items.append((f"{base}.gate_up_proj", bf16, (e, i2, h), rnd(bf16, (e, i2, h))))
            items.append((f"{base}.down_proj", bf16, (e, h, i), rnd(bf16, (e, h, i))))
            continue
        for x in range(e):
            add_linear(f"{base}.{x}.gate_proj", (i, h), True)
            add_linear(f"{base}.{x}.up_proj", (i, h), True)
            add_linear(f"{base}.{x}.down_proj", (h, i), True)
    ple = specmod.ple_layers(text_cfg)
    if ple:
        rows, width = specmod.ngram_table_shape(text_cfg)
        parts = ngram_shards or text_cfg.get("split_ngram_parts", 4)
        base = f"{prefix}layers.{ple[0]}.ple.ple_embedding.ngram_embedding"
        per = -(-rows // parts)
        dt = f8 if fmt == "fp8" else bf16
        for j in range(parts):
            r = min(per, rows - j * per)
            items.append((f"{base}.shard_{j}.weight", dt, (r, width), rnd(dt, (r, width))))
        if fmt == "fp8":
            items.append((f"{base}.weight_scale", bf16, (1,), lambda: np.array([0.125], bf16)))

    # shards
    shards, cur, size = [], [], 0
    for it in items:
        n = int(np.prod(it[2], dtype=np.int64)) * np.dtype(it[1]).itemsize
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += n
    shards.append(cur)
    small = random_data and sum(int(np.prod(i[2])) * np.dtype(i[1]).itemsize for i in items) < (64 << 20)
    weight_map = {}
    for j, sh in enumerate(shards):
        fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        if small:
            vals = {name: prod() for name, _, _, prod in sh}
            keep.update(vals)
            sh = [(name, dt, shape, (lambda v=vals[name]: v)) for name, dt, shape, _ in sh]
        write_safetensors(os.path.join(path, fname), sh)
        weight_map.update({name: fname for name, *_ in sh})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config = ({"model_type": "qwen4_exp", "architectures": ["Qwen4ExpForConditionalGeneration"],
               "text_config": text_cfg, "tie_word_embeddings": False} if release_layout else dict(text_cfg))
    if fmt == "ct":
        groups = {}
        for j, ((b, g), mods) in enumerate(sorted(ct_groups.items())):
            groups[f"group_{j}"] = {"targets": mods, "weights": {"num_bits": b, "type": "int", "symmetric": True,
                                                                 "strategy": "group", "group_size": g},
                                    "format": "pack-quantized"}
        config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                         "quantization_status": "compressed", "config_groups": groups,
                                         "ignore": []}
    elif fmt == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "Qwen2Tokenizer"}, f)
    return keep

