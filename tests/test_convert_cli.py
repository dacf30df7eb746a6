"""flashnext-convert CLI: every bad input gives one line, a non-zero exit and no DST; kill -9 leaves no DST."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest

from convert.spec import ngram_table_shape
from convert.testing import tiny_text_config, write_safetensors, write_synthetic_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "quant")


def run_cli(*args: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "convert", *args, "--no-progress"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, **kw)


def _copy(tmp_path, fmt="ct") -> str:
    d = str(tmp_path / f"src_{fmt}")
    shutil.copytree(os.path.join(FIX, fmt), d)
    return d


def _edit_json(path, fn):
    with open(path) as f:
        d = json.load(f)
    fn(d)
    with open(path, "w") as f:
        json.dump(d, f)


def _add_tensor(src: str, name: str, value: np.ndarray) -> None:
    """Put `name` into a new shard and point the index at it."""
    write_safetensors(os.path.join(src, "extra-test.safetensors"), [(name, value.dtype, value.shape, lambda: value)])
    _edit_json(os.path.join(src, "model.safetensors.index.json"),
               lambda d: d["weight_map"].__setitem__(name, "extra-test.safetensors"))


def truncated(src):
    f = os.path.join(src, "model-00002-of-00002.safetensors")
    with open(f, "r+b") as h:
        h.truncate(os.path.getsize(f) - 100)


def missing(src):
    _edit_json(os.path.join(src, "model.safetensors.index.json"),
               lambda d: d["weight_map"].pop("model.language_model.layers.2.linear_attn.A_log"))


def unexpected(src):
    _add_tensor(src, "model.language_model.layers.0.linear_attn.surprise.weight",
                np.zeros((4, 4), ml_dtypes.bfloat16))


def shape_mismatch(src):
    _add_tensor(src, "model.language_model.layers.0.linear_attn.norm.weight", np.zeros((17,), ml_dtypes.bfloat16))


def bad_method(src):
    _edit_json(os.path.join(src, "config.json"),
               lambda d: d["quantization_config"].__setitem__("quant_method", "bitsandbytes"))


def bad_bits(src):
    _edit_json(os.path.join(src, "config.json"),
               lambda d: d["quantization_config"]["config_groups"]["group_1"]["weights"].__setitem__("num_bits", 12))


def asymmetric(src):  # gptq fixture: declare the 8-bit shared experts asymmetric -> 9-bit differences
    def f(d):
        for k, v in d["quantization_config"]["extra_config"].items():
            if "shared_expert" in k:
                v["sym"] = False
    _edit_json(os.path.join(src, "config.json"), f)


def quantized_vision(src):  # a vision linear the config quantizes (6-bit g64 group): the tower stays unquantized
    module = "model.visual.merger.linear_fc1"
    _edit_json(os.path.join(src, "config.json"),
               lambda d: d["quantization_config"]["config_groups"]["group_0"]["targets"].append(module))
    parts = {f"{module}.weight_packed": np.zeros((8, 12), np.int32),
             f"{module}.weight_scale": np.ones((8, 1), np.float16),
             f"{module}.weight_shape": np.array([8, 64], np.int64)}
    write_safetensors(os.path.join(src, "extra-test.safetensors"),
                      [(n, v.dtype, v.shape, lambda v=v: v) for n, v in parts.items()])
    _edit_json(os.path.join(src, "model.safetensors.index.json"),
               lambda d: d["weight_map"].update({n: "extra-test.safetensors" for n in parts}))


CASES = [
    ("truncated", "ct", truncated, "truncated shard model-00002-of-00002.safetensors"),
    ("missing", "ct", missing, "missing tensor layers.2.linear_attn.A_log"),
    ("unexpected", "ct", unexpected, "unexpected tensor model.language_model.layers.0.linear_attn.surprise.weight"),
    ("shape", "ct", shape_mismatch, "shape mismatch: layers.0.linear_attn.norm.weight"),
    ("method", "ct", bad_method, "unsupported quant_method 'bitsandbytes'"),
    ("bits", "ct", bad_bits, "unsupported bits"),
    ("asymmetric", "gptq", asymmetric, "asymmetric 8-bit"),
    ("quantized_vision", "ct", quantized_vision, "quantized vision tower module model.visual.merger.linear_fc1"),
]


@pytest.mark.parametrize("case,fmt,mutate,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_one_line_nonzero_no_dst(tmp_path, case, fmt, mutate, message):
    src = _copy(tmp_path, fmt)
    mutate(src)
    dst = str(tmp_path / "out")
    r = run_cli(src, dst)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashnext-convert: error: "), r.stderr
    assert message in lines[0], lines[0]
    assert not os.path.exists(dst)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".out.tmp")]


def test_existing_dst_refused_then_force_replaces(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    r = run_cli(os.path.join(FIX, "gptq"), str(dst))
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "exists" in r.stderr
    assert (dst / "keep.txt").read_text() == "mine"
    r = run_cli(os.path.join(FIX, "gptq"), str(dst), "--force", "--verify", "--pp-partition", "1,3")
    assert r.returncode == 0, r.stderr
    assert not (dst / "keep.txt").exists() and (dst / "manifest.json").exists()
    assert sorted(p.name for p in dst.iterdir() if p.name.startswith("stage_")) == ["stage_0", "stage_1"]


def test_bad_pp_partition(tmp_path):
    r = run_cli(os.path.join(FIX, "gptq"), str(tmp_path / "out"), "--pp-partition", "2,3")
    assert r.returncode != 0 and "must be positive and sum to num_hidden_layers=4" in r.stderr
    assert not (tmp_path / "out").exists()


def test_kill_9_during_conversion_leaves_no_dst(tmp_path):
    # a tiny model with a ~1.5 GB n-gram table (sparse source files): the copy takes seconds
    cfg = tiny_text_config(ngram_vocab_size_base=12_000_000)
    rows, width = ngram_table_shape(cfg)
    assert rows * width * 2 > 1.4e9
    src = str(tmp_path / "big")
    write_synthetic_checkpoint(src, cfg, "bf16", random_data=False, ngram_shards=4)
    dst = str(tmp_path / "out")
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    p = subprocess.Popen([sys.executable, "-m", "convert", src, dst, "--verify", "--no-progress"], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp_prefix = ".out.tmp-"
    t0 = time.time()
    while time.time() - t0 < 60:  # wait until it is writing the n-gram table
        tmps = [f for f in os.listdir(tmp_path) if f.startswith(tmp_prefix)]
        if tmps and os.path.isdir(os.path.join(tmp_path, tmps[0], "stage_0", "ngram")):
            break
        assert p.poll() is None, "conversion finished before it could be killed"
        time.sleep(0.05)
    time.sleep(0.3)
    assert p.poll() is None, "conversion finished before it could be killed"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not os.path.exists(dst)
    stale = [f for f in os.listdir(tmp_path) if f.startswith(tmp_prefix)]
    assert stale  # the half-written temp dir is left, never DST
    shutil.rmtree(src)  # keep disk use small
    # a later run into the same parent removes temp dirs of dead processes
    r = run_cli(os.path.join(FIX, "gptq"), dst)
    assert r.returncode == 0, r.stderr
    assert not [f for f in os.listdir(tmp_path) if f.startswith(tmp_prefix)]
