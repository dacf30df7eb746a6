"""A step's peak temporaries do not grow with the context (issue 14, items 1 and 2), from XLA's memory analysis.

The engine's real step (RealRunner.step on the demo model, budget 16) is compiled for one 64-token chunk against
page tables of 2K and 16K tokens; only shapes are given (`lower` on ShapeDtypeStructs), nothing is allocated. The
dense per-row oracle (paged_qsa=False) is compiled too: its temporaries grow with L, so the measurement can see it.
"""

import jax
import jax.numpy as jnp
import pytest

import flashnext_jax as fj
from flashnext_jax.model_runner import Batch
from flashnext_jax.runner import RealRunner
from flashnext_jax.state_store import StoreDims, init_store

PAGE, CHUNK = 16, 64


@pytest.fixture(scope="module")
def model():
    return fj.load(dtype="float32")


def step_temp_bytes(runner, context: int, tokens: int = CHUNK) -> int:
    width = context // PAGE
    dims = StoreDims(num_slots=2, num_pages=width + 1, page_size=PAGE, num_snaps=1, num_columns=runner.k + 1)
    store = jax.eval_shape(lambda: init_store(runner.store_spec(), dims))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    host = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in runner.host_prepare([None], tokens).items()}
    batch = Batch(slot=i32(1), gen=i32(1), tokens=i32(1, tokens), n_valid=i32(1), start=i32(1),
                  page_table=i32(1, width), host=host)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), runner.params)
    compiled = jax.jit(runner.step, donate_argnums=(1,)).lower(params, store, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_chunk_temporaries_do_not_grow_with_context(model):
    paged = RealRunner(model, qsa_score_elements=CHUNK * model.cfg.indexer_n_heads * 64)  # 64 blocks per tile
    small, large = step_temp_bytes(paged, 2048), step_temp_bytes(paged, 16384)
    assert large <= small * 1.05 + 4096, (small, large)

    dense = RealRunner(model, paged_qsa=False)
    d_small, d_large = step_temp_bytes(dense, 2048), step_temp_bytes(dense, 16384)
    assert d_large > 4 * d_small, (d_small, d_large)  # the oracle's C x L scores and per-row copies do grow
    assert large < d_large / 4


def test_mtp_decode_temporaries_do_not_grow_with_the_width(model):
    """An MTP engine's decode step (k = 3: 4 tokens, 4 tail columns drafting 3 tokens each) at page tables of 2K
    and 16K tokens (scored in tiles of 64 blocks here, so the main layers' one-pass scoring does not grow either):
    the paged MTP layer adds nothing that grows with the width; its dense oracle (paged_mtp=False), which copies
    the whole width per row and per column, grows."""
    k, tile = 3, 4 * model.cfg.indexer_n_heads * 64
    paged = RealRunner(model, k, qsa_score_elements=tile)
    small, large = step_temp_bytes(paged, 2048, k + 1), step_temp_bytes(paged, 16384, k + 1)
    assert large <= small * 1.05 + 4096, (small, large)

    dense = RealRunner(model, k, qsa_score_elements=tile, paged_mtp=False)
    d_small, d_large = step_temp_bytes(dense, 2048, k + 1), step_temp_bytes(dense, 16384, k + 1)
    assert d_large > 4 * d_small, (d_small, d_large)
    assert large < d_large / 4
