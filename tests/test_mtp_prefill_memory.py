"""An MTP engine's prefill step holds no per-token temporaries of the MTP head: it can take 8,192-token chunks.

The release head's routed experts are BF16 and go through `moe.routed_experts_reference`, which gathers each
token's 10 experts (~98 MB per token at the real size): were that computed for a prefill chunk it would need
~0.1 TB per 1,024 tokens. In a prefill step the head only folds the chunk's pairs into its cache (K, V and index
keys, projections of each pair's input), so its attention, MoE and draft logits past the chunk's tail are dead
code and XLA drops them. Checked at the real dimensions (4 layers, all 512 experts, the BF16 head) from XLA's
memory analysis on shapes only (nothing is allocated): the k = 1 step's temporaries equal the k = 0 step's.
"""

import json

import jax
import jax.numpy as jnp
import pytest

from bench import decode_step
from bench.engine_step import RandomPleRunner
from flashnext_jax import api
from flashnext_jax.config import from_hf_config
from flashnext_jax.model_runner import Batch
from flashnext_jax.moe import routed_experts_reference
from flashnext_jax.state_store import StoreDims, init_store

CHUNK, CONTEXT, PAGE = 1024, 8192, 64
GiB = 2**30


@pytest.fixture(scope="module")
def real_model():
    with open(decode_step.REAL_CONFIG) as f:
        cfg = decode_step.cut_config(from_hf_config(json.load(f)), 4, 512)
    params = jax.eval_shape(lambda: decode_step.build(cfg, jax.random.key(0), stack=False, with_mtp=True)[0])
    model = api.Model.__new__(api.Model)  # shapes only: the fields a runner reads
    model.cfg, model.params, model.dtype, model.hasher, model.has_mtp, model.vision = \
        cfg, params, jnp.bfloat16, None, True, None
    return model


def prefill_temp_bytes(model, k: int) -> int:
    runner = RandomPleRunner(model, k)
    width = CONTEXT // PAGE
    dims = StoreDims(num_slots=2, num_pages=width + 1, page_size=PAGE, num_snaps=1, num_columns=1 + k)
    store = jax.eval_shape(lambda: init_store(runner.store_spec(), dims))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    host = {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in runner.host_prepare([None], CHUNK).items()}
    batch = Batch(slot=i32(1), gen=i32(1), tokens=i32(1, CHUNK), n_valid=i32(1), start=i32(1),
                  page_table=i32(1, width), host=host)
    compiled = jax.jit(runner.step, donate_argnums=(1,)).lower(model.params, store, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_mtp_head_adds_no_prefill_temporaries(real_model):
    plain, mtp = prefill_temp_bytes(real_model, 0), prefill_temp_bytes(real_model, 1)
    assert abs(mtp - plain) < 1 * GiB, (plain / GiB, mtp / GiB)

    # the check can see the gather: the head's MoE made live over the chunk needs ~0.1 TB
    experts = real_model.params["mtp"]["layers"][0]["mlp"]["experts"]
    cfg = real_model.cfg
    x = jax.ShapeDtypeStruct((CHUNK, cfg.hidden_size), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((CHUNK, cfg.num_experts_per_tok), jnp.int32)
    w = jax.ShapeDtypeStruct((CHUNK, cfg.num_experts_per_tok), jnp.bfloat16)
    live = jax.jit(routed_experts_reference).lower(x, ids, w, experts["gate_up_proj"], experts["down_proj"])
    assert live.compile().memory_analysis().temp_size_in_bytes > 50 * GiB
