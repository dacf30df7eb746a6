"""Our converted format (docs/converter.md): manifest.json + Orbax weight groups + raw n-gram table parts.

DST/
  manifest.json                    format, version, source, hf config, stages, every tensor (dtype, shape, quant)
  config.json, tokenizer files     copied from the source
  stage_{s}/stage.json             the stage's slice of the manifest (a stage directory is self-describing)
  stage_{s}/weights/{group}/       one Orbax (PyTreeCheckpointer) checkpoint per group: "embed", "layer_007",
                                   "head", "mtp", "vision" (the vision tower, unquantized, in the first stage);
                                   a flat dict canonical_name -> array, or for a QuantizedWeight
                                   canonical_name -> {"planes": [p0, (p1)], "scales": s}
  stage_{s}/ngram/part_{i}.bin     the n-gram table, raw row-major [rows_i, width] parts, in the stage of the PLE layer

Conversion streams: one canonical tensor (an expert stack for routed experts) is built at a time and one group
is held until it is saved. Everything is written under a temporary sibling directory `.DST.tmp-<pid>` that is
renamed to DST only once complete (and verified, with --verify).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import shutil
import sys
from typing import Iterator

import numpy as np

from convert import spec as specmod
from convert.errors import ConvertError
from convert.ngram import as_table
from convert.readers import Checkpoint, open_checkpoint
from flashnext_jax import stages as stages_mod
from pallas_kernels.quant_layout import QuantizedWeight

FORMAT = "flashnext-converted"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
COPY_CHUNK = 64 << 20
_HANDLER_REGISTERED = False
FLUSH_BYTES = 256 << 20  # save a weight group's pending tensors once they reach this size


def is_converted(path: str) -> bool:
    p = os.path.join(path, MANIFEST)
    if not os.path.exists(p):
        return False
    try:
        with open(p) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def _dtype_name(dt) -> str:
    return np.dtype(dt).name


def _np_dtype(name: str) -> np.dtype:
    import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 names with numpy)

    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(getattr(ml_dtypes, name))


def _digest(arrays: list[np.ndarray]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype.str, a.shape)).encode())
        h.update(a.reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def plan_stages(pp_partition: list[int] | None, num_layers: int) -> list[dict]:
    """flashnext_jax.stages.plan_stages (the engine's StagePlan reads the same layout), errors as ConvertError."""
    try:
        return stages_mod.plan_stages(pp_partition, num_layers)
    except stages_mod.StagePlanError as e:
        raise ConvertError(f"--pp-partition {','.join(map(str, pp_partition or []))} must be positive and sum to "
                           f"num_hidden_layers={num_layers} ({e})") from None


def stage_of_group(group: str, stages: list[dict]) -> int:
    if group in ("embed", "vision"):
        return 0
    if group in ("head", "mtp"):
        return len(stages) - 1
    layer = int(group.split("_")[1])
    for st in stages:
        if st["layers"][0] <= layer < st["layers"][1]:
            return st["index"]
    raise ConvertError(f"layer {layer} is outside --pp-partition")


def _tree_value(v) -> tuple[object, list[np.ndarray], dict]:
    """(orbax tree node, arrays for the digest, manifest info)."""
    if isinstance(v, QuantizedWeight):
        planes = [np.asarray(p) for p in v.planes]
        scales = np.asarray(v.scales)
        info = {"kind": "quantized", "shape": list(v.shape), "dtype": _dtype_name(scales.dtype),
                "quant": {"bits": v.bits, "group_size": v.group_size, "k": v.k, "n": v.n,
                          "planes": [{"dtype": _dtype_name(p.dtype), "shape": list(p.shape)} for p in planes],
                          "scales": {"dtype": _dtype_name(scales.dtype), "shape": list(scales.shape)}}}
        return {"planes": planes, "scales": scales}, planes + [scales], info
    a = np.asarray(v)
    return a, [a], {"kind": "plain", "shape": list(a.shape), "dtype": _dtype_name(a.dtype)}


def _checkpointer():
    """Orbax PyTree checkpointer without zstd (weights barely compress; it costs CPU on save and restore) and
    without the defensive deep copy of host arrays (we save synchronously and never mutate them)."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.serialization import type_handlers

    global _HANDLER_REGISTERED
    if not _HANDLER_REGISTERED:
        import logging

        absl = logging.getLogger("absl")
        level = absl.level
        absl.setLevel(logging.ERROR)  # "overriding np.ndarray" warning
        try:
            ocp.type_handlers.register_type_handler(
                np.ndarray, type_handlers.NumpyHandler(deepcopy_host_arrays=False), override=True)
        finally:
            absl.setLevel(level)
        _HANDLER_REGISTERED = True
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def _save_group(path: str, tree: dict) -> None:
    ck = _checkpointer()
    ck.save(path, tree)
    ck.close()


def _restore_group(path: str, names: list[str] | None = None) -> dict:
    import jax
    import orbax.checkpoint as ocp

    ck = ocp.PyTreeCheckpointer()
    meta = ck.metadata(path)
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
    tree = getattr(tree, "tree", tree)
    ra = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), dict(tree))
    out = ck.restore(path, restore_args=ra)
    ck.close()
    return out


def _clean_stale_tmp(dst: str) -> None:
    parent, base = os.path.dirname(dst), os.path.basename(dst)
    prefix = f".{base}.tmp-"
    for f in os.listdir(parent):
        if f.startswith(prefix):
            try:
                pid = int(f[len(prefix):])
                os.kill(pid, 0)
            except (ValueError, ProcessLookupError):
                shutil.rmtree(os.path.join(parent, f), ignore_errors=True)
            except PermissionError:
                pass


def _versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for p in ("numpy", "jax", "orbax-checkpoint", "ml_dtypes"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            pass
    return out


def convert(src: str, dst: str, *, pp_partition: list[int] | None = None, force: bool = False,
            verify: bool = False, progress: bool = True, ngram_part_bytes: int = 4 << 30) -> dict:
    """Convert the checkpoint directory src into dst (our format); returns the manifest."""
    dst = os.path.abspath(dst)
    if os.path.exists(dst) and not force:
        raise ConvertError(f"destination {dst} exists (use --force to overwrite)")
    ck = open_checkpoint(src)  # validates names / shapes / formats before anything is written
    stages = plan_stages(pp_partition, ck.text_config["num_hidden_layers"])
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    _clean_stale_tmp(dst)
    tmp = os.path.join(parent, f".{os.path.basename(dst)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        manifest = _write(ck, tmp, stages, verify, progress, ngram_part_bytes)
        if verify:
            verify_converted(tmp, progress=progress)
        if os.path.exists(dst):
            old = os.path.join(parent, f".{os.path.basename(dst)}.old-{os.getpid()}")
            os.rename(dst, old)
            os.rename(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, dst)
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _progress(total: int, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not enabled,
                file=sys.stderr, dynamic_ncols=True, smoothing=0.1)


def _write(ck: Checkpoint, tmp: str, stages: list[dict], digests: bool, progress: bool,
           ngram_part_bytes: int) -> dict:
    os.makedirs(tmp)
    tensors: dict[str, dict] = {}
    groups: list[dict] = []
    bar = _progress(ck.source_bytes, progress, "convert")

    def flush(group: str, tree: dict):
        s = stage_of_group(group, stages)
        part = sum(g["name"] == group for g in groups)
        rel = os.path.join(stages[s]["dir"], "weights", group if part == 0 else f"{group}.{part}")
        _save_group(os.path.join(tmp, rel), tree)
        groups.append({"name": group, "stage": s, "path": rel, "tensors": list(tree)})

    cur, tree, pending = None, {}, 0
    for e in ck.entries + ck.vision:  # the vision tower last, as its own group
        if e.group != cur or pending >= FLUSH_BYTES:  # a group is saved in parts of ~FLUSH_BYTES
            if tree:
                flush(cur, tree)
            cur, tree, pending = e.group, {}, 0
        node, arrays, info = _tree_value(e.load())
        pending += sum(a.nbytes for a in arrays)
        tree[e.name] = node
        info.update({"group": e.group, "stage": stage_of_group(e.group, stages), "sources": len(e.sources)})
        if e.quant is not None:
            info["quant"].update({"source_bits": e.quant.source_bits, "symmetric": e.quant.symmetric,
                                  "source": e.quant.source})
        if digests:
            info["digest"] = _digest(arrays)
        tensors[e.name] = info
        del node, arrays
        bar.update(e.source_bytes)
    if tree:
        flush(cur, tree)
    del tree

    ngram = None
    if ck.ngram is not None:
        ple_layer = int(ck.ngram.canonical.split(".")[1])
        s = stage_of_group(specmod.layer_group(ple_layer), stages)
        ngram = _write_ngram(ck, tmp, stages[s]["dir"], s, ngram_part_bytes, digests, bar)
    bar.close()

    for f in ck.tokenizer_files:
        shutil.copy2(os.path.join(ck.path, f), os.path.join(tmp, f))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(ck.hf_config, f, indent=2)
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "converter": _versions(),
        "source": {"path": ck.path, "format": ck.source_format,
                   "quantization_config": ck.hf_config.get("quantization_config"),
                   "tensors": len(ck.files), "bytes": ck.source_bytes},
        "hf_config": ck.hf_config, "num_layers": ck.text_config["num_hidden_layers"],
        "has_mtp": any(n.startswith("mtp.") for n in tensors), "has_vision": bool(ck.vision),
        "stages": stages, "groups": groups, "tensors": tensors, "ngram_table": ngram,
        "tokenizer_files": ck.tokenizer_files, "digests": digests,
    }
    for st in stages:
        sub = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "stage": st, "hf_config": ck.hf_config,
            "groups": [g for g in groups if g["stage"] == st["index"]],
            "tensors": {n: t for n, t in tensors.items() if t["stage"] == st["index"]},
            "ngram_table": ngram if ngram and ngram["stage"] == st["index"] else None,
        }
        os.makedirs(os.path.join(tmp, st["dir"]), exist_ok=True)
        with open(os.path.join(tmp, st["dir"], "stage.json"), "w") as f:
            json.dump(sub, f, indent=1)
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def _write_ngram(ck: Checkpoint, tmp: str, stage_dir: str, stage: int, part_bytes: int, digests: bool,
                 bar) -> dict:
    ng = ck.ngram
    rows, width = ng.shape
    row_bytes = width * ng.dtype.itemsize
    rows_per_part = max(1, part_bytes // row_bytes)
    os.makedirs(os.path.join(tmp, stage_dir, "ngram"))
    parts: list[dict] = []
    out = None
    written = 0  # rows in the current output part
    h = None

    def open_part():
        nonlocal out, written, h
        rel = os.path.join(stage_dir, "ngram", f"part_{len(parts):04d}.bin")
        out = open(os.path.join(tmp, rel), "wb")
        parts.append({"file": rel, "rows": 0})
        written = 0
        h = hashlib.blake2b(digest_size=16) if digests else None

    def close_part():
        nonlocal out
        if out is not None:
            out.close()
            if h is not None:
                parts[-1]["digest"] = h.hexdigest()
            out = None

    chunk_rows = max(1, COPY_CHUNK // row_bytes)
    for src in ng.parts:
        fd = os.open(src.file.path, os.O_RDONLY)
        try:
            r = 0
            while r < src.shape[0]:
                if out is None or written == rows_per_part:
                    close_part()
                    open_part()
                n = min(chunk_rows, src.shape[0] - r, rows_per_part - written)
                want = n * row_bytes
                data = os.pread(fd, want, src.begin + r * row_bytes)
                if len(data) != want:
                    raise ConvertError(f"truncated shard {os.path.basename(src.file.path)}: short read of {src.name}")
                out.write(data)
                if h is not None:
                    h.update(data)
                parts[-1]["rows"] += n
                written += n
                r += n
                bar.update(want)
        finally:
            os.close(fd)
    close_part()
    return {"canonical": ng.canonical, "dtype": _dtype_name(ng.dtype), "shape": [rows, width], "scale": ng.scale,
            "stage": stage, "parts": parts}


# ---------------------------------------------------------------------------------------------------------
# reading our format

def read_manifest(path: str) -> dict:
    p = os.path.join(path, MANIFEST)
    if not os.path.exists(p):
        raise ConvertError(f"{path} is not a converted checkpoint (no {MANIFEST})")
    with open(p) as f:
        m = json.load(f)
    if m.get("format") != FORMAT:
        raise ConvertError(f"{p}: format {m.get('format')!r} is not {FORMAT}")
    if m.get("format_version") != FORMAT_VERSION:
        raise ConvertError(f"{p}: format_version {m.get('format_version')} unsupported (this reader: {FORMAT_VERSION})")
    return m


def _value(info: dict, node):
    if info["kind"] == "quantized":
        q = info["quant"]
        return QuantizedWeight(planes=tuple(node["planes"]), scales=node["scales"], bits=q["bits"],
                               group_size=q["group_size"], k=q["k"], n=q["n"])
    return node


def iter_group(path: str, manifest: dict, group: dict) -> Iterator[tuple[str, np.ndarray | QuantizedWeight]]:
    gpath = os.path.join(path, group["path"])
    if not os.path.isdir(gpath):
        raise ConvertError(f"missing weight group {group['path']} in {path}")
    tree = _restore_group(gpath)
    for name in group["tensors"]:
        if name not in tree:
            raise ConvertError(f"missing tensor {name} in {group['path']}")
        yield name, _value(manifest["tensors"][name], tree.pop(name))


def ngram_table(path: str, manifest: dict):
    ng = manifest.get("ngram_table")
    if not ng:
        return None, None
    dt = _np_dtype(ng["dtype"])
    width = ng["shape"][1]
    parts = []
    for p in ng["parts"]:
        f = os.path.join(path, p["file"])
        want = p["rows"] * width * dt.itemsize
        if not os.path.exists(f) or os.path.getsize(f) != want:
            raise ConvertError(f"truncated n-gram part {p['file']}: expected {want} bytes")
        parts.append(np.memmap(f, dtype=dt, mode="r", shape=(p["rows"], width)))
    return as_table(parts), ng.get("scale")


def load_converted(path: str, stages: list[int] | None = None):
    """(hf_config, iterator of (name, np.ndarray | QuantizedWeight), ngram_table (np.memmap / ShardedRows), scale).

    stages: only the groups of these pipeline stages (all by default); the n-gram table is returned when its
    stage is included."""
    m = read_manifest(path)
    sel = set(range(len(m["stages"]))) if stages is None else set(stages)
    groups = [g for g in m["groups"] if g["stage"] in sel and g["name"] != "vision"]  # text model only

    def it():
        for g in groups:
            yield from iter_group(path, m, g)

    table, scale = (None, None)
    if m.get("ngram_table") and m["ngram_table"]["stage"] in sel:
        table, scale = ngram_table(path, m)
    return m["hf_config"], it(), table, scale


def load_converted_vision(path: str) -> dict[str, np.ndarray]:
    """The vision tower's tensors of a converted checkpoint (canonical `visual.*` names; empty without one)."""
    m = read_manifest(path)
    out: dict[str, np.ndarray] = {}
    for g in m["groups"]:
        if g["name"] == "vision":
            out.update(iter_group(path, m, g))
    return out


def verify_converted(path: str, progress: bool = False) -> None:
    """Re-read every tensor and n-gram part; check names, dtypes, shapes and (when recorded) digests."""
    m = read_manifest(path)
    total = sum(len(g["tensors"]) for g in m["groups"])
    from tqdm import tqdm

    seen = set()
    with tqdm(total=total, desc="verify", unit="tensor", disable=not progress, file=sys.stderr) as bar:
        for g in m["groups"]:
            for name, v in iter_group(path, m, g):
                info = m["tensors"][name]
                _, arrays, got = _tree_value(v)
                for key in ("kind", "shape", "dtype"):
                    if got[key] != info[key]:
                        raise ConvertError(f"verify failed: {name} {key} {got[key]} != manifest {info[key]}")
                if info["kind"] == "quantized" and got["quant"]["planes"] != info["quant"]["planes"]:
                    raise ConvertError(f"verify failed: {name} planes {got['quant']['planes']}")
                if "digest" in info and _digest(arrays) != info["digest"]:
                    raise ConvertError(f"verify failed: {name} content differs from what was written")
                seen.add(name)
                bar.update(1)
    missing = set(m["tensors"]) - seen
    if missing:
        raise ConvertError(f"verify failed: missing tensor {sorted(missing)[0]}")
    ng = m.get("ngram_table")
    if ng:
        table, _ = ngram_table(path, m)
        for p in ng["parts"]:
            if "digest" in p:
                h = hashlib.blake2b(digest_size=16)
                with open(os.path.join(path, p["file"]), "rb") as f:
                    for chunk in iter(lambda: f.read(COPY_CHUNK), b""):
                        h.update(chunk)
                if h.hexdigest() != p["digest"]:
                    raise ConvertError(f"verify failed: n-gram part {p['file']} content differs")
        if tuple(table.shape) != tuple(ng["shape"]):
            raise ConvertError(f"verify failed: n-gram table shape {table.shape} != {ng['shape']}")
