"""Write an MTP head (e.g. from `train_mtp`) back into an HF safetensors checkpoint directory, atomically.

Every `mtp.*` tensor the checkpoint already holds is replaced by the new value in the same name, dtype and shape
(experts fused or per expert, whichever the checkpoint uses); the rest of every shard is copied unchanged. The
new checkpoint is staged in a sibling directory (unchanged files hard-linked) and swapped in by two renames, so
a reader sees the old or the new checkpoint, never a half-written one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import jax
import numpy as np

from .config import ModelConfig
from .layers import FusedLinear
from .weights import FUSED_PROJECTIONS, expected_tensors, param_path

_PER_EXPERT = re.compile(r"^(mtp\..*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def _unfuse(node):
    """Params with every FusedLinear split back into its named parts (inverse of `weights.fuse_projections`)."""
    if isinstance(node, list):
        return [_unfuse(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if isinstance(value, FusedLinear):
            names = next(n for n in FUSED_PROJECTIONS if "+".join(n) == key)
            if not isinstance(value.weight, jax.Array):
                raise ValueError(f"{key}: quantized MTP weights cannot be written back")
            bounds = np.cumsum((0,) + value.sizes)
            for name, lo, hi in zip(names, bounds[:-1], bounds[1:]):
                out[name] = value.weight[lo:hi]
        else:
            out[key] = _unfuse(value)
    return out


def canonical_mtp_tensors(cfg: ModelConfig, head: dict) -> dict[str, np.ndarray]:
    """MTP head params (`model.params["mtp"]`) -> canonical `mtp.*` tensors in torch orientation, float32."""
    tree = {"mtp": _unfuse(head)}
    out = {}
    for name, shape in expected_tensors(cfg, with_mtp=True).items():
        if not name.startswith("mtp."):
            continue
        node = tree
        for key in param_path(name):
            node = node[int(key)] if key.isdigit() else node[key]
        value = np.asarray(jax.device_get(node), np.float32)
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            value = value.swapaxes(-1, -2)
        elif name.endswith("conv1d.weight"):
            value = value[:, None, :]
        if value.shape != tuple(shape):
            raise ValueError(f"{name}: head tensor {value.shape} != expected {tuple(shape)}")
        out[name] = value
    return out


def _value_for(name: str, canonical: dict[str, np.ndarray], cfg: ModelConfig) -> np.ndarray:
    m = _PER_EXPERT.match(name)
    if m is None:
        return canonical[name]
    prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
    if kind == "down":
        return canonical[prefix + ".down_proj"][e]
    inter = cfg.moe_intermediate_size
    gate_up = canonical[prefix + ".gate_up_proj"][e]
    return gate_up[:inter] if kind == "gate" else gate_up[inter:]


def _shard_names(path: Path) -> dict[str, list[str]]:
    """shard file -> tensor names, from model.safetensors.index.json or the single model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        by_file: dict[str, list[str]] = {}
        for name, fname in json.loads(index.read_text())["weight_map"].items():
            by_file.setdefault(fname, []).append(name)
        return by_file
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{path}: no model.safetensors(.index.json): not an HF safetensors checkpoint")
    from safetensors import safe_open

    with safe_open(str(single), "np") as f:
        return {"model.safetensors": list(f.keys())}


def write_mtp(checkpoint_dir: str | Path, cfg: ModelConfig, head: dict) -> list[str]:
    """Replace the checkpoint's `mtp.*` tensors by `head`'s values; returns the shard files rewritten."""
    from safetensors.numpy import load_file, save_file

    path = Path(checkpoint_dir).resolve()
    canonical = canonical_mtp_tensors(cfg, head)
    shards = {f: names for f, names in _shard_names(path).items() if any(n.startswith("mtp.") for n in names)}
    if not shards:
        raise ValueError(f"{path} holds no mtp.* tensors to replace")
    stage = path.parent / f".{path.name}.write_mtp-{os.getpid()}"
    old = path.parent / f".{path.name}.old-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        for entry in path.iterdir():
            if entry.name in shards or not entry.is_file():
                continue
            try:
                os.link(entry, stage / entry.name)
            except OSError:
                shutil.copy2(entry, stage / entry.name)
        for fname in shards:
            tensors = load_file(str(path / fname))
            for name in [n for n in tensors if n.startswith("mtp.")]:
                new = _value_for(name, canonical, cfg)
                if new.shape != tensors[name].shape:
                    raise ValueError(f"{name}: new shape {new.shape} != checkpoint {tensors[name].shape}")
                tensors[name] = np.ascontiguousarray(new.astype(tensors[name].dtype))  # astype keeps strides
            save_file(tensors, str(stage / fname), metadata={"format": "pt"})
        for sub in [e for e in path.iterdir() if e.is_dir()]:  # keep any sub-directories (e.g. a nested README dir)
            shutil.copytree(sub, stage / sub.name)
        os.rename(path, old)
        os.rename(stage, path)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return sorted(shards)
