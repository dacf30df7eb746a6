"""The engine with the GDN kernels updating the store in place (interpret mode on CPU).

On the kernel path `RealRunner.step` never gathers the recurrent state: the Pallas kernels read each row's committed
column and write its checkpoint columns straight into the store leaf, by slot id, for one GDN layer at a time
(`gdn.StoreRecState`, `gdn_layout.flat_state(layer=)`). Oracle: `Model.generate` run solo under the same switch,
which takes the kernels' other entry points on a dense per-request state (no store, no slots, no layer stride).
"""

import jax
import numpy as np
import pytest

import flashnext_jax as fj
from flashnext_jax import gdn
from flashnext_jax.runner import RealRunner

PROMPTS = [[5, 77, 301, 12, 9, 140, 33], [400, 2, 2, 81], [17] * 11]
GREEDY = fj.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def interpret_kernels(monkeypatch):
    """FLASHNEXT_KERNELS=interpret for this test only; jit caches cleared on both sides, since the switch is read
    at trace time and module-level jits would otherwise reuse traces of the other mode."""
    monkeypatch.setenv("FLASHNEXT_KERNELS", "interpret")
    jax.clear_caches()
    yield
    monkeypatch.delenv("FLASHNEXT_KERNELS")
    jax.clear_caches()


# k = 1 (MTP) writes the checkpoint columns as well as the committed one; k = 0 only the latter (slow: ~3 min)
@pytest.mark.parametrize("k", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_in_place_gdn_state_equals_solo(interpret_kernels, monkeypatch, k):
    calls = []
    real = gdn.delta_rule_in_store
    monkeypatch.setattr(gdn, "delta_rule_in_store", lambda *a, **kw: calls.append(a[5].layer) or real(*a, **kw))
    model = fj.load(dtype="float32")
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    lm = fj.LLM(RealRunner(model, k), speculative_config=spec, max_model_len=32, page_size=8, max_num_seqs=2,
                max_num_batched_tokens=5, min_batch_bucket=2, min_token_bucket=4, min_pool_capacity=(3, 16, 16))
    outs = lm.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == model.generate(p, GREEDY.max_tokens), o.request_id
    n_gdn = len(model.cfg.gdn_layers)
    assert sorted(set(calls)) == list(range(n_gdn)), "every GDN layer must take the in-place path"
    store = lm.engine.ledger.store
    for s in list(lm.engine.ledger.free_slots) + [store.num_slots]:  # freed and null slots stay poisoned
        assert np.all(np.isnan(np.asarray(store.slot["gdn_rec"][s])))
