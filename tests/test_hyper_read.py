"""The fused hyper-connection read (pallas_kernels/hyper_read.py, interpret mode) against the model's reference
hyper_read (flashnext_jax/hyper.py) run in float32 on the same inputs and dequantized weights."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashnext_jax import hyper
from pallas_kernels import quant_layout as ql
from pallas_kernels.hyper_read import HyperReadConfig, check_hyper_read, default_hyper_config, hyper_read_fused

from test_quant_matmul import fresh_rng, random_weight


def make_read(rng, s, h, r, bits, group, inject):
    _, _, wd = random_weight(rng, s * h, r, bits, group, dtype=np.float32)
    _, _, wu = random_weight(rng, r, s * h, bits, group, dtype=np.float32)
    cast = lambda w: ql.QuantizedWeight(w.planes, w.scales.astype(jnp.bfloat16), w.bits, w.group_size, w.k, w.n)
    p = {"hc_norm": jnp.asarray(rng.standard_normal(s * h) * 0.2, jnp.bfloat16),
         "input_mix_weight_down": cast(wd), "input_mix_weight_up": cast(wu)}
    if inject:
        p["block_inject_weight"] = jnp.asarray(rng.standard_normal((s, s * h)) * 0.02, jnp.bfloat16)
    return p


def reference_read(p, cfg, x):
    """The model's hyper_read in float32 (reference impl: its kernels are never used for float32)."""
    p32 = dict(p, hc_norm=p["hc_norm"].astype(jnp.float32))
    if "block_inject_weight" in p:
        p32["block_inject_weight"] = p["block_inject_weight"].astype(jnp.float32)
    return hyper.hyper_read(p32, cfg, x.astype(jnp.float32))


def rel_err(got, ref):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert got.shape == ref.shape and np.isfinite(got).all()
    return np.abs(got - ref).max() / (np.abs(ref).max() + 1e-9)


@pytest.mark.parametrize("bits,group,m,inject", [(8, 64, 1, True), (8, 64, 3, True), (4, 32, 2, False),
                                                 (6, 32, 1, True)])
def test_fused_read_matches_float32_reference(bits, group, m, inject):
    rng, seed = fresh_rng()
    s, h, r = 4, 256, 64
    cfg = types.SimpleNamespace(hc_count=s, hidden_size=h, rms_norm_eps=1e-6)
    p = make_read(rng, s, h, r, bits, group, inject)
    # streams of different scales: a wrong per-stream norm factor shows
    x = jnp.asarray(rng.standard_normal((m, s * h)) * np.repeat([0.5, 1.0, 3.0, 8.0], h), jnp.bfloat16)
    u_ref, g_ref = reference_read(p, cfg, x)
    u, g = hyper_read_fused(x, p["hc_norm"], p["input_mix_weight_down"], p["input_mix_weight_up"],
                            p.get("block_inject_weight"), n_streams=s, eps=1e-6, interpret=True)
    assert u.dtype == x.dtype
    assert rel_err(u, u_ref) < 1.5e-2, seed  # u is rounded to bf16; the rest is fp32 in both
    if inject:
        assert rel_err(g, g_ref) < 1e-2, seed
    else:
        assert g is None and g_ref is None


def test_model_read_takes_the_fused_kernels_and_agrees(monkeypatch):
    """hyper.hyper_read dispatches to the kernels (interpret impl, bf16, quantized mixers) and matches its own
    reference code path."""
    rng, seed = fresh_rng()
    s, h, r = 4, 128, 64
    cfg = types.SimpleNamespace(hc_count=s, hidden_size=h, rms_norm_eps=1e-6)
    p = make_read(rng, s, h, r, 8, 64, True)
    x = jnp.asarray(rng.standard_normal((2, 1, s * h)), jnp.bfloat16)
    monkeypatch.setenv("FLASHNEXT_KERNELS", "reference")
    assert hyper.fused_hyper_read(p, cfg, x) is None
    u_ref, g_ref = hyper.hyper_read(p, cfg, x)
    monkeypatch.setenv("FLASHNEXT_KERNELS", "interpret")
    assert hyper.fused_hyper_read(p, cfg, x) is not None
    u, g = hyper.hyper_read(p, cfg, x)
    assert u.shape == u_ref.shape == (2, 1, h) and g.shape == g_ref.shape == (2, 1, s)
    # The bf16 code path rounds normed / down / mix / up to bf16 on the way (~4e-2 of max |u| apart from the
    # kernels); the kernels must be at least as close to the float32 truth as that path is.
    u32, g32 = reference_read(p, cfg, x)
    assert rel_err(u, u32) < 1.5e-2 and rel_err(u, u32) <= rel_err(u_ref, u32) + 4e-3, seed
    assert rel_err(g, g32) < 1e-2 and rel_err(g, g32) <= rel_err(g_ref, g32) + 4e-3, seed
    assert rel_err(u, u_ref) < 8e-2 and rel_err(g, g_ref) < 4e-2, seed
    # float32 and plain (unquantized) mixers stay on the reference code
    assert hyper.fused_hyper_read(p, cfg, x.astype(jnp.float32)) is None
    plain = dict(p, input_mix_weight_down=ql.dequantize(p["input_mix_weight_down"]))
    assert hyper.fused_hyper_read(plain, cfg, x) is None


def test_check_names_the_problem():
    rng, _ = fresh_rng()
    p = make_read(rng, 4, 128, 64, 8, 64, True)
    wd, wu, wb = p["input_mix_weight_down"], p["input_mix_weight_up"], p["block_inject_weight"]
    with pytest.raises(ValueError, match="M <= 8"):
        check_hyper_read((9, 512), 4, wd, wu, wb)
    with pytest.raises(ValueError, match="block_inject"):
        check_hyper_read((1, 512), 4, wd, wu, wb.T)
    with pytest.raises(ValueError, match="splits_per_stream"):
        check_hyper_read((1, 512), 4, wd, wu, wb, HyperReadConfig(splits_per_stream=3, bn_down=32))
    with pytest.raises(ValueError, match="quantized"):
        check_hyper_read((1, 512), 4, ql.dequantize(wd), wu, wb)
    cfg = default_hyper_config(512, 4, wd, wu)
    assert cfg.splits_per_stream == 2 and cfg.bh == 16 and cfg.bn_down == 64  # one split per group of a stream
    check_hyper_read((1, 512), 4, wd, wu, wb, cfg)
