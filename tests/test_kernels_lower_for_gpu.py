"""The Pallas kernels of the engine's GPU step lower for CUDA (Pallas -> Triton IR) on this CPU machine.

Interpret mode, which the other kernel tests run, executes a kernel's jaxpr with XLA's CPU ops and accepts
things the Triton lowering does not (stop 43: the QSA split combine sliced a loaded value, `m[i]`, which passed
every interpret test and failed on the H200 with "Unimplemented primitive in Pallas Triton lowering: slice",
costing a scarce device run). Lowering each kernel for CUDA here, as `tools/sass_offline.py` does, catches that
class of failure before a GPU run: one TTIR module per pallas_call, or the lowering's own error. The last test
lowers whole engine steps at the real config (types only, seconds); with the slice form it fails in the
batch-invariant trace, which is the one that takes the split kernels."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashnext_jax import gdn  # noqa: E402
from pallas_kernels import fixed_order, qsa_sparse  # noqa: E402
from pallas_kernels.moe_matmul import routed_experts_gemv_fixed  # noqa: E402
from pallas_kernels.quant_gemv import quant_matmul_gemv_fixed  # noqa: E402
from pallas_kernels.quant_layout import PLANE_FORMATS, LayerSlice, QuantizedWeight  # noqa: E402
from tools.sass_offline import ttir_of  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


@pytest.mark.parametrize("t,kv_splits", [(1, 1), (1, 8), (64, 8)])
def test_qsa_sparse_attention_lowers(t, kv_splits):
    b, kv, g, hd, j = 2, 2, 12, 256, 513  # the real head layout and block list (512 blocks + the tail)
    q = jnp.zeros((b, t, kv, g, hd), jnp.bfloat16)
    pool = jnp.zeros((9, 64, 3, kv, hd), jnp.bfloat16)
    blocks = jnp.zeros((b, t, j), jnp.int32)
    modules = ttir_of(lambda q, k, v, p, o, n: qsa_sparse.sparse_attention_pallas(
        q, k, v, p, o, n, layer=1, ratio=4, kv_splits=kv_splits), q, pool, pool, blocks, blocks, blocks)
    assert len(modules) == (1 if kv_splits == 1 else 2) and all("tt.func" in m for m in modules)


def test_qsa_indexer_scores_lowers():
    q = jnp.zeros((1, 64, 4, 128), jnp.bfloat16)
    keys = jnp.zeros((1, 512, 128), jnp.bfloat16)
    n_complete = jnp.zeros((1, 64), jnp.int32)
    assert len(ttir_of(lambda q, k, n: qsa_sparse.indexer_scores_pallas(q, k, n, 0), q, keys, n_complete)) == 1


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("t", [1, 130])
def test_gdn_in_store_kernels_lower(invariant, t):
    """The in-store GDN path as a step runs it (the absolute-chunk rule in batch-invariant traces: chunked kernel,
    recurrent kernel over a per-row length, the fixed decode layout)."""
    b, hk, hv, d, k1 = 2, 4, 8, 128, 2
    q = k = jnp.zeros((b, t, hk, d), jnp.bfloat16)
    v = jnp.zeros((b, t, hv, d), jnp.bfloat16)
    g = beta = jnp.zeros((b, t, hv), jnp.float32)
    leaf = jnp.zeros((5, k1, 1, hv, d, d), jnp.float32)
    start, n_valid = jnp.asarray([0, 70], jnp.int32), jnp.asarray([t, max(t - 5, 1)], jnp.int32)

    def run(q, k, v, g, beta, leaf):
        base = jnp.maximum(n_valid - k1, 0)
        ends = base[:, None] + 1 + jnp.arange(k1)[None, :]
        rec = gdn.StoreRecState(leaf, jnp.asarray([0, 3], jnp.int32), jnp.zeros((b,), jnp.int32), 0)
        with fixed_order.batch_invariant(invariant):
            out, rec = gdn.delta_rule_in_store(q, k, v, g, beta, rec, ends, impl="pallas", start=start,
                                               n_valid=n_valid)
        return out, rec.leaf

    modules = ttir_of(run, q, k, v, g, beta, leaf)
    assert modules and all("tt.func" in m for m in modules)


@pytest.mark.parametrize("batch_invariant,variant", [(True, "plain"), (False, "plain"), (True, "mtp"),
                                                     (True, "qsa_kv_offload")])
def test_engine_step_lowers_at_the_real_config(monkeypatch, batch_invariant, variant):
    """The whole engine step, as a GPU run compiles it: the real config cut to 4 layers (GDN, PLE and QSA layers)
    and 32 experts with INT4-Mixed weights (and the BF16 MTP head for "mtp": k = 2 drafts, its QSA layer on its
    pages, mtp_paged.py), lowered for CUDA with the Pallas kernels selected as on a GPU, at every startup shape
    (decode B = 1, 2 and a prefill chunk). The params are
    types only (jax.eval_shape): no weight is drawn, so this costs seconds, and a kernel or a kernel choice that
    cannot lower fails here rather than in a device run's compile. (Lowering stops before XLA's own GPU passes:
    the host-offload copies of "qsa_kv_offload" are checked only as far as StableHLO.)"""
    import json

    import jax
    from bench import decode_step
    from bench.engine_step import RandomPleRunner
    from flashnext_jax import api, qsa_offload
    from flashnext_jax.config import from_hf_config
    from flashnext_jax.llm import LLM

    monkeypatch.setenv("FLASHNEXT_KERNELS", "pallas")  # the GPU's kernel choices, made on this CPU
    jax.clear_caches()
    with open(decode_step.REAL_CONFIG) as f:
        cfg = decode_step.cut_config(from_hf_config(json.load(f)), 4, 32)
    assert len(set(cfg.layer_types)) == 2 and cfg.ple_layers  # GDN and QSA layers, and the PLE
    mtp = variant == "mtp"
    model = api.Model(cfg, decode_step.abstract_params(cfg, with_mtp=mtp), table=None, dtype=jnp.bfloat16)
    k = 2 if mtp else 0
    extra = {"mtp": dict(speculative_config={"method": "mtp", "num_speculative_tokens": k}),
             "qsa_kv_offload": dict(qsa_kv_offload=True)}.get(variant, {})
    # the offload's page table is wide enough that its decode steps fetch their chosen blocks (one host gather per
    # pool, qsa_offload.fetch) while its prefill chunks read their rows' pages: at 1,024 tokens (16 pages) a decode
    # step's 513 blocks of 4 rows would hold more rows than the table and it would read pages too
    offload = variant == "qsa_kv_offload"
    max_len = 4096 if offload else 1024
    assert not offload or qsa_offload.fetches_blocks(1, 1, cfg.block_topk + 1, cfg.indexer_compress_ratio,
                                                     max_len // 64, 64)
    lm = LLM(RandomPleRunner(model, k), max_num_seqs=2, max_num_batched_tokens=256, max_model_len=max_len,
             page_size=64, block_size=64, num_pages=40, num_snapshots=2, enable_prefix_caching=False,
             prefill_buckets=(256,), page_table_width="auto", compile_ahead=False, batch_invariant=batch_invariant,
             **extra)
    eng = lm.engine
    assert eng.one_width and ("mtp_block_keys" in eng.ledger.store.page) == mtp  # the paged MTP layer: one width
    keys = eng.startup_shapes()
    assert {key.tokens for key in keys} == {4 if mtp else 1, 256}
    try:
        for key in keys:
            with fixed_order.batch_invariant(batch_invariant):
                modules = ttir_of(eng._steps._run, *eng._abstract_args(key))
            assert len(modules) > 10, key.describe()  # the step's pallas_calls: GDN, QSA, quant, MoE kernels
    finally:
        jax.clear_caches()


def abstract_weight(k, n, bits, group, lead=()):
    """A QuantizedWeight [*lead, K, N] of types only (ShapeDtypeStruct leaves, quant_layout's plane shapes)."""
    planes = tuple(jax.ShapeDtypeStruct((*lead, k * width // 8, n), jnp.int8 if bits == 8 else jnp.uint8)
                   for width, _ in PLANE_FORMATS[bits])
    scales = jax.ShapeDtypeStruct((*lead, k // group, n), jnp.bfloat16)
    return QuantizedWeight(planes, scales, bits=bits, group_size=group, k=k, n=n)


@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("k,n,bits,group,stacked", [(10240, 320, 8, 64, False), (2560, 16384, 6, 64, False),
                                                    (2560, 1280, 4, 128, True)])
def test_fixed_gemv_lowers(m, k, n, bits, group, stacked):
    """quant_matmul_gemv_fixed (token tiles of 1 or 2 rows, inline-PTX fields, load barriers) at real shapes; a
    LayerSlice of weights stacked over layers reads its layer in place."""
    w = abstract_weight(k, n, bits, group, lead=(4,) if stacked else ())
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    modules = ttir_of(lambda x, w: quant_matmul_gemv_fixed(x, LayerSlice(w, 2) if stacked else w), x, w)
    assert len(modules) == 1 and "tt.func" in modules[0] and "elementwise_inline_asm" in modules[0]


@pytest.mark.parametrize("m", [1, 3])
def test_fixed_moe_gemv_lowers(m):
    """routed_experts_gemv_fixed at the real MoE shapes (32 experts, H 2560, I 640, int4 g128, top-10)."""
    e, h, inter, k = 32, 2560, 640, 10
    w_gate_up, w_down = abstract_weight(h, 2 * inter, 4, 128, (e,)), abstract_weight(inter, h, 4, 128, (e,))
    args = (jax.ShapeDtypeStruct((m, h), jnp.bfloat16), jax.ShapeDtypeStruct((m, k), jnp.int32),
            jax.ShapeDtypeStruct((m, k), jnp.float32), w_gate_up, w_down)
    modules = ttir_of(routed_experts_gemv_fixed, *args)
    assert len(modules) == 2 and all("tt.func" in mod and "elementwise_inline_asm" in mod for mod in modules)
