"""Same-input projections merged at load time (weights.fuse_projections, layers.linear_group): the fused model
computes what the unfused one does, every group is fused where the formats allow, and mixed formats stay apart."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashnext_jax.config import GDN
from flashnext_jax.layers import FusedLinear, linear, linear_group
from flashnext_jax.model import Batch, forward, init_state
from flashnext_jax.weights import FUSED_PROJECTIONS, build_params, expected_tensors, fuse_projections
from pallas_kernels import quant_layout as ql
from tiny_configs import tiny_config


def _tensors(cfg, seed):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s, dtype=np.float32) * 0.05 for n, s in sorted(expected_tensors(cfg).items())}


def _logits(params, cfg, tokens):
    batch = Batch(tokens=tokens, start=jnp.zeros((1,), jnp.int32), n_valid=jnp.full((1,), tokens.shape[1], jnp.int32),
                  ple_rows=jnp.asarray(np.random.default_rng(7).standard_normal(
                      (len(cfg.ple_layers), 1, tokens.shape[1], cfg.ple_embed_dim)) * 0.05, jnp.float32))
    logits, _, _ = forward(params, cfg, batch, init_state(cfg, 1, 32, jnp.float32))
    return np.asarray(logits)


def test_fused_model_equals_unfused_and_every_group_is_fused():
    cfg = tiny_config()
    seed = int(np.random.default_rng().integers(1 << 30))
    tensors = _tensors(cfg, seed)
    fused = build_params(cfg, tensors, jnp.float32)
    plain = build_params(cfg, tensors, jnp.float32, fuse=False)
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (1, 12)), jnp.int32)
    np.testing.assert_allclose(_logits(fused, cfg, tokens), _logits(plain, cfg, tokens), rtol=2e-5, atol=2e-5,
                               err_msg=f"seed={seed}")

    gdn = cfg.layer_types.index(GDN)
    layer = fused["layers"][gdn]
    assert isinstance(layer["linear_attn"]["in_proj_qkv+in_proj_z"], FusedLinear)
    assert "in_proj_qkv" not in layer["linear_attn"] and "in_proj_a" not in layer["linear_attn"]
    assert layer["linear_attn"]["in_proj_b+in_proj_a"].sizes == (cfg.linear_num_value_heads,) * 2
    assert isinstance(layer["mlp"]["shared_expert"]["gate_proj+up_proj"], FusedLinear)
    assert layer["mlp"]["gate+shared_expert_gate"].sizes == (cfg.num_experts, 1)  # router + shared-expert gate
    qsa = next(lp for lp in fused["layers"] if "self_attn" in lp)["self_attn"]
    assert set(qsa) >= {"q_proj+k_proj+v_proj"} and "q_proj" not in qsa
    keys = set()
    jax.tree_util.tree_map_with_path(lambda p, _: keys.add(jax.tree_util.keystr(p)), fused)
    for names in FUSED_PROJECTIONS:  # no part left unfused anywhere (decoder layers and the MTP head)
        assert not any(f"['{n}']" in k for n in names for k in keys), names


@pytest.mark.parametrize("bits,group", [(4, 128), (6, 64), (8, 128)])
def test_quantized_parts_fuse_column_wise(bits, group):
    rng = np.random.default_rng()
    ws = [ql.quantize_rtn(rng.standard_normal((256, n)).astype(np.float32) * 0.1, bits, group) for n in (64, 128, 32)]
    ws = [jax.tree.map(jnp.asarray, w) for w in ws]
    p = fuse_projections({"q_proj": ws[0], "k_proj": ws[1], "v_proj": ws[2]})
    assert list(p) == ["q_proj+k_proj+v_proj"] and p["q_proj+k_proj+v_proj"].sizes == (64, 128, 32)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    for got, w in zip(linear_group(x, p, ("q_proj", "k_proj", "v_proj")), ws):  # fp32 dots of other widths
        np.testing.assert_allclose(np.asarray(got), np.asarray(linear(x, w)), rtol=1e-5, atol=1e-5)


def test_mixed_formats_stay_separate():
    rng = np.random.default_rng()
    a = jax.tree.map(jnp.asarray, ql.quantize_rtn(rng.standard_normal((128, 64)).astype(np.float32), 6, 64))
    b = jax.tree.map(jnp.asarray, ql.quantize_rtn(rng.standard_normal((128, 64)).astype(np.float32), 8, 64))
    p = fuse_projections({"key_proj": a, "value_proj": b, "other": jnp.ones(3)})
    assert set(p) == {"key_proj", "value_proj", "other"}
    x = jnp.asarray(rng.standard_normal((2, 128)), jnp.float32)
    k, v = linear_group(x, p, ("key_proj", "value_proj"))
    np.testing.assert_array_equal(np.asarray(v), np.asarray(linear(x, b)))
    assert k.shape == (2, 64)
