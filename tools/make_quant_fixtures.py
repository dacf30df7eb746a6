"""Quantized fixtures for the converter, made with the real libraries.

Run with the fixture venv (torch, transformers, auto-round, compressed-tensors):

    /work/venvfx/bin/python tools/make_quant_fixtures.py [--out tests/fixtures/quant]

Writes, under --out:
  gptq/        AutoRound `format="auto_round"` (packing `auto_round:auto_gptq`), CausalLM layout (`model.` prefix),
               mixed 2/3/4/6/8 bits via layer_config (2/4/8 word packing, 3/6 bitstream), plus unquantized 16-bit.
  ct/          AutoRound `format="llm_compressor"` (compressed-tensors pack-quantized), rewritten into the real
               release layout (`model.language_model.`, qwen4_exp wrapper config, `full_attention`), Minachist-like:
               experts int4 g32 through a `re:` target, GDN/attention/shared expert int6 (g64, g32 where K=32),
               hyper-connection mixers, lm_head, indexer int8, PLE key_proj int8 g64, PLE value_proj int8 *channel*
               and embed_tokens int8 g64 packed with compressed-tensors directly; random bf16 `mtp.*` tensors with
               the real names (per-expert experts) in `model_extra_tensors.safetensors`, a few `model.visual.*`
               tensors and a `hashstats_*` buffer (both must be skipped), tokenizer and chat-template files.
  ct_asym.safetensors   compressed-tensors asymmetric (weight_zero_point) group and channel samples.
  awq_samples.safetensors, awq_config.json   AutoRound `format="auto_awq"` (4-bit asymmetric g32) tensors of a
               few modules and the export's quantization_config.
  library_dequant_{gptq,ct,ct_asym,awq}.safetensors
               the LIBRARIES' OWN dequantisation (float32, torch orientation [out, in]) of sample tensors of every
               bit width: auto-round's `QuantLinear` (auto_gptq zero-1 flavour) forward on an identity, and
               compressed-tensors' `PackedQuantizationCompressor.decompress`, auto-round's AWQ `dequantize_gemm`;
               scales are upcast to float32 before
               the library call so that the product is computed in float32.
  reference_logits.safetensors  transformers float32 logits of the dequantised models (`ct`, `gptq`) on `input_ids`.
               (transformers cannot load these quantized Qwen4Exp checkpoints itself, see checkpoint-formats.md:
               every tensor is dequantised with the library, the n-gram table merged, the experts fused, and the
               state dict loaded into a float32 Qwen4ExpForCausalLM.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SEED = 1234
PROMPTS = [  # candidate token ids (with 22 seeded random ones); the 2 with the largest margins are recorded
    [1, 17, 93, 140, 5, 77, 201, 33, 64, 9, 250, 12, 88, 190, 3, 45, 111, 160, 27, 8, 222, 99, 14, 70],
    [1, 230, 4, 56, 180, 19, 7, 133, 90, 61, 245, 2, 38, 150, 71, 205, 11, 66, 128, 31, 212, 49, 6, 101],
]


def tiny_config():
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["indexed_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        hc_count=4, hc_lowrank=64, ple_layer_ids=[2], ple_embed_dim=64, ngram_vocab_size_base=100,
        split_ngram_parts=4, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=64,
        indexer_compress_ratio=4, eos_token_id=1, bos_token_id=1, partial_rotary_factor=0.25,
        output_gate_type="sigmoid", tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def build_source(path: str) -> None:
    """A tiny random bf16 CausalLM checkpoint; zero-initialised norms/router/conv randomised (else trivial)."""
    from transformers import Qwen4ExpForCausalLM

    torch.manual_seed(SEED)
    model = Qwen4ExpForCausalLM(tiny_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("ple.conv1d.weight"):
                p.normal_(0.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            elif name == "lm_head.weight":
                p.normal_(0.0, 0.5)  # logits of order 1-10: clear argmax margins
            elif p.ndim >= 2 and "embed" not in name:
                p.normal_(0.0, 0.08)
    model.to(torch.bfloat16).save_pretrained(path)
    save_tokenizer(path)


def save_tokenizer(path: str) -> None:
    """A byte-level BPE tokenizer with 256 ids (no merges) and a chat template: only needs to exist."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<1>", bos_token="<1>", unk_token="<0>")
    fast.chat_template = "{% for m in messages %}<2>{{ m.role }} {{ m.content }}<1>{% endfor %}"
    fast.save_pretrained(path)


def _no_predefined_ignores():
    import auto_round.compressors.base as base

    base.get_predefined_ignore_layers = lambda model: []


def autoround_export(src: str, out: str, fmt: str, layer_config: dict, bits: int, group_size: int,
                     sym: bool = True) -> str:
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM

    from transformers import AutoTokenizer

    _no_predefined_ignores()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(src)
    ar = AutoRound(model, tokenizer=tok, scheme="W4A16", bits=bits, group_size=group_size, sym=sym, iters=0,
                   disable_opt_rtn=True, layer_config=layer_config, device_map="cpu", disable_model_free=True,
                   low_cpu_mem_usage=False)
    ar.quantize_and_save(out, format=fmt)
    # it writes into <out>/<name>-w4g32/ (or directly into out): find the dir with config.json
    for root, _, files in os.walk(out):
        if "config.json" in files and any(f.endswith(".safetensors") for f in files):
            return root
    raise RuntimeError(f"no checkpoint written under {out}")


GPTQ_LAYERS = {  # module regex -> scheme (AutoRound layer_config); default 4-bit g32
    r".*mlp.experts..*": {"bits": 4, "group_size": 32},
    r".*linear_attn.in_proj_qkv": {"bits": 6, "group_size": 32},
    r".*linear_attn.in_proj_z": {"bits": 2, "group_size": 32},
    r".*linear_attn.out_proj": {"bits": 3, "group_size": 32},
    r".*self_attn.(q|k|v|o)_proj": {"bits": 6, "group_size": 32},
    r".*shared_expert.(gate|up|down)_proj": {"bits": 8, "group_size": 32},
    r".*hyper_connection.*input_mix_weight_(down|up)": {"bits": 8, "group_size": 64},
    r".*indexer.index_qk_proj": {"bits": 8, "group_size": 32},
    r".*ple.(key|value)_proj": {"bits": 4, "group_size": 64},
    "lm_head": {"bits": 8, "group_size": 64},
}

CT_LAYERS = {
    r".*mlp.experts..*": {"bits": 4, "group_size": 32},
    r".*linear_attn.(in_proj_qkv|in_proj_z|out_proj)": {"bits": 6, "group_size": 64},
    r".*self_attn.(q|k|v|o)_proj": {"bits": 6, "group_size": 64},
    r".*shared_expert.(gate|up)_proj": {"bits": 6, "group_size": 64},
    r".*shared_expert.down_proj": {"bits": 6, "group_size": 32},
    r".*hyper_connection.*input_mix_weight_(down|up)": {"bits": 8, "group_size": 64},
    r".*indexer.index_qk_proj": {"bits": 8, "group_size": 32},
    r".*ple.key_proj": {"bits": 8, "group_size": 64},
    r".*ple.value_proj": {"bits": 16},  # replaced by an int8 channel-strategy tensor below
    "lm_head": {"bits": 8, "group_size": 64},
}


def _all_tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as h:
                for k in h.keys():
                    out[k] = h.get_tensor(k)
    return out


def _write_checkpoint(path: str, shards: dict[str, dict[str, torch.Tensor]]) -> None:
    weight_map = {}
    for fname, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, fname),
                  metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)


# ---------------------------------------------------------------------------------------------------------
# compressed-tensors helpers

def ct_scheme(bits: int, strategy: str, group_size: int | None, symmetric: bool = True):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group_size))


def ct_compress(w: torch.Tensor, bits: int, strategy: str, group_size: int | None, symmetric: bool = True,
                scale_dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Quantize w [N, K] with compressed-tensors' own qparams + pack (RTN, min-max)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = ct_scheme(bits, strategy, group_size, symmetric)
    n, k = w.shape
    g = k if strategy == "channel" else group_size
    wg = w.float().reshape(n, k // g, g)
    scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), scheme.weights)
    sd = {"weight": w.float(), "weight_scale": scale.to(scale_dtype), "weight_zero_point": zp}
    return PackedQuantizationCompressor.compress(sd, scheme)


def ct_decompress(params: dict[str, torch.Tensor], bits: int, strategy: str, group_size: int | None,
                  symmetric: bool = True) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    sd = dict(params)
    sd["weight_scale"] = sd["weight_scale"].float()
    out = PackedQuantizationCompressor.decompress(sd, ct_scheme(bits, strategy, group_size, symmetric))
    return out["weight"].float()


def ct_group_of(qcfg: dict, module: str) -> dict | None:
    """The weights args of the config group whose targets match `module` (exact, then regex), minus ignore."""
    from compressed_tensors.utils.match import match_name

    if any(match_name(module, t) for t in qcfg.get("ignore") or []):
        return None
    for g in qcfg["config_groups"].values():
        if any(match_name(module, t) for t in g["targets"] if not t.startswith("re:")):
            return g["weights"]
    for g in qcfg["config_groups"].values():
        if any(match_name(module, t) for t in g["targets"] if t.startswith("re:")):
            return g["weights"]
    return None


# ---------------------------------------------------------------------------------------------------------
# library dequantisation of every quantized module of a checkpoint (float32, [out, in])

def gptq_library_dequant(tensors: dict[str, torch.Tensor], qcfg: dict) -> dict[str, torch.Tensor]:
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

    assert qcfg["packing_format"] == "auto_round:auto_gptq", qcfg["packing_format"]
    out = {}
    for name in [k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")]:
        qweight, qzeros, scales = (tensors[f"{name}.{p}"] for p in ("qweight", "qzeros", "scales"))
        n = scales.shape[1]
        bits = qzeros.shape[1] * 32 // n
        k = qweight.shape[0] * 32 // bits
        g = k // scales.shape[0]
        ql = QuantLinear(bits, g, k, n, bias=False)
        ql.qweight.copy_(qweight)
        ql.qzeros.copy_(qzeros)
        ql.scales = scales.float()  # the library's own formula, computed in float32
        ql.post_init()
        with torch.no_grad():
            w_kn = ql(torch.eye(k, dtype=torch.float32))
        out[name] = w_kn.T.contiguous().float()
        out[name + "::bits"] = torch.tensor(bits)
    return out


def ct_library_dequant(tensors: dict[str, torch.Tensor], qcfg: dict) -> dict[str, torch.Tensor]:
    out = {}
    for name in [k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed")]:
        args = ct_group_of(qcfg, name)
        assert args is not None, name
        params = {p: tensors[f"{name}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")}
        if f"{name}.weight_zero_point" in tensors:
            params["weight_zero_point"] = tensors[f"{name}.weight_zero_point"]
        out[name] = ct_decompress(params, args["num_bits"], args["strategy"], args.get("group_size"),
                                  args.get("symmetric", True))
        out[name + "::bits"] = torch.tensor(args["num_bits"])
    return out


# ---------------------------------------------------------------------------------------------------------
# reference logits

def reference_model(dense: dict[str, torch.Tensor], prefix: str):
    """dense: source name -> float32 tensor (dequantised or upcast). Loads it into a float32 CausalLM."""
    from transformers import Qwen4ExpForCausalLM

    cfg = tiny_config()
    model = Qwen4ExpForCausalLM(cfg).float().eval()
    sd = {}
    shards = {}
    experts: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for name, t in dense.items():
        if name.startswith(("mtp.", "model.visual.")) or "hashstats" in name:
            continue
        local = "model." + name[len(prefix):] if name.startswith(prefix) else name
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", local)
        sh = re.match(r"(.*ngram_embedding)\.shard_(\d+)\.weight$", local)
        if m:
            experts.setdefault((m.group(1), int(m.group(2))), {})[m.group(3)] = t
        elif sh:
            shards.setdefault(sh.group(1), {})[int(sh.group(2))] = t
        else:
            sd[local] = t
    for key, parts in shards.items():
        sd[key + ".weight"] = torch.cat([parts[i] for i in sorted(parts)], 0)
    for mod in sorted({m for m, _ in experts}):
        n_exp = max(e for m, e in experts if m == mod) + 1
        sd[mod + ".gate_up_proj"] = torch.stack(
            [torch.cat([experts[(mod, e)]["gate"], experts[(mod, e)]["up"]], 0) for e in range(n_exp)])
        sd[mod + ".down_proj"] = torch.stack([experts[(mod, e)]["down"] for e in range(n_exp)])
    # only floating tensors become fp32: the int64 n-gram hash multipliers (~1e16) must not pass through float32
    sd = {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert all("inv_freq" in k for k in missing), missing
    return model


def run_with_margins(model, prompts: list[list[int]]) -> tuple[torch.Tensor, list[float]]:
    """float32 logits and, per prompt, the smallest decision margin: MoE top-k boundary (router logits k-th minus
    (k+1)-th, every layer and token) and the final top-1 minus top-2 logit."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextTopKRouter

    caught = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: caught.append((mod.top_k, out[0].detach())))
             for m in model.modules() if isinstance(m, Qwen4ExpTextTopKRouter)]
    margins, logits = [], []
    try:
        for p in prompts:
            caught.clear()
            with torch.no_grad():
                lg = model(torch.tensor([p])).logits.float()
            srt = lg[0].sort(-1, descending=True).values
            m = float((srt[:, 0] - srt[:, 1]).min())
            for k, rl in caught:
                r = rl.float().sort(-1, descending=True).values
                m = min(m, float((r[:, k - 1] - r[:, k]).min()))
            margins.append(m)
            logits.append(lg[0])
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(logits), margins


def dense_from(tensors: dict[str, torch.Tensor], lib: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    dense = {}
    quant_mods = {k for k in lib if "::" not in k}
    for name, t in tensors.items():
        mod, _, param = name.rpartition(".")
        if mod in quant_mods:
            dense[mod + ".weight"] = lib[mod]
        elif param not in ("qzeros", "scales", "g_idx", "weight_scale", "weight_shape", "weight_zero_point"):
            dense[name] = t.float() if t.is_floating_point() else t  # int64 hash buffers stay exact
    return dense


# ---------------------------------------------------------------------------------------------------------

def mtp_tensors(cfg, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random bf16 MTP tensors with the real names (one full-attention layer, per-expert experts)."""
    h, s = cfg.hidden_size, cfg.hc_count * cfg.hidden_size
    r, hd, nh, nkv = cfg.hc_lowrank, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    di, ni = cfg.indexer_head_dim, cfg.indexer_n_heads + cfg.indexer_kv_heads
    i, e = cfg.moe_intermediate_size, cfg.num_experts
    shapes = {
        "mtp.fc_embedding.weight": [h, h], "mtp.fc_hidden.weight": [h, h],
        "mtp.pre_fc_norm_embedding.weight": [h], "mtp.pre_fc_norm_hidden.weight": [s],
        "mtp.hyper_connection_mixer.hc_norm.weight": [s],
        "mtp.hyper_connection_mixer.input_mix_weight_down.weight": [r, s],
        "mtp.hyper_connection_mixer.input_mix_weight_up.weight": [s, r],
    }
    p = "mtp.layers.0."
    for hc in ("attn_hyper_connection", "mlp_hyper_connection"):
        shapes.update({f"{p}{hc}.hc_norm.weight": [s], f"{p}{hc}.input_mix_weight_down.weight": [r, s],
                       f"{p}{hc}.input_mix_weight_up.weight": [s, r], f"{p}{hc}.block_inject_weight.weight": [4, s]})
    shapes.update({
        f"{p}self_attn.q_proj.weight": [2 * nh * hd, h], f"{p}self_attn.k_proj.weight": [nkv * hd, h],
        f"{p}self_attn.v_proj.weight": [nkv * hd, h], f"{p}self_attn.o_proj.weight": [h, nh * hd],
        f"{p}self_attn.q_norm.weight": [hd], f"{p}self_attn.k_norm.weight": [hd],
        f"{p}self_attn.indexer.index_qk_proj.weight": [ni * di, h],
        f"{p}self_attn.indexer.q_layernorm.weight": [di], f"{p}self_attn.indexer.k_layernorm.weight": [di],
        f"{p}mlp.gate.weight": [e, h], f"{p}mlp.shared_expert_gate.weight": [1, h],
        f"{p}mlp.shared_expert.gate_proj.weight": [cfg.shared_expert_intermediate_size, h],
        f"{p}mlp.shared_expert.up_proj.weight": [cfg.shared_expert_intermediate_size, h],
        f"{p}mlp.shared_expert.down_proj.weight": [h, cfg.shared_expert_intermediate_size],
    })
    for x in range(e):
        shapes.update({f"{p}mlp.experts.{x}.gate_proj.weight": [i, h], f"{p}mlp.experts.{x}.up_proj.weight": [i, h],
                       f"{p}mlp.experts.{x}.down_proj.weight": [h, i]})
    return {k: (torch.randn(v, generator=gen) * 0.1).to(torch.bfloat16) for k, v in sorted(shapes.items())}


def text_config_dict(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def make_gptq(src: str, work: str, out: str) -> dict[str, torch.Tensor]:
    d = autoround_export(src, os.path.join(work, "gptq_raw"), "auto_round", GPTQ_LAYERS, 4, 32)
    dst = os.path.join(out, "gptq")
    shutil.copytree(d, dst)
    cfg = text_config_dict(dst)
    tensors = _all_tensors(dst)
    lib = gptq_library_dequant(tensors, cfg["quantization_config"])
    bits_seen = sorted({int(v) for k, v in lib.items() if k.endswith("::bits")})
    print("gptq bits:", bits_seen, file=sys.stderr)
    return {"lib": lib, "model": reference_model(dense_from(tensors, lib), "model.")}


def make_ct(src: str, work: str, out: str) -> dict[str, torch.Tensor]:
    d = autoround_export(src, os.path.join(work, "ct_raw"), "llm_compressor", CT_LAYERS, 4, 32)
    raw = _all_tensors(d)
    cfg = text_config_dict(d)
    qcfg = cfg.pop("quantization_config")
    # ---- release layout: rename model. -> model.language_model.
    def ren(n: str) -> str:
        return "model.language_model." + n[len("model."):] if n.startswith("model.") else n

    tensors = {ren(k): v for k, v in raw.items()}
    for g in qcfg["config_groups"].values():
        g["targets"] = [t if t.startswith("re:") or t == "Linear" else ren(t) for t in g["targets"]]
    qcfg["ignore"] = [t if t.startswith("re:") else ren(t) for t in qcfg.get("ignore") or []]
    # experts: one regex target, as the release does
    for g in qcfg["config_groups"].values():
        if g["targets"] and all(".mlp.experts." in t for t in g["targets"]):
            g["targets"] = [r"re:(model|language_model)\..*\.mlp\.experts\..*"]
    # ---- embed_tokens int8 g64 and PLE value_proj int8 channel, packed by compressed-tensors itself
    extra_groups = {}
    for name, bits, strategy, gsz in (("model.language_model.embed_tokens", 8, "group", 64),
                                      ("model.language_model.layers.1.ple.value_proj", 8, "channel", None)):
        w = tensors.pop(name + ".weight")
        comp = ct_compress(w, bits, strategy, gsz)
        tensors.update({f"{name}.{k}": v for k, v in comp.items()})
        extra_groups[f"group_{name.rsplit('.', 1)[-1]}"] = {
            "targets": [name], "weights": {"num_bits": bits, "type": "int", "symmetric": True, "strategy": strategy,
                                           "group_size": gsz, "dynamic": False, "observer": "minmax"},
            "input_activations": None, "output_activations": None, "format": "pack-quantized"}
    qcfg["config_groups"].update(extra_groups)
    qcfg["ignore"] = [t for t in qcfg["ignore"] if not t.endswith(("embed_tokens", "ple.value_proj"))]
    # ---- skipped tensors the reader must ignore
    gen = torch.Generator().manual_seed(SEED + 1)
    tensors["model.language_model.layers.1.ple.ple_embedding.hashstats_count"] = torch.arange(16, dtype=torch.int64)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(24, 8, generator=gen).to(torch.bfloat16)
    tensors["model.visual.patch_embed.proj.bias"] = torch.randn(8, generator=gen).to(torch.bfloat16)
    mtp = mtp_tensors(tiny_config(), gen)
    # ---- config: qwen4_exp wrapper, `full_attention`
    text = dict(cfg)
    text["model_type"] = "qwen4_exp_text"
    text["layer_types"] = ["full_attention" if t == "indexed_attention" else t for t in text["layer_types"]]
    text.pop("architectures", None)
    text["mtp_num_hidden_layers"] = 1
    text["mtp_use_dedicated_embeddings"] = False
    text["mtp"] = {"hybrid": True, "layer_types": ["full_attention"], "mtp_use_hidden_state_from_layer": None,
                   "num_hidden_layers": 1, "rope_theta": 10000.0}
    top = {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
           "text_config": text, "tie_word_embeddings": False, "quantization_config": qcfg,
           "vision_config": {"depth": 1, "hidden_size": 8}, "transformers_version": cfg.get("transformers_version")}
    dst = os.path.join(out, "ct")
    os.makedirs(dst)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(top, f, indent=1)
    names = sorted(tensors)
    half = len(names) // 2
    _write_checkpoint(dst, {
        "model-00001-of-00002.safetensors": {k: tensors[k] for k in names[:half]},
        "model-00002-of-00002.safetensors": {k: tensors[k] for k in names[half:]},
        "model_extra_tensors.safetensors": mtp,
    })
    for f in ("generation_config.json",):
        if os.path.exists(os.path.join(d, f)):
            shutil.copy(os.path.join(d, f), dst)
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>"}, f)
    with open(os.path.join(dst, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    lib = ct_library_dequant(tensors, qcfg)
    return {"lib": lib, "model": reference_model(dense_from(tensors, lib), "model.language_model.")}


def make_ct_asym(out: str) -> dict[str, torch.Tensor]:
    """Asymmetric compressed-tensors samples (group 4-bit, channel 8-bit... and 6-bit group), + library dequant."""
    gen = torch.Generator().manual_seed(SEED + 2)
    tensors, lib = {}, {}
    for name, bits, strategy, gsz, shape in (("asym4g32", 4, "group", 32, (48, 64)),
                                             ("asym6g32", 6, "group", 32, (32, 64)),
                                             ("asym8ch", 8, "channel", None, (32, 64)),
                                             ("sym4ch", 4, "channel", None, (32, 64))):
        w = (torch.randn(shape, generator=gen) * 0.1 + 0.03).to(torch.bfloat16)
        comp = ct_compress(w, bits, strategy, gsz, symmetric=not name.startswith("asym"))
        tensors.update({f"{name}.{k}": v for k, v in comp.items()})
        lib[name] = ct_decompress(comp, bits, strategy, gsz, symmetric=not name.startswith("asym"))
        lib[name + "::bits"] = torch.tensor(bits)
    save_file(tensors, os.path.join(out, "ct_asym.safetensors"))
    return {"lib": lib}


def make_awq(src: str, work: str, out: str) -> dict[str, torch.Tensor]:
    """AutoRound `format="auto_awq"` (4-bit asymmetric g32); keeps a few modules' tensors + the library's
    `dequantize_gemm` of them (awq_samples.safetensors) and the export's quantization_config (awq_config.json)."""
    from auto_round.export.export_to_awq.utils import dequantize_gemm

    d = autoround_export(src, os.path.join(work, "awq_raw"), "auto_awq", {}, 4, 32, sym=False)
    tensors = _all_tensors(d)
    qcfg = text_config_dict(d)["quantization_config"]
    keep = ["model.layers.0.linear_attn.in_proj_qkv", "model.layers.3.self_attn.o_proj",
            "model.layers.0.mlp.experts.0.down_proj", "lm_head"]
    samples, lib = {}, {}
    for m in keep:
        if f"{m}.qweight" not in tensors:
            continue
        qweight, qzeros, scales = (tensors[f"{m}.{p}"] for p in ("qweight", "qzeros", "scales"))
        samples.update({f"{m}.qweight": qweight, f"{m}.qzeros": qzeros, f"{m}.scales": scales})
        g = qweight.shape[0] // scales.shape[0]
        lib[m] = dequantize_gemm(qweight, qzeros, scales.float(), 4, g).T.contiguous().float()
        lib[m + "::bits"] = torch.tensor(4)
    assert lib, "auto_awq export quantized none of the sample modules"
    save_file(samples, os.path.join(out, "awq_samples.safetensors"))
    with open(os.path.join(out, "awq_config.json"), "w") as f:
        json.dump(qcfg, f, indent=1)
    return {"lib": lib}


SAMPLE = re.compile(r"(lm_head|embed_tokens|layers\.0\.(linear_attn|mlp\.shared)|"
                    r"layers\.[03]\.mlp\.experts\.0\.|layers\.1\.ple\.|layers\.2\.linear_attn\.|layers\.3\.self_attn)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "quant"))
    args = ap.parse_args(argv)
    out = os.path.abspath(args.out)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    with tempfile.TemporaryDirectory() as work:
        src = os.path.join(work, "bf16")
        build_source(src)
        res = {"gptq": make_gptq(src, work, out), "ct": make_ct(src, work, out), "ct_asym": make_ct_asym(out),
               "awq": make_awq(src, work, out)}
    for fmt, r in res.items():
        lib = {k: v for k, v in r["lib"].items() if fmt in ("ct_asym", "awq") or SAMPLE.search(k)}
        save_file({k: v.contiguous() for k, v in lib.items()}, os.path.join(out, f"library_dequant_{fmt}.safetensors"))
        print(fmt, "bits in samples:", sorted({int(v) for k, v in lib.items() if k.endswith("::bits")}), file=sys.stderr)
    # prompts: the 2 of 24 random candidates with the largest decision margins (routing and argmax) in both models
    gen = torch.Generator().manual_seed(SEED + 3)
    cands = PROMPTS + [[1] + torch.randint(2, 256, (23,), generator=gen).tolist() for _ in range(22)]
    margins = torch.tensor([run_with_margins(res[f]["model"], cands)[1] for f in ("ct", "gptq")]).min(0).values
    best = margins.argsort(descending=True)[:2].tolist()
    prompts = [cands[i] for i in best]
    out_t = {"input_ids": torch.tensor(prompts)}
    for f in ("ct", "gptq"):
        out_t[f], m = run_with_margins(res[f]["model"], prompts)
        out_t[f + "::min_margin"] = torch.tensor(min(m))
        print(f, "min decision margin", min(m), file=sys.stderr)
    save_file(out_t, os.path.join(out, "reference_logits.safetensors"))
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("Generated by tools/make_quant_fixtures.py (see its docstring); do not edit by hand.\n"
                "Versions: " + json.dumps(_versions()) + "\n")


def _versions() -> dict:
    import auto_round
    import compressed_tensors
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "auto_round": auto_round.__version__, "compressed_tensors": compressed_tensors.__version__}


if __name__ == "__main__":
    main()
