"""QSA K/V host offload (issue 14 item 6, qsa_offload.py): the K/V pages in pinned host memory give the tokens and
the fp32 logits of the on-device path, and the device holds only what a step fetches.

Budget 16, ratio 4 (tiny configs): selection binds from the 20th token on. A prefill chunk fetches its rows'
pages, a decode step the chosen blocks themselves (qsa_offload.fetches_blocks); both are compared.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_qsa_paged import CFG, LAYER, N_QSA, PARAMS, dense, paged_step  # noqa: F401 - the on-device harness

import flashnext_jax as fj
from flashnext_jax import qsa_offload
from flashnext_jax.engine import Engine, EngineConfig
from flashnext_jax.model_runner import Batch
from flashnext_jax.qsa_paged import PagedKV, qsa_paged_forward
from flashnext_jax.runner import RealRunner
from flashnext_jax.state_store import StoreDims, init_store, store_shardings
from test_long_context import FIXTURES

HOST = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")


@jax.jit
def offload_step(kp, vp, ip, bp, page_table, u, positions, valid):
    kv = PagedKV(kp, vp, ip, bp, page_table, valid, LAYER, 1 << 24, offload=True)
    y, kv = qsa_paged_forward(PARAMS, CFG, u, positions, valid, kv)
    return y, kv.k, kv.v, kv.index, kv.block_keys


def test_layer_offloaded_equals_on_device_in_both_fetch_modes():
    """Two rows (310 and 190 tokens, pages of 16 scattered over the pool) fed in chunks of 64 (rows' pages
    fetched) then 3 and 1 (blocks fetched): every output and every pool entry equal the on-device path's, fp32
    <= 1e-5 (two separately compiled layer programs project K and the output ~1 ulp apart: XLA fuses them
    differently; the engine's whole steps below are compared exactly), unwritten entries poisoned alike."""
    page, lengths, b = 16, (310, 190), 2
    u = jax.random.normal(jax.random.key(0), (b, 320, CFG.hidden_size), jnp.float32)
    per_row = 20
    ids = np.random.default_rng(0).permutation(b * per_row + 3)[: b * per_row].reshape(b, per_row)
    table = jnp.asarray(np.concatenate([ids, np.full((b, 12), -1)], 1).astype(np.int32))  # width 32
    nan = lambda rows, *s: jnp.full((b * per_row + 4, rows, N_QSA, *s), jnp.nan, jnp.float32)  # noqa: E731
    kvs = (CFG.num_key_value_heads, CFG.head_dim)
    dev = [nan(page, *kvs), nan(page, *kvs), nan(page, 16), nan(page // 4, 16)]
    off = [jax.device_put(dev[0], HOST), jax.device_put(dev[1], HOST), dev[2], dev[3]]
    modes = set()
    start = 0
    for c in [64] * 4 + [3] * 6 + [1] * 40:
        pos = start + jnp.arange(c)[None, :].repeat(b, 0)
        valid = pos < jnp.asarray(lengths)[:, None]
        piece = jnp.stack([u[r, jnp.minimum(pos[r], 319)] for r in range(b)])
        modes.add(qsa_offload.fetches_blocks(b, c, CFG.block_topk + 1, 4, table.shape[1], page))
        y_dev, *dev = paged_step(PARAMS, CFG, *dev, table, piece, pos, valid, LAYER, 1 << 24, 128)
        y_off, *off = offload_step(*off, table, piece, pos, valid)
        np.testing.assert_allclose(np.asarray(y_off), np.asarray(y_dev), rtol=1e-5, atol=1e-5,
                                   err_msg=f"chunk at {start}")
        start += c
    assert modes == {True, False}
    assert off[0].sharding.memory_kind == off[1].sharding.memory_kind == "pinned_host"
    for a, b_ in zip(off, dev):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-5, atol=1e-6)  # NaN (poison) alike


def test_fetch_is_one_host_gather_that_reads_as_dynamic_slices():
    """fetch's windows equal a dynamic_slice each (the scan it replaced), out-of-range starts included (negative
    from the end, then clamped), for block-sized and page-sized windows; the jitted program gathers on the host
    once (compute_on) and holds no while loop of slices."""
    pool = jax.device_put(jax.random.normal(jax.random.key(1), (9, 16, 3, 2, 8), jnp.float32), HOST)
    rng = np.random.default_rng(1)
    for shape, rows, layer in [((2, 3, 5), 4, 1), ((3, 2), 16, 2), ((7,), 4, 0)]:
        page = jnp.asarray(rng.integers(-12, 12, shape), jnp.int32)
        row = jnp.asarray(rng.integers(-20, 20, shape), jnp.int32)
        f = jax.jit(qsa_offload.fetch, static_argnums=(1, 4))
        got = f(pool, layer, page, row, rows)
        assert got.shape == (*shape, rows, 2, 8) and got.sharding.memory_kind == "device"
        want = np.stack([np.asarray(jax.lax.dynamic_slice(pool, (p, r, layer, 0, 0), (1, rows, 1, 2, 8)))[0, :, 0]
                         for p, r in zip(page.reshape(-1).tolist(), row.reshape(-1).tolist())])
        np.testing.assert_array_equal(np.asarray(got), want.reshape(got.shape))
        text = f.lower(pool, layer, page, row, rows).as_text()
        assert text.count("call @compute_on") == text.count('"stablehlo.gather"') == 1
        assert "stablehlo.while" not in text


@pytest.fixture(scope="module")
def tiny():
    return fj.load(FIXTURES / "tiny_causal", dtype="float32")


def generate(model, offload: bool):
    """Two concurrent requests (a 300-token prompt, selection binding, beside a 70-token one) in 64-token chunks,
    then 12 greedy tokens each with logprobs and prompt logprobs."""
    lm = fj.LLM(RealRunner(model), max_model_len=512, page_size=16, max_num_seqs=2, max_num_batched_tokens=64,
                qsa_kv_offload=offload)
    prompts = [[(7 * i + 3) % 250 + 1 for i in range(300)], [(5 * i + 11) % 250 + 1 for i in range(70)]]
    params = fj.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    return lm, lm.generate(prompts, params)


def test_engine_offloaded_equals_on_device_token_for_token_and_in_logprobs(tiny):
    lm, outs = generate(tiny, True)
    _, ref = generate(tiny, False)
    store = lm.engine.ledger.store
    assert {n: a.sharding.memory_kind for n, a in store.page.items() if n in ("qsa_k", "qsa_v")} == {
        "qsa_k": "pinned_host", "qsa_v": "pinned_host"}
    assert all(a.sharding.memory_kind == "device" for n, a in store.page.items() if n not in ("qsa_k", "qsa_v"))
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids
        assert [(t.token_id, t.logprob, t.top) for t in o.logprobs] == [(t.token_id, t.logprob, t.top)
                                                                         for t in r.logprobs]
        assert o.prompt_logprobs == r.prompt_logprobs


def decode_temp_bytes(runner, num_pages: int) -> int:
    """XLA's temporaries of the engine's decode step (B = 1) over a store of `num_pages` pages, from shapes."""
    dims = StoreDims(num_slots=2, num_pages=num_pages, page_size=16, num_snaps=1, num_columns=1)
    spec = runner.store_spec()
    where = store_shardings(spec, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    space = lambda s: jax.memory.Space.Host if s.memory_kind == "pinned_host" else jax.memory.Space.Device  # noqa: E731
    store = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s, _memory_space=space(s)),
                         jax.eval_shape(lambda: init_store(spec, dims)), where)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    host = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in runner.host_prepare([None], 1).items()}
    batch = Batch(slot=i32(1), gen=i32(1), tokens=i32(1, 1), n_valid=i32(1), start=i32(1), page_table=i32(1, 32),
                  host=host)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), runner.params)
    compiled = jax.jit(runner.step, donate_argnums=(1,)).lower(params, store, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_device_holds_the_indexer_keys_and_what_a_step_fetches(tiny):
    """The K/V leaves are the host's; a decode step's temporaries do not grow with the (host) pool: nothing copies
    it to the device."""
    runner = RealRunner(tiny).with_qsa_kv_offload()
    kinds = {n: leaf.memory_kind for n, leaf in runner.store_spec().page.items()}
    assert kinds == {"qsa_k": "pinned_host", "qsa_v": "pinned_host", "qsa_index": "device",
                     "qsa_block_keys": "device"}
    small, large = decode_temp_bytes(runner, 64), decode_temp_bytes(runner, 4096)
    pool_growth = (4096 - 64) * 16 * np.prod(runner.store_spec().page["qsa_k"].shape) * 4
    assert large - small < pool_growth / 100, (small, large)


def test_offload_needs_the_paged_path_and_a_real_runner(tiny):
    with pytest.raises(ValueError, match="paged QSA path"):
        RealRunner(tiny, paged_qsa=False).with_qsa_kv_offload()
    with pytest.raises(ValueError, match="cannot keep QSA K/V pages in host memory"):
        Engine(fj.LLM("toy").runner, EngineConfig(max_num_seqs=1, qsa_kv_offload=True))
