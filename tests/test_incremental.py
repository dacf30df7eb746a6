"""Incremental decode (state carried between calls) equals one-shot prefill, in fp32."""

import jax.numpy as jnp
import numpy as np

import flashnext_jax
from flashnext_jax.api import _step
from flashnext_jax.model import init_state


def test_decode_steps_and_chunks_reproduce_prefill_logits():
    model = flashnext_jax.load(dtype="float32")  # the embedded demo model (QSA budget 16: sparse from 20 tokens)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.cfg.vocab_size, 70)
    ids[[9, 33, 34]] = model.cfg.eos_token_id
    full = model.logits(ids)
    scale = np.abs(full).max()
    state = init_state(model.cfg, 1, 128, jnp.float32)
    hasher, ctx, pos, errors = model.hasher, model.hasher.initial_context(), 0, []
    # a prefill chunk, single-token decodes, then a chunk whose end is off the 4-token block grid
    for n in [13, 1, 1, 1, 1, 23, 1, 1, 1, 27]:
        piece = ids[pos : pos + n]
        batch = model._batch(piece, pos, 32 if n > 1 else 1, ctx)
        logits, _, state = _step(model.params, model.cfg, batch, state, False)
        errors.append(np.abs(np.asarray(logits[0, :n]) - full[pos : pos + n]).max() / scale)
        ctx = hasher.next_context(ctx, piece)
        pos += n
    assert pos == len(ids)
    assert max(errors) <= 1e-5, errors
