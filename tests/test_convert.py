"""Converter: exact dequantisation vs the libraries, byte-identical plain tensors, our format, PP layout."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from convert import expected_tensors, load_converted, read_checkpoint
from convert.errors import ConvertError
from convert.readers import CTLinear, build_quantized, canonical_name, open_checkpoint
from convert.safetensors_io import SafetensorsFile
from convert.testing import tiny_text_config, write_synthetic_checkpoint
from convert.writer import convert, read_manifest, verify_converted
from pallas_kernels.quant_layout import QuantizedWeight, dequantize

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "quant")
REF = "/work/shared/reference"
EXPERT = re.compile(r"(.*mlp\.experts)\.(\d+)\.(gate|up|down)_proj$")


@pytest.fixture(scope="module")
def loaded():
    """canonical tensors of both library-made checkpoints (read once)."""
    out = {}
    for fmt in ("gptq", "ct"):
        ck = open_checkpoint(os.path.join(FIX, fmt))
        out[fmt] = (ck, dict(ck.tensors()))
    return out


def _ours_for(vals: dict, src_module: str) -> np.ndarray:
    """Our float32 dequantisation [out, in] of one source module (an expert is sliced out of its stack)."""
    c = canonical_name(src_module)
    m = EXPERT.match(c)
    if not m:
        return np.asarray(dequantize(vals[c + ".weight"])).T
    which = m.group(3)
    qw = vals[m.group(1) + (".down_proj" if which == "down" else ".gate_up_proj")][int(m.group(2))]
    w = np.asarray(dequantize(qw))
    if which != "down":
        i = w.shape[1] // 2
        w = w[:, :i] if which == "gate" else w[:, i:]
    return w.T


@pytest.mark.parametrize("fmt,bits", [("gptq", {2, 3, 4, 6, 8}), ("ct", {4, 6, 8})])
def test_dequantisation_equals_library_exactly(loaded, fmt, bits):
    _, vals = loaded[fmt]
    lib = load_file(os.path.join(FIX, f"library_dequant_{fmt}.safetensors"))
    seen = set()
    for name, ref in lib.items():
        if "::" in name:
            continue
        ours = _ours_for(vals, name)
        assert ours.dtype == np.float32 and ours.shape == ref.shape, name
        np.testing.assert_array_equal(ours, ref, err_msg=name)
        seen.add(int(lib[name + "::bits"]))
    assert seen == bits  # every bit width of the format was compared


def test_every_quantized_tensor_is_quantized_with_source_bits(loaded):
    ck, vals = loaded["ct"]
    q = {n for n, v in vals.items() if isinstance(v, QuantizedWeight)}
    assert "embed_tokens.weight" in q and "lm_head.weight" in q and "layers.0.mlp.experts.gate_up_proj" in q
    assert vals["layers.0.mlp.experts.gate_up_proj"].bits == 4
    assert vals["layers.0.linear_attn.in_proj_qkv.weight"].bits == 6
    assert vals["layers.1.ple.value_proj.weight"].group_size == 64  # channel strategy: one group of K
    assert not any(n.startswith("mtp.") for n in q)  # MTP bf16 in the Minachist-like layout


def test_asymmetric_and_channel_compressed_tensors_equal_library():
    lib = load_file(os.path.join(FIX, "library_dequant_ct_asym.safetensors"))
    sf = SafetensorsFile(os.path.join(FIX, "ct_asym.safetensors"))
    specs = {"asym4g32": (4, "group", 32, False), "asym6g32": (6, "group", 32, False),
             "asym8ch": (8, "channel", None, False), "sym4ch": (4, "channel", None, True)}
    for name, (b, strategy, g, sym) in specs.items():
        p = {k.split(".", 1)[1]: t for k, t in sf.tensors.items() if k.startswith(name + ".")}
        args = {"num_bits": b, "strategy": strategy, "group_size": g, "symmetric": sym, "type": "int"}
        if b == 8 and not sym:  # q - zero needs 9 bits: refused with a clear error, never re-quantized
            with pytest.raises(ConvertError, match="asymmetric 8-bit"):
                CTLinear(name, p, args, "pack-quantized")
            continue
        src = CTLinear(name, p, args, "pack-quantized")
        qw = build_quantized(name, [[src]], stacked=False)
        assert qw.bits == (b if sym else {4: 6, 6: 8}[b])  # asymmetric widened exactly
        np.testing.assert_array_equal(np.asarray(dequantize(qw)).T, lib[name], err_msg=name)


def _raw_bytes(path: str, name: str) -> bytes:
    """Independent of convert.safetensors_io: the stored bytes of one tensor."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        h = json.loads(f.read(n))[name]
        b, e = h["data_offsets"]
        f.seek(8 + n + b)
        return f.read(e - b)


@pytest.mark.parametrize("fmt", ["gptq", "ct"])
def test_unquantized_tensors_byte_identical(loaded, fmt):
    ck, vals = loaded[fmt]
    index = os.path.join(FIX, fmt, "model.safetensors.index.json")
    wm = json.load(open(index))["weight_map"] if os.path.exists(index) else None
    n = 0
    for e in ck.entries:
        v = vals[e.name]
        if isinstance(v, QuantizedWeight):
            continue
        if e.name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        (src,) = e.sources
        f = os.path.join(FIX, fmt, wm[src] if wm else "model.safetensors")
        assert v.tobytes() == _raw_bytes(f, src), e.name
        n += 1
    assert n > 40


def test_plain_experts_are_stacked_gate_first(loaded):
    ck, vals = loaded["ct"]  # the MTP layer keeps bf16 per-expert tensors
    f = os.path.join(FIX, "ct", "model_extra_tensors.safetensors")
    gu, dn = vals["mtp.layers.0.mlp.experts.gate_up_proj"], vals["mtp.layers.0.mlp.experts.down_proj"]
    assert gu.shape == (8, 64, 64) and dn.shape == (8, 64, 32) and gu.dtype == ml_dtypes.bfloat16
    for e in (0, 7):
        g = _raw_bytes(f, f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight")
        u = _raw_bytes(f, f"mtp.layers.0.mlp.experts.{e}.up_proj.weight")
        assert gu[e, :32].tobytes() == g and gu[e, 32:].tobytes() == u
        assert dn[e].tobytes() == _raw_bytes(f, f"mtp.layers.0.mlp.experts.{e}.down_proj.weight")


def test_read_checkpoint_api_and_ngram_table(loaded):
    cfg, it, table, scale = read_checkpoint(os.path.join(FIX, "ct"))
    assert cfg["model_type"] == "qwen4_exp" and scale is None
    names = [n for n, _ in it]
    assert names[0] == "embed_tokens.weight" and "lm_head.weight" in names
    assert not any("visual" in n or "hashstats" in n or "ngram_embedding" in n for n in names)
    assert table.shape == (2304, 4) and table.dtype == ml_dtypes.bfloat16
    f = os.path.join(FIX, "ct", "model-00002-of-00002.safetensors")
    shard1 = _raw_bytes(f, "model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_1.weight")
    assert table[576:1152].tobytes() == shard1  # concatenated in shard order
    ids = np.array([[0, 1000], [2303, 577]])
    np.testing.assert_array_equal(table[ids], np.asarray(table)[ids])


def test_expected_set_matches_the_real_checkpoint_listing():
    cfg = json.load(open(os.path.join(REF, "qwen38_text_config.json")))
    exp = expected_tensors({"text_config": cfg, "tie_word_embeddings": False})
    for tsv in ("real_tensors_bf16.tsv", "real_tensors_minachist.tsv"):
        for line in open(os.path.join(REF, tsv)):
            if line.startswith("#"):
                continue
            name, _, shape = line.rstrip("\n").split("\t")
            shape = json.loads(shape)
            if "ngram_embedding" in name or name.endswith("weight_shape"):
                continue
            c = canonical_name(re.sub(r"\.(weight_packed|weight_scale)$", ".weight", name))
            m = re.match(r"(.*mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", c)
            if m:
                full = exp[m.group(1) + (".down_proj" if m.group(3) == "down" else ".gate_up_proj")].shape
                want = list(full[1:]) if m.group(3) == "down" else [full[1] // 2, full[2]]
            else:
                want = list(exp[c].shape)
            if name.endswith("weight_packed"):
                bits = shape[1] * 32 // want[1]
                assert bits in (4, 6, 8) and shape[0] == want[0], name
            elif name.endswith("weight_scale"):
                assert shape[0] == want[0] and want[1] % shape[1] == 0, name
            else:
                assert shape == want, name


# ---------------------------------------------------------------------------------------------------------
# our format

@pytest.fixture(scope="module")
def converted(tmp_path_factory, loaded):
    d = tmp_path_factory.mktemp("conv")
    dst = os.path.join(d, "ct_pp")
    convert(os.path.join(FIX, "ct"), dst, pp_partition=[2, 2], verify=True, progress=False)
    return dst


def _same(a, b):
    if isinstance(a, QuantizedWeight):
        assert isinstance(b, QuantizedWeight) and (a.bits, a.group_size, a.k, a.n) == (b.bits, b.group_size, b.k, b.n)
        for x, y in zip(a.planes + (a.scales,), b.planes + (b.scales,)):
            assert np.asarray(x).dtype == np.asarray(y).dtype
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    else:
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_converted_equals_direct_read(converted, loaded):
    _, vals = loaded["ct"]
    cfg, it, table, scale = load_converted(converted)
    got = dict(it)
    assert set(got) == set(vals)
    for n, v in vals.items():
        _same(v, got[n])
    assert isinstance(table, np.memmap) and table.shape == (2304, 4)
    _, _, src_table, _ = read_checkpoint(os.path.join(FIX, "ct"))
    assert np.asarray(src_table).tobytes() == np.asarray(table).tobytes()
    for f in ("chat_template.jinja", "tokenizer_config.json", "generation_config.json"):
        assert open(os.path.join(converted, f), "rb").read() == open(os.path.join(FIX, "ct", f), "rb").read()
    # read_checkpoint also accepts our format
    assert read_checkpoint(converted)[0] == cfg


def test_manifest_and_pp_partition_layout(converted):
    m = read_manifest(converted)
    assert m["format"] == "flashnext-converted" and m["format_version"] == 1
    assert m["source"]["format"] == "compressed-tensors" and m["hf_config"]["model_type"] == "qwen4_exp"
    assert [s["layers"] for s in m["stages"]] == [[0, 2], [2, 4]]
    info = m["tensors"]["layers.0.mlp.experts.gate_up_proj"]
    assert info["kind"] == "quantized" and info["quant"]["bits"] == 4 and info["shape"] == [8, 64, 64]
    groups = {g["name"]: g["stage"] for g in m["groups"]}
    assert groups == {"embed": 0, "layer_000": 0, "layer_001": 0, "layer_002": 1, "layer_003": 1, "head": 1, "mtp": 1,
                      "vision": 0}
    assert sorted(os.listdir(os.path.join(converted, "stage_0", "weights"))) == ["embed", "layer_000", "layer_001",
                                                                                 "vision"]
    assert m["tensors"]["visual.blocks.0.attn.qkv.weight"]["kind"] == "plain"  # a quantized source's tower
    assert sorted(os.listdir(os.path.join(converted, "stage_1", "weights"))) == ["head", "layer_002", "layer_003", "mtp"]
    assert m["ngram_table"]["stage"] == 0 and os.path.exists(os.path.join(converted, m["ngram_table"]["parts"][0]["file"]))
    st1 = json.load(open(os.path.join(converted, "stage_1", "stage.json")))
    assert st1["ngram_table"] is None and "lm_head.weight" in st1["tensors"] and "embed_tokens.weight" not in st1["tensors"]
    _, it, table, _ = load_converted(converted, stages=[1])
    names = [n for n, _ in it]
    assert table is None and "lm_head.weight" in names and not any(n.startswith(("layers.0.", "layers.1.")) for n in names)


def test_verify_detects_corruption(converted, tmp_path):
    dst = str(tmp_path / "copy")
    shutil.copytree(converted, dst)
    verify_converted(dst)
    part = os.path.join(dst, read_manifest(dst)["ngram_table"]["parts"][0]["file"])
    with open(part, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ConvertError, match="n-gram part"):
        verify_converted(dst)


@pytest.mark.parametrize("fmt,kw", [("bf16", {"fused_experts": True, "release_layout": False}),
                                    ("bf16", {}), ("fp8", {})])
def test_synthetic_bf16_and_block_fp8(tmp_path, fmt, kw):
    src = str(tmp_path / "src")
    keep = write_synthetic_checkpoint(src, tiny_text_config(), fmt, **kw)
    cfg, it, table, scale = read_checkpoint(src)
    vals = dict(it)
    prefix = "model." if not kw.get("release_layout", True) else "model.language_model."
    gu = vals["layers.2.mlp.experts.gate_up_proj"]
    assert gu.shape == (8, 64, 64) and gu.dtype == ml_dtypes.bfloat16
    if fmt == "bf16":
        if kw.get("fused_experts"):
            assert gu.tobytes() == keep[prefix + "layers.2.mlp.experts.gate_up_proj"].tobytes()
        else:
            assert gu[3, 32:].tobytes() == keep[prefix + "layers.2.mlp.experts.3.up_proj.weight"].tobytes()
        assert scale is None and table.dtype == ml_dtypes.bfloat16
    else:  # block FP8: dequantised to bf16 = bf16(fp8 * scale_inv[block])
        w = keep[prefix + "layers.0.linear_attn.in_proj_qkv.weight"].astype(np.float32)
        s = keep[prefix + "layers.0.linear_attn.in_proj_qkv.weight_scale_inv"]
        want = (w * np.kron(s, np.ones((128, 128), np.float32))[: w.shape[0], : w.shape[1]]).astype(ml_dtypes.bfloat16)
        assert vals["layers.0.linear_attn.in_proj_qkv.weight"].tobytes() == want.tobytes()
        assert scale == 0.125 and table.dtype == ml_dtypes.float8_e4m3fn
        assert vals["lm_head.weight"].dtype == ml_dtypes.bfloat16


# ---------------------------------------------------------------------------------------------------------
# fast paths, AWQ, the other fixtures

class _Info:
    """A TensorInfo stand-in holding an in-memory array."""

    def __init__(self, a):
        self.a, self.shape, self.dtype, self.nbytes, self.name = a, a.shape, a.dtype, a.nbytes, "t"

    def read(self):
        return self.a


def _build(src, fast: bool) -> QuantizedWeight:
    import convert.readers as R

    old = R.FAST_PATHS
    R.FAST_PATHS = fast
    try:
        return build_quantized("t", [[src]], stacked=False)
    finally:
        R.FAST_PATHS = old


@pytest.mark.parametrize("bits,g", [(4, 32), (4, 128), (8, 64), (8, 128)])
def test_uint8_fast_paths_equal_pack(bits, g):
    from convert.readers import GPTQLinear

    rng = np.random.default_rng(bits * 1000 + g)
    n, k = 96, 256
    scales = rng.standard_normal((n, k // g)).astype(np.float16)
    p = {"weight_packed": _Info(rng.integers(-2**31, 2**31, (n, k * bits // 32), dtype=np.int64).astype(np.int32)),
         "weight_scale": _Info(scales), "weight_shape": _Info(np.array([n, k], np.int64))}
    src = CTLinear("t", p, {"num_bits": bits, "group_size": g, "strategy": "group", "symmetric": True}, "pack-quantized")
    _same(_build(src, True), _build(src, False))
    zero = (1 << (bits - 1)) - 1  # auto_gptq stores zero - 1
    word = sum(zero << (bits * i) for i in range(32 // bits))
    gp = {"qweight": _Info(rng.integers(-2**31, 2**31, (k * bits // 32, n), dtype=np.int64).astype(np.int32)),
          "qzeros": _Info(np.full((k // g, n * bits // 32), np.uint32(word).view(np.int32), np.int32)),
          "scales": _Info(scales.T.copy())}
    src = GPTQLinear("t", gp, bits, g, True, 1, "auto_gptq")
    _same(_build(src, True), _build(src, False))


def test_awq_gemm_unpacking():
    from convert.readers import AWQLinear

    rng = np.random.default_rng(7)
    k, n, g = 64, 32, 32
    q = rng.integers(0, 16, (k, n))
    z = rng.integers(0, 16, (k // g, n))
    order = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of word w holds column 8w + order[i]

    def pack_awq(v):
        out = np.zeros((v.shape[0], v.shape[1] // 8), np.uint32)
        for i in range(8):
            out |= v[:, order[i]::8].astype(np.uint32) << (4 * i)
        return out.view(np.int32)

    scales = rng.standard_normal((k // g, n)).astype(np.float16)
    src = AWQLinear("t", {"qweight": _Info(pack_awq(q)), "qzeros": _Info(pack_awq(z)), "scales": _Info(scales)},
                    4, g, "awq")
    qw = build_quantized("t", [[src]], stacked=False)
    want = (q - np.repeat(z, g, axis=0)).astype(np.float32) * np.repeat(scales.astype(np.float32), g, axis=0)
    assert qw.bits == 6
    np.testing.assert_array_equal(np.asarray(dequantize(qw)), want)


@pytest.mark.parametrize("path", ["flashnext_jax/demo_model", "tests/fixtures/tiny_causal"])
def test_bf16_fixtures_of_the_project_read_and_convert(tmp_path, path):
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)
    if not os.path.exists(os.path.join(src, "config.json")):
        pytest.skip(f"{path} not generated")
    _, it, table, _ = read_checkpoint(src)
    direct = dict(it)
    dst = str(tmp_path / "out")
    convert(src, dst, verify=True, progress=False)
    _, it2, table2, _ = load_converted(dst)
    got = dict(it2)
    assert set(got) == set(direct)
    for name, v in direct.items():
        _same(v, got[name])
    assert np.asarray(table).tobytes() == np.asarray(table2).tobytes()


def test_auto_awq_equals_library():
    from convert.readers import scheme_for

    qcfg = json.load(open(os.path.join(FIX, "awq_config.json")))
    scheme = scheme_for({"quantization_config": qcfg})  # quant_method awq, version gemm (AutoRound auto_awq)
    lib = load_file(os.path.join(FIX, "library_dequant_awq.safetensors"))
    sf = SafetensorsFile(os.path.join(FIX, "awq_samples.safetensors"))
    n = 0
    for name, ref in lib.items():
        if "::" in name:
            continue
        p = {k[len(name) + 1:]: t for k, t in sf.tensors.items() if k.startswith(name + ".")}
        qw = build_quantized(name, [[scheme.linear(name, p)]], stacked=False)
        assert qw.bits == 6  # 4-bit asymmetric: q - zero in [-15, 15], stored exactly in the 6-bit layout
        np.testing.assert_array_equal(np.asarray(dequantize(qw)).T, ref, err_msg=name)
        n += 1
    assert n >= 3


def test_converted_demo_model_keeps_its_vision_tower_and_load_finds_it(tmp_path):
    """model.visual.* is kept byte for byte (unquantized, source dtype) in a "vision" group of the first stage with
    preprocessor_config.json beside it, and load() of the converted directory has the tower: its embeddings and
    an image chat's logits equal the unconverted model's (float32, bit for bit)."""
    import flashnext_jax as fj
    from convert import read_vision
    from flashnext_jax.api import DEMO_MODEL, ImageInput

    dst = str(tmp_path / "out")
    manifest = convert(str(DEMO_MODEL), dst, verify=True, progress=False)
    index = json.load(open(DEMO_MODEL / "model.safetensors.index.json"))["weight_map"]
    source = {n: SafetensorsFile(str(DEMO_MODEL / f)).tensors[n].read() for n, f in index.items()
              if n.startswith("model.visual.")}
    kept = read_vision(dst)
    assert source and set(kept) == {"visual." + n[len("model.visual."):] for n in source}
    for n, a in source.items():
        b = kept["visual." + n[len("model.visual."):]]
        assert a.dtype == b.dtype == ml_dtypes.bfloat16 and a.shape == b.shape and a.tobytes() == b.tobytes()
    info = [t for n, t in manifest["tensors"].items() if n.startswith("visual.")]
    assert len(info) == len(source) and all(t["kind"] == "plain" and t["stage"] == 0 for t in info)
    assert manifest["has_vision"] and not any(n.startswith("visual.") for n, _ in load_converted(dst)[1])
    for f in ("preprocessor_config.json", "chat_template.jinja"):
        assert open(os.path.join(dst, f), "rb").read() == open(DEMO_MODEL / f, "rb").read()

    ref = np.load(os.path.join(os.path.dirname(FIX), "reference_vision.npz"))
    ids, images = ref["chat/one_image/ids"].tolist(), ImageInput(ref["chat/one_image/pixel_values"],
                                                                 ref["chat/one_image/grid_thw"])
    hf, ours = fj.load(DEMO_MODEL, dtype="float32"), fj.load(dst, dtype="float32")
    assert ours.vision is not None and ours.vision.processor == hf.vision.processor
    np.testing.assert_array_equal(np.asarray(ours.image_embeddings(images)), np.asarray(hf.image_embeddings(images)))
    np.testing.assert_array_equal(ours.logits(ids, images), hf.logits(ids, images))


def test_a_vision_tower_unlike_its_vision_config_is_refused_before_anything_is_written(tmp_path):
    """The demo model's tower, written by transformers (tools/make_fixtures.py), is exactly the set
    `vision.vision_tensor_shapes` derives from its vision_config; a config that disagrees with the tensors is a
    ConvertError naming every problem, and nothing is written (before: the conversion passed and load() failed)."""
    from convert import read_vision
    from flashnext_jax.api import DEMO_MODEL
    from flashnext_jax.vision import vision_config, vision_tensor_shapes

    config = json.loads((DEMO_MODEL / "config.json").read_text())
    assert {n: tuple(a.shape) for n, a in read_vision(str(DEMO_MODEL)).items()} == \
        vision_tensor_shapes(vision_config(config))
    for i, (change, needle) in enumerate((
            ({"depth": 2}, "vision tower: missing tensors visual.blocks.1."),
            ({"depth": 0}, "vision tower: unexpected tensors model.visual.blocks.0."),
            ({"intermediate_size": 48}, "shape mismatch: visual.blocks.0.mlp.linear_fc1.bias is [64], expected [48]"))):
        src, dst = tmp_path / f"src{i}", tmp_path / f"out{i}"
        shutil.copytree(DEMO_MODEL, src)
        (src / "config.json").write_text(json.dumps({**config, "vision_config": {**config["vision_config"], **change}}))
        with pytest.raises(ConvertError, match=re.escape(needle)):
            convert(str(src), str(dst), progress=False)
        assert not dst.exists()


def test_block_fp8_vision_linear_is_dequantised_like_the_text_model(tmp_path):
    """A block-FP8 source's vision linear becomes bf16(fp8 * scale_inv) (our tower has no FP8 path); its bias, a
    plain tensor, stays as stored."""
    from convert import read_vision
    from convert.testing import write_safetensors

    src = str(tmp_path / "src")
    write_synthetic_checkpoint(src, tiny_text_config(), "fp8")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 16)).astype(ml_dtypes.float8_e4m3fn)
    parts = {"model.visual.merger.linear_fc2.weight": w,
             "model.visual.merger.linear_fc2.weight_scale_inv": np.array([[0.5]], np.float32),
             "model.visual.merger.linear_fc2.bias": rng.standard_normal(8).astype(ml_dtypes.bfloat16)}
    write_safetensors(os.path.join(src, "visual.safetensors"), [(n, v.dtype, v.shape, lambda v=v: v)
                                                                for n, v in parts.items()])
    index = os.path.join(src, "model.safetensors.index.json")
    d = json.load(open(index))
    d["weight_map"].update({n: "visual.safetensors" for n in parts})
    json.dump(d, open(index, "w"))
    got = read_vision(src)
    assert set(got) == {"visual.merger.linear_fc2.weight", "visual.merger.linear_fc2.bias"}
    want = (w.astype(np.float32) * 0.5).astype(ml_dtypes.bfloat16)
    assert got["visual.merger.linear_fc2.weight"].tobytes() == want.tobytes()
    assert got["visual.merger.linear_fc2.bias"].tobytes() == parts["model.visual.merger.linear_fc2.bias"].tobytes()
