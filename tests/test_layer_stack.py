"""Layer weights stacked over layers (flashnext_jax.layer_stack): the kernels read one layer of a stack in place.

Each kernel run on `LayerSlice(stack, i)` must equal the same kernel on layer i's own arrays, and must not read
the other layers: their scales are NaN (any read of them makes outputs NaN) and their planes are different
random integers. The model-level equality (stacked vs per-layer params, reference and interpret kernels) is here
too; parity with transformers through the stacked params is tests/test_parity_transformers.py (api.Model stacks).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import decode_step
from flashnext_jax import api
from flashnext_jax.config import from_hf_config
from flashnext_jax.layer_stack import LayerStack, layer_signature, stack_layers
from flashnext_jax.model import Batch, forward, init_state
from pallas_kernels import quant_layout as ql
from pallas_kernels.moe_matmul import MoEGemvConfig, routed_experts
from pallas_kernels.quant_gemv import quant_matmul_gemv
from pallas_kernels.quant_layout import LayerSlice
from pallas_kernels.quant_matmul import quant_matmul, quant_matmul_pallas, quant_matmul_reference

L = 3


def fresh_rng():
    seed = int.from_bytes(os.urandom(4), "little")
    return np.random.default_rng(seed), seed


def packed(rng, shape, bits, group):
    *lead, k, n = shape
    q = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), size=shape).astype(np.int8)
    s = (rng.uniform(0.5, 2.0, (*lead, k // group, n)) * np.where(rng.random((*lead, k // group, n)) < .5, -1, 1)
         * 0.05 / np.sqrt(k)).astype(np.float16)
    return ql.pack(q, s, bits, group)


def stacked_with_poison(rng, shape, bits, group, layer):
    """A [L, *shape] QuantizedWeight whose layers other than `layer` have NaN scales, and layer's own weight."""
    ws = [packed(rng, shape, bits, group) for _ in range(L)]
    own = jax.tree.map(jnp.asarray, ws[layer])
    scales = np.stack([w.scales if i == layer else np.full_like(w.scales, np.nan) for i, w in enumerate(ws)])
    stack = ql.QuantizedWeight(planes=tuple(jnp.asarray(np.stack([w.planes[p] for w in ws]))
                                            for p in range(len(ws[0].planes))),
                               scales=jnp.asarray(scales), bits=bits, group_size=group, k=shape[-2], n=shape[-1])
    return LayerSlice(stack, layer), own


def assert_same(got, want, seed):
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    assert np.isfinite(got).all(), f"NaN: another layer's bytes were read, seed={seed}"
    np.testing.assert_array_equal(got, want, err_msg=f"seed={seed}")


@pytest.mark.parametrize("bits,group", [(4, 128), (6, 64), (8, 64)])
@pytest.mark.parametrize("layer", [0, 2])
def test_dense_kernels_read_only_their_layer(bits, group, layer):
    rng, seed = fresh_rng()
    view, own = stacked_with_poison(rng, (256, 128), bits, group, layer)
    for m in (1, 2):
        x = jnp.asarray(rng.standard_normal((m, 256)) + 0.1, jnp.bfloat16)
        assert_same(quant_matmul_gemv(x, view, interpret=True), quant_matmul_gemv(x, own, interpret=True), seed)
    for m in (3, 16):
        x = jnp.asarray(rng.standard_normal((m, 256)) + 0.1, jnp.bfloat16)
        assert_same(quant_matmul_pallas(x, view, interpret=True), quant_matmul_pallas(x, own, interpret=True), seed)
    x = jnp.asarray(rng.standard_normal((64, 256)) + 0.1, jnp.bfloat16)  # dequant + XLA dot path, and reference
    assert_same(quant_matmul(x, view, impl="interpret"), quant_matmul(x, own, impl="interpret"), seed)
    assert_same(quant_matmul(x, view, impl="reference"), quant_matmul_reference(x, own), seed)


@pytest.mark.parametrize("path", ["gemv", "tiles"])
def test_moe_kernels_read_only_their_layer(path):
    rng, seed = fresh_rng()
    E, H, I, layer = 8, 256, 128, 1
    gu, gu_own = stacked_with_poison(rng, (E, H, 2 * I), 4, 128, layer)
    down, down_own = stacked_with_poison(rng, (E, I, H), 4, 128, layer)
    m, k = (2, 3) if path == "gemv" else (16, 2)
    x = jnp.asarray(rng.standard_normal((m, H)) + 0.1, jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(m)]), jnp.int32)
    ids = ids.at[0, 0].set(E - 1)  # the last expert of the layer: its neighbour in the stack is poisoned
    wts = jnp.asarray(rng.uniform(0.1, 1.0, (m, k)), jnp.float32)
    config = MoEGemvConfig() if path == "gemv" else None
    got = routed_experts(x, ids, wts, gu, down, impl="interpret", path=path, config=config)
    want = routed_experts(x, ids, wts, gu_own, down_own, impl="interpret", path=path, config=config)
    assert_same(got, want, seed)
    ref = routed_experts(x, ids, wts, gu, down, impl="reference")
    assert_same(ref, routed_experts(x, ids, wts, gu_own, down_own, impl="reference"), seed)
    with pytest.raises(ValueError, match="same layer"):
        routed_experts(x, ids, wts, gu, LayerSlice(down.stack, 0), impl="interpret", path=path)


def test_stack_groups_alike_layers_and_gives_each_layer_back():
    rng, _ = fresh_rng()

    def layer(kind):
        tree = {"norm": jnp.asarray(rng.standard_normal(8), jnp.bfloat16),
                "proj": jax.tree.map(jnp.asarray, packed(rng, (128, 32), 4, 64))}
        if kind == "b":
            tree["extra"] = jnp.asarray(rng.standard_normal((2, 4)), jnp.float32)
        return tree
    layers = [layer(k) for k in "aabab"]
    stack = stack_layers(layers)
    assert len(stack) == 5 and len(stack.groups) == 2 and stack.where == ((0, 0), (0, 1), (1, 0), (0, 2), (1, 1))
    assert len(jax.tree.leaves(stack)) == 3 + 4  # (norm, plane, scales) + extra in group b: per group, not layer
    for i, want in enumerate(layers):
        got = stack[i]
        assert layer_signature({**got, "proj": got["proj"].get()}) == layer_signature(want)
        np.testing.assert_array_equal(np.asarray(got["norm"]), np.asarray(want["norm"]))
        np.testing.assert_array_equal(np.asarray(got["proj"].get().planes[0]), np.asarray(want["proj"].planes[0]))
    # a pytree: through jit, per-layer views built from traced stacks
    f = jax.jit(lambda s: [lp["norm"].astype(jnp.float32) * 2 for lp in s])
    for got, want in zip(f(stack), layers):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want["norm"], np.float32) * 2)
    assert stack_layers(stack) is stack


def test_free_sources_deletes_only_the_per_layer_arrays():
    layers = [{"w": jnp.full((4,), float(i))} for i in range(3)]
    keep = [lp["w"] for lp in layers]
    stack = stack_layers(layers, free_sources=True)
    assert all(a.is_deleted() for a in keep)
    np.testing.assert_array_equal(np.asarray(stack[2]["w"]), np.full((4,), 2.0))


def test_free_sources_releases_host_arrays_as_it_stacks(monkeypatch):
    """Host (numpy) sources cannot be deleted; stacking drops every reference it holds to them as it goes, so that
    the loader's peak host memory is the model plus one stacked leaf (the caller's list is emptied)."""
    import gc
    import weakref

    class Tracked(np.ndarray):  # numpy arrays take no weak references; a subclass does
        pass
    layers = [{"a": np.full((4,), float(i)).view(Tracked), "b": np.full((2,), float(i)).view(Tracked)}
              for i in range(3)]
    refs = [weakref.ref(lp["a"]) for lp in layers]
    seen = []
    real_stack = np.stack

    def spy(xs, *args, **kw):  # when leaf "b" is stacked, leaf "a"'s sources must be gone already
        gc.collect()
        seen.append([r() is None for r in refs])
        return real_stack(xs, *args, **kw)
    monkeypatch.setattr(np, "stack", spy)
    stack = stack_layers(layers, free_sources=True)
    assert layers == [None, None, None] and seen[1] == [True, True, True]
    np.testing.assert_array_equal(np.asarray(stack[2]["b"]), np.full((2,), 2.0))


def test_load_builds_on_the_host():
    """load() builds and stacks on the host: by default the stacks end on jax's device, with "host" they stay
    numpy arrays (for a pipeline to place per stage), and the two give the same weights."""
    on_device = api.load(dtype="float32")
    on_host = api.load(dtype="float32", device="host")
    dev, host = jax.tree.leaves(on_device.params), jax.tree.leaves(on_host.params)
    assert all(isinstance(x, jax.Array) for x in dev) and all(isinstance(x, np.ndarray) for x in host)
    assert len(dev) == len(host) and all(np.array_equal(np.asarray(a), b) for a, b in zip(dev, host))
    with pytest.raises(ValueError, match="host"):
        api.load(dtype="float32", device="gpu")


@pytest.mark.parametrize("mode", ["reference", "interpret"])
def test_forward_with_stacked_params_equals_per_layer_params(monkeypatch, mode):
    """The tiny quantized model (int4 / int6 / int8 weights, MoE) in bf16: stacked == per-layer, bit for bit."""
    monkeypatch.setenv("FLASHNEXT_KERNELS", mode)
    with open(decode_step.DEMO_CONFIG) as f:  # the embedded demo model's config (tiny_config has K = 8 weights)
        cfg = from_hf_config(json.load(f))
    params, _, _ = decode_step.build(cfg, jax.random.key(5), stack=False)  # INT4-Mixed, as the benchmark runs it
    stacked = api.Model(cfg, params, None, jnp.bfloat16).params
    assert isinstance(stacked["layers"], LayerStack) and isinstance(params["layers"], list)
    assert len(jax.tree.leaves(stacked)) < len(jax.tree.leaves(params))
    rng = np.random.default_rng(0)
    t = 4
    batch = Batch(tokens=jnp.asarray(rng.integers(0, cfg.vocab_size, (2, t)), jnp.int32),
                  start=jnp.zeros((2,), jnp.int32), n_valid=jnp.asarray([t, 2], jnp.int32),
                  ple_rows=jnp.asarray(rng.standard_normal((len(cfg.ple_layers), 2, t, cfg.ple_embed_dim or 1)) * .02,
                                       jnp.bfloat16))
    # jitted, as the engine runs it (eagerly, the op-by-op dispatch compiled ~1,400 small programs: ~1 min); a new
    # function per call, so each mode traces its own kernels (jit's cache is keyed by the function)
    step = jax.jit(lambda p, b, s: forward(p, cfg, b, s))
    outs = [step(p, batch, init_state(cfg, 2, 16, jnp.bfloat16))[0] for p in (params, stacked)]
    assert np.isfinite(np.asarray(outs[0])).all()
    np.testing.assert_array_equal(np.asarray(outs[1]), np.asarray(outs[0]))
