"""The Pallas kernels of the engine's GPU step lower for CUDA (Pallas -> Triton IR) on this CPU machine.

Interpret mode, which the other kernel tests run, executes a kernel's jaxpr with XLA's CPU ops and accepts
things the Triton lowering does not (stop 43: the QSA split combine sliced a loaded value, `m[i]`, which passed
every interpret test and failed on the H200 with "Unimplemented primitive in Pallas Triton lowering: slice",
costing a scarce device run). Lowering each kernel for CUDA here, as `tools/sass_offline.py` does, catches that
class of failure before a GPU run: one TTIR module per pallas_call, or the lowering's own error."""

import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashnext_jax import gdn  # noqa: E402
from pallas_kernels import fixed_order, qsa_sparse  # noqa: E402
from tools.sass_offline import ttir_of  # noqa: E402


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
