"""The engine's in-store GDN path (`gdn.delta_rule_in_store`, Pallas kernels in interpret mode) in a batch-invariant
trace: a token's output and the states it leaves must not depend on how its prompt was cut into steps, on what else
the step holds, or on whether a decode token runs in a one-token step or inside a prefill-sized one. Bitwise, and
close to the token-by-token recurrence (gdn_reference.recurrent_gated_delta_rule).

Before the absolute-chunk rule the kernel path ran a step's last token through the recurrent kernel and every
other token through the chunked kernel: a prompt cut at token 128 sent token 127 through the recurrence, the
whole prompt sent it through the chunked form, and the two round differently (the H100 batch_invariance run of
stop 42: a request whose prompt was cut beside another differed from its first token)."""

import jax.numpy as jnp
import numpy as np
import pytest

from flashnext_jax import gdn
from pallas_kernels import fixed_order, gdn_reference

HK, HV, D = 2, 4, 32
SLOTS, K1 = 4, 1
L = 260  # tokens of the test sequences


def sequence(seed):
    """q, k, v, g, beta of one sequence of L tokens ([L, ...]; g < 0, 0 < beta < 1)."""
    r = np.random.default_rng(seed)
    q, k = (r.standard_normal((L, HK, D)).astype(np.float32) for _ in range(2))
    v = r.standard_normal((L, HV, D)).astype(np.float32)
    g = -r.uniform(0.01, 0.5, (L, HV)).astype(np.float32)
    beta = r.uniform(0.1, 0.9, (L, HV)).astype(np.float32)
    return q, k, v, g, beta


SEQ = [sequence(s) for s in range(3)]


def step(leaf, rows, t, read_col=0, invariant=True):
    """One engine-like call: rows = [(sequence index, first token, token count, slot)], each row right-padded to t
    tokens (identity padding, as gdn_forward makes it). Returns (out [B, t, HV, D] as numpy, leaf)."""
    b = len(rows)
    arrays = [np.zeros((b, t) + a.shape[1:], np.float32) for a in SEQ[0]]
    for i, (s, first, n, _) in enumerate(rows):
        for a, src in zip(arrays, SEQ[s]):
            a[i, :n] = src[first:first + n]
    start = jnp.asarray([first for _, first, _, _ in rows], jnp.int32)
    n_valid = jnp.asarray([n for _, _, n, _ in rows], jnp.int32)
    base = jnp.maximum(n_valid - K1, 0)
    ends = base[:, None] + 1 + jnp.arange(K1)[None, :]
    rec = gdn.StoreRecState(leaf, jnp.asarray([slot for *_, slot in rows], jnp.int32),
                            jnp.full((b,), read_col, jnp.int32), 0)
    with fixed_order.batch_invariant(invariant):
        out, rec = gdn.delta_rule_in_store(*(jnp.asarray(a) for a in arrays), rec, ends, impl="interpret",
                                           start=start, n_valid=n_valid)
    return np.asarray(out), rec.leaf


def fresh_leaf():
    return jnp.zeros((SLOTS + 1, K1, 1, HV, D, D), jnp.float32)


def state(leaf, slot):
    return np.asarray(leaf[slot, 0, 0])


def reference(s, n):
    """The recurrence over the first n tokens of sequence s: (out [n, HV, D], final state)."""
    q, k, v, g, beta = (jnp.asarray(a[:n])[None] for a in SEQ[s])
    o, final = gdn_reference.recurrent_gated_delta_rule(q, k, v, g, beta, scale=D ** -0.5, use_qk_l2norm=True)
    return np.asarray(o[0]), np.asarray(final[0])


@pytest.fixture(scope="module")
def whole():
    """Sequence 0's first 200 tokens in one step of 256 tokens: (out, state)."""
    out, leaf = step(fresh_leaf(), [(0, 0, 200, 1)], 256)
    return out[0, :200], state(leaf, 1)


def test_whole_prompt_matches_the_recurrence(whole):
    out, final = whole
    ref_out, ref_final = reference(0, 200)
    np.testing.assert_allclose(out, ref_out, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(final, ref_final, rtol=2e-4, atol=2e-4)


def test_prompt_cut_on_the_grid_gives_the_same_bits(whole):
    out, final = whole
    a, leaf = step(fresh_leaf(), [(0, 0, 128, 1)], 256)
    b, leaf = step(leaf, [(0, 128, 72, 1)], 256)
    assert a[0, :128].tobytes() == out[:128].tobytes()
    assert b[0, :72].tobytes() == out[128:].tobytes()
    assert state(leaf, 1).tobytes() == final.tobytes()


def test_a_neighbour_row_changes_nothing(whole):
    out, final = whole
    got, leaf = step(fresh_leaf(), [(1, 0, 150, 2), (0, 0, 200, 1)], 256)  # sequence 0 as the second row
    assert got[1, :200].tobytes() == out.tobytes()
    assert state(leaf, 1).tobytes() == final.tobytes()


def test_a_decode_token_alone_or_inside_a_prefill_step(whole):
    """Token 200 after the whole prompt: in a one-token step, and as a one-token row of a 256-token step beside
    another request's prefill (a mixed step)."""
    _, final = whole
    seeded = lambda: fresh_leaf().at[1, 0, 0].set(jnp.asarray(final))  # noqa: E731  (the kernels donate it)
    alone, leaf_a = step(seeded(), [(0, 200, 1, 1)], 1)
    mixed, leaf_b = step(seeded(), [(2, 0, 190, 3), (0, 200, 1, 1)], 256)
    assert alone[0, :1].tobytes() == mixed[1, :1].tobytes()
    assert state(leaf_a, 1).tobytes() == state(leaf_b, 1).tobytes()
    ref_out, ref_final = reference(0, 201)
    np.testing.assert_allclose(alone[0, 0], ref_out[200], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(state(leaf_a, 1), ref_final, rtol=2e-4, atol=2e-4)


def test_ragged_head_and_tail_match_the_recurrence():
    """A step starting off the grid (token 100: a ragged head of 28 before the whole chunk [128, 192), a tail of
    68 after it, more than one chunk) and a step holding no whole chunk across a boundary (tokens 40..139)."""
    a, leaf = step(fresh_leaf(), [(0, 0, 100, 1)], 256)
    b, leaf = step(leaf, [(0, 100, 160, 1)], 256)
    ref_out, ref_final = reference(0, 260)
    np.testing.assert_allclose(np.concatenate([a[0, :100], b[0, :160]]), ref_out, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(state(leaf, 1), ref_final, rtol=2e-4, atol=2e-4)
    a, leaf = step(fresh_leaf(), [(1, 0, 40, 2)], 64)
    b, leaf = step(leaf, [(1, 40, 100, 2)], 128)
    ref_out, ref_final = reference(1, 140)
    np.testing.assert_allclose(np.concatenate([a[0, :40], b[0, :100]]), ref_out, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(state(leaf, 2), ref_final, rtol=2e-4, atol=2e-4)


def test_the_old_rule_is_not_cut_invariant():
    """The control: outside the invariant mode the same cut changes the bits (else the tests above would prove
    nothing about the rule)."""
    whole, _ = step(fresh_leaf(), [(0, 0, 200, 1)], 256, invariant=False)
    a, leaf = step(fresh_leaf(), [(0, 0, 128, 1)], 256, invariant=False)
    b, leaf = step(leaf, [(0, 128, 72, 1)], 256, invariant=False)
    cut = np.concatenate([a[0, :128], b[0, :72]])
    np.testing.assert_allclose(cut, whole[0, :200], rtol=2e-4, atol=2e-4)
    assert cut.tobytes() != whole[0, :200].tobytes()
