"""Checkpoint tensors -> the params pytree.

One description of every tensor (`expected_tensors`, canonical names in torch orientation) serves shape checks,
random init (`init_params`, usable under `jax.eval_shape`) and loading. Canonical names are the HF text-model
names with the `model.language_model.` / `model.` prefix removed, experts stacked per layer
(`layers.L.mlp.experts.gate_up_proj` [E, 2I, H], `...down_proj` [E, H, I]).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .config import GDN, ModelConfig
from .layers import FusedLinear


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match the config."""


def _hyper(prefix: str, cfg: ModelConfig, inject: bool) -> dict[str, tuple]:
    sh, r = cfg.hc_hidden_size, cfg.hc_lowrank
    out = {
        f"{prefix}.hc_norm.weight": (sh,),
        f"{prefix}.input_mix_weight_down.weight": (r, sh),
        f"{prefix}.input_mix_weight_up.weight": (sh, r),
    }
    if inject:
        out[f"{prefix}.block_inject_weight.weight"] = (cfg.hc_count, sh)
    return out


def _qsa(prefix: str, cfg: ModelConfig) -> dict[str, tuple]:
    h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = {
        f"{prefix}.q_proj.weight": (2 * nh * hd, h),
        f"{prefix}.k_proj.weight": (nkv * hd, h),
        f"{prefix}.v_proj.weight": (nkv * hd, h),
        f"{prefix}.o_proj.weight": (h, nh * hd),
        f"{prefix}.q_norm.weight": (hd,),
        f"{prefix}.k_norm.weight": (hd,),
    }
    if cfg.qsa_enabled:
        di = cfg.indexer_head_dim
        out[f"{prefix}.indexer.index_qk_proj.weight"] = ((cfg.indexer_n_heads + 1) * di, h)
        out[f"{prefix}.indexer.q_layernorm.weight"] = (di,)
        out[f"{prefix}.indexer.k_layernorm.weight"] = (di,)
    return out


def _moe(prefix: str, cfg: ModelConfig) -> dict[str, tuple]:
    h, e, i, si = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    return {
        f"{prefix}.gate.weight": (e, h),
        f"{prefix}.experts.gate_up_proj": (e, 2 * i, h),
        f"{prefix}.experts.down_proj": (e, h, i),
        f"{prefix}.shared_expert.gate_proj.weight": (si, h),
        f"{prefix}.shared_expert.up_proj.weight": (si, h),
        f"{prefix}.shared_expert.down_proj.weight": (h, si),
        f"{prefix}.shared_expert_gate.weight": (1, h),
    }


def _gdn(prefix: str, cfg: ModelConfig) -> dict[str, tuple]:
    h, hv, dv, c = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.gdn_conv_dim
    return {
        f"{prefix}.in_proj_qkv.weight": (c, h),
        f"{prefix}.in_proj_z.weight": (hv * dv, h),
        f"{prefix}.in_proj_b.weight": (hv, h),
        f"{prefix}.in_proj_a.weight": (hv, h),
        f"{prefix}.conv1d.weight": (c, 1, cfg.linear_conv_kernel_dim),
        f"{prefix}.dt_bias": (hv,),
        f"{prefix}.A_log": (hv,),
        f"{prefix}.norm.weight": (dv,),
        f"{prefix}.out_proj.weight": (h, hv * dv),
    }


def _ple(prefix: str, cfg: ModelConfig) -> dict[str, tuple]:
    sh, e = cfg.hc_hidden_size, cfg.ple_embed_dim
    return {
        f"{prefix}.key_proj.weight": (sh, e),
        f"{prefix}.value_proj.weight": (cfg.hidden_size, e),
        f"{prefix}.norm_key.weight": (sh,),
        f"{prefix}.norm_query.weight": (sh,),
        f"{prefix}.norm_conv.weight": (sh,),
        f"{prefix}.conv1d.weight": (sh, 1, cfg.ple_conv_kernel_size),
    }


def expected_tensors(cfg: ModelConfig, *, with_mtp: bool = True) -> dict[str, tuple]:
    """Canonical name -> torch-orientation shape of every device-resident tensor (not the n-gram table)."""
    v, h = cfg.vocab_size, cfg.hidden_size
    out: dict[str, tuple] = {"embed_tokens.weight": (v, h), "lm_head.weight": (v, h)}
    out |= _hyper("hyper_connection_mixer", cfg, inject=False)
    for layer, kind in enumerate(cfg.layer_types):
        p = f"layers.{layer}"
        out |= _hyper(f"{p}.attn_hyper_connection", cfg, True) | _hyper(f"{p}.mlp_hyper_connection", cfg, True)
        out |= _gdn(f"{p}.linear_attn", cfg) if kind == GDN else _qsa(f"{p}.self_attn", cfg)
        out |= _moe(f"{p}.mlp", cfg)
        if layer in cfg.ple_layers:
            out |= _ple(f"{p}.ple", cfg)
    if with_mtp and cfg.mtp_num_hidden_layers:
        sh = cfg.hc_hidden_size
        out |= {"mtp.fc_embedding.weight": (h, h), "mtp.fc_hidden.weight": (h, h),
                "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (sh,)}
        for layer in range(cfg.mtp_num_hidden_layers):
            p = f"mtp.layers.{layer}"
            out |= _hyper(f"{p}.attn_hyper_connection", cfg, True) | _hyper(f"{p}.mlp_hyper_connection", cfg, True)
            out |= _qsa(f"{p}.self_attn", cfg) | _moe(f"{p}.mlp", cfg)
        out |= _hyper("mtp.hyper_connection_mixer", cfg, inject=False)
    return out


# Tensors stored beside the n-gram table; they are recomputed from the config and checked against it on load.
PLE_BUFFERS = ("ple_embedding.layer_multipliers", "ple_embedding.ngram_heads_vocab_sizes",
               "ple_embedding.ngram_heads_offsets")


def orient(name: str, value):
    """Torch orientation -> ours for dense tensors; works on numpy and jax arrays.

    Dense linear weights keep torch's [out, in]: `layers.linear` contracts their dim 1. XLA rewrites a one-token
    dot as multiply + reduce, which over [out, in] is a row reduction of contiguous memory; over [in, out] it
    was a column reduction, slow for the small projections (in_proj_a/b 2560 -> 48: 17.7 us per call on the
    H200, bench/results/decode_step.json). Stacked dense experts become [E, in, out] (the MoE einsums), conv
    taps [C, K]. Quantized weights have their own [K=in, N=out] layout (quant_layout) and are not oriented."""
    if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
        return value.swapaxes(-1, -2)
    if name.endswith("conv1d.weight"):
        return value[:, 0, :]
    return value


def to_param(name: str, value: Any, dtype, host: bool = False) -> Any:
    """A checkpoint tensor -> param leaf (a numpy array with host=True, else a jax array). Quantized leaves
    (already [K, N]) pass through unchanged."""
    if not isinstance(value, np.ndarray):
        return value
    if host:
        return np.asarray(orient(name, value)).astype(np.dtype(dtype), copy=False)
    return jnp.asarray(orient(name, value), dtype=dtype)


def _set(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for key in path[:-1]:
        node = node.setdefault(int(key) if key.isdigit() else key, {})
    node[path[-1]] = value


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    if node and all(isinstance(k, int) for k in node):
        return [_lists(node[i]) for i in range(len(node))]
    return {k: _lists(v) for k, v in node.items()}


def param_path(name: str) -> list[str]:
    return (name[: -len(".weight")] if name.endswith(".weight") else name).split(".")


def build_params(cfg: ModelConfig, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], dtype, *,
                 fuse: bool = True, host: bool = False) -> dict:
    """Canonical tensors (complete, checked; a mapping or (name, tensor) pairs) -> nested params dict (same-input
    projections fused, see `fuse_projections`, unless fuse=False). host: numpy leaves, nothing on a device yet
    (layer_stack.build_stacked_on_host)."""
    tree: dict = {}
    for name, value in tensors.items() if isinstance(tensors, Mapping) else tensors:
        _set(tree, param_path(name), to_param(name, value, dtype, host))
    params = _lists(tree)
    return fuse_projections(params) if fuse else params


# Projections that read the same input, in output order. Merged at load time into one FusedLinear when every
# part is present and they share a format (all plain of one dtype, or all quantized with one bits / group /
# scale dtype): the decode step then launches one matmul instead of 2-3 (plus their split-K sums) on a bigger
# weight. Parts that cannot be merged (mixed formats in a checkpoint) stay separate; `layers.linear_group` takes both.
FUSED_PROJECTIONS = (("in_proj_qkv", "in_proj_z"), ("in_proj_b", "in_proj_a"), ("q_proj", "k_proj", "v_proj"),
                     ("gate_proj", "up_proj"), ("key_proj", "value_proj"), ("gate", "shared_expert_gate"))


def _concat(arrays: list, axis: int):
    """numpy for host arrays (a loader building on the host keeps them there), jnp for device arrays."""
    if all(isinstance(a, np.ndarray) for a in arrays):
        return np.concatenate(arrays, axis=axis)
    return jnp.concatenate(arrays, axis=axis)


def _merge(parts: list) -> FusedLinear | None:
    from pallas_kernels.quant_layout import QuantizedWeight

    if all(isinstance(w, (jax.Array, np.ndarray)) and w.ndim == 2 for w in parts):
        if len({(w.dtype, w.shape[1]) for w in parts}) == 1:  # plain [out, in]: stack the rows
            return FusedLinear(_concat(parts, 0), tuple(int(w.shape[0]) for w in parts))
    elif all(isinstance(w, QuantizedWeight) and w.ndim == 2 for w in parts):
        if len({(w.bits, w.group_size, w.k, w.scales.dtype, tuple(p.dtype for p in w.planes)) for w in parts}) == 1:
            first = parts[0]  # quantized [K, N]: append the columns of every plane and of the scales
            planes = tuple(_concat([w.planes[i] for w in parts], -1) for i in range(len(first.planes)))
            merged = QuantizedWeight(planes=planes, scales=_concat([w.scales for w in parts], -1),
                                     bits=first.bits, group_size=first.group_size, k=first.k,
                                     n=sum(w.n for w in parts))
            return FusedLinear(merged, tuple(w.n for w in parts))
    return None


def fuse_projections(node: Any) -> Any:
    """Params with every FUSED_PROJECTIONS group merged under the key "+".join(names) (recursively: decoder
    layers and the MTP head alike)."""
    if isinstance(node, list):
        return [fuse_projections(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: fuse_projections(v) for k, v in node.items()}
    for names in FUSED_PROJECTIONS:
        if all(n in node for n in names):
            merged = _merge([node[n] for n in names])
            if merged is not None:
                for n in names:
                    del node[n]
                node["+".join(names)] = merged
    return node


def check_tensors(cfg: ModelConfig, shapes: Mapping[str, tuple]) -> bool:
    """Raise one CheckpointError listing every missing, unexpected or mis-shaped tensor. Returns has_mtp."""
    has_mtp = any(n.startswith("mtp.") for n in shapes)
    expected = expected_tensors(cfg, with_mtp=has_mtp)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    wrong = sorted(f"{n} {tuple(shapes[n])} != {expected[n]}" for n in set(expected) & set(shapes)
                   if tuple(shapes[n]) != tuple(expected[n]))
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {', '.join(missing[:20])}"
                        + (" ..." if len(missing) > 20 else ""))
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {', '.join(unexpected[:20])}"
                        + (" ..." if len(unexpected) > 20 else ""))
    if wrong:
        problems.append(f"shape mismatches ({len(wrong)}): {', '.join(wrong[:20])}")
    if problems:
        raise CheckpointError("; ".join(problems))
    return has_mtp


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.bfloat16, *, with_mtp: bool = True) -> dict:
    """Random params of the right shapes (for benchmarks at real size and `jax.eval_shape` checks)."""
    specs = expected_tensors(cfg, with_mtp=with_mtp)
    keys = jax.random.split(key, len(specs))
    tensors = {}
    for k, (name, shape) in zip(keys, sorted(specs.items())):
        tensors[name] = (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(dtype)
    tree: dict = {}
    for name, value in tensors.items():
        _set(tree, param_path(name), orient(name, value))
    return _lists(tree)


def random_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, *, scale: float = 0.02,
                  with_mtp: bool = True) -> dict:
    """Concrete random params drawn with numpy (fast: no XLA compile per tensor shape), for tests and benches."""
    rng = np.random.default_rng(seed)
    tensors = {name: (rng.standard_normal(shape, dtype=np.float32) * scale)
               for name, shape in sorted(expected_tensors(cfg, with_mtp=with_mtp).items())}
    return build_params(cfg, tensors, dtype)
