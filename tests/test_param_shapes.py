"""The real config builds params (abstractly, no allocation) whose shapes equal the release's tensor shapes."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp

from flashnext_jax.config import real_config
from flashnext_jax.ple import NgramHasher
from convert.readers import canonical_name
from flashnext_jax.weights import init_params, param_path

TSV = Path(__file__).parents[1] / "flashnext_jax" / "reference" / "real_tensors_bf16.tsv"


def real_rows():
    for line in TSV.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, dtype, shape = line.split("\t")
        yield name, dtype, tuple(int(x) for x in re.findall(r"\d+", shape))


def leaf(tree, path):
    for key in path:
        tree = tree[int(key)] if key.isdigit() else tree[key]
    return tree


def test_eval_shape_params_match_release_tensors():
    cfg = real_config()
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), jnp.bfloat16))
    hasher = NgramHasher(cfg)
    expert = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    checked = 0
    for hf_name, _, shape in real_rows():
        name = canonical_name(hf_name)
        if "ngram_embedding.shard_" in name:
            assert shape == (hasher.padded_rows // cfg.split_ngram_parts, cfg.ngram_row_width)
            continue
        if name.endswith(("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")):
            assert shape[0] in (cfg.ngram_size, cfg.ngram_heads)
            continue
        m = expert.match(name)
        if m:
            e, part = int(m.group(2)), m.group(3)
            stacked = leaf(params, param_path(m.group(1) + (".down_proj" if part == "down_proj" else ".gate_up_proj")))
            assert e < stacked.shape[0]
            if part == "down_proj":  # ours [E, I, H]; torch [H, I]
                assert stacked.shape[1:] == shape[::-1]
            else:  # ours [E, H, 2I] with gate then up columns; torch [I, H]
                assert stacked.shape[1] == shape[1] and stacked.shape[2] == 2 * shape[0]
            checked += 1
            continue
        got = leaf(params, param_path(name)).shape
        if name.endswith("conv1d.weight"):
            want = (shape[0], shape[2])
        else:  # dense linears keep torch's [out, in] (weights.orient)
            want = shape
        assert got == want, name
        checked += 1
    assert checked > 100


def test_real_size_forward_and_mtp_trace_with_the_right_shapes():
    """Trace (no allocation) one prefill step and the MTP head at the real config: catches real-shape bugs."""
    from flashnext_jax.model import Batch, forward, init_state
    from flashnext_jax.mtp import init_mtp_cache, mtp_forward

    cfg = real_config()
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), jnp.bfloat16))
    state = jax.eval_shape(lambda: init_state(cfg, 2, 64, jnp.bfloat16))
    spec = jax.ShapeDtypeStruct
    batch = Batch(tokens=spec((2, 16), jnp.int32), start=spec((2,), jnp.int32), n_valid=spec((2,), jnp.int32),
                  ple_rows=spec((1, 2, 16, cfg.ple_embed_dim), jnp.bfloat16))
    logits, hyper, new_state = jax.eval_shape(lambda p, b, s: forward(p, cfg, b, s), params, batch, state)
    assert logits.shape == (2, 16, cfg.vocab_size) and hyper.shape == (2, 16, cfg.hc_hidden_size)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), new_state) == jax.tree.map(lambda a: (a.shape, a.dtype), state)
    assert new_state.gdn_rec.shape == (36, 2, 48, 128, 128) and new_state.gdn_rec.dtype == jnp.float32
    cache = jax.eval_shape(lambda: init_mtp_cache(cfg, 2, 64, jnp.bfloat16))
    draft, chained, _ = jax.eval_shape(lambda p, h, t, s, n, c: mtp_forward(p, cfg, h, t, s, n, c), params, hyper,
                                       batch.tokens, batch.start, batch.n_valid, cache)
    assert draft.shape == (2, 16, cfg.vocab_size) and chained.shape == hyper.shape
