"""Batch invariance in bf16 (issue 19): a row's values must not depend on the other rows of its batch.

Found on the demo model (CPU, bf16): the hyper-connection read's mean over the S streams, a reduction over an axis
of size 4, associated its four terms differently with the number of rows, so a request's first token logprob
moved by ~0.004 between a batch of 8 and its solo run. The mean is now explicit adds in stream order."""

import jax
import jax.numpy as jnp
import pytest

import flashnext_jax as fj
from flashnext_jax.hyper import hyper_read


@pytest.fixture(scope="module")
def model():
    return fj.load(dtype="bfloat16")


# both sides of each case take the same `linear` path (<= 8 rows: multiply + reduce; more: the dot); across that
# switch a row still changes (docs/batch-invariance.md)
@pytest.mark.parametrize("rows,tokens", [(8, 32), (8, 1), (4, 2)])
def test_hyper_read_row_does_not_depend_on_the_batch(model, rows, tokens):
    cfg = model.cfg
    p = list(model.params["layers"])[0]["attn_hyper_connection"]
    x = jax.random.normal(jax.random.key(rows), (rows, tokens, cfg.hc_count * cfg.hidden_size), jnp.bfloat16)
    read = jax.jit(lambda x: hyper_read(p, cfg, x))
    (u_all, g_all), (u_one, g_one) = read(x), read(x[:1])
    assert bool((u_all[:1] == u_one).all()) and bool((g_all[:1] == g_one).all())


# ------------------------------------------------------------------------------ the pieces


def test_tree_sum_row_does_not_depend_on_the_other_rows():
    """The PLE gate's sum over 64 features of bf16 products moved with the step's token count (T = 8 vs 16) as an
    XLA reduce; the fixed-order tree gives every row the same bits whatever the shape, and the right sum."""
    from pallas_kernels import fixed_order

    a = jax.random.normal(jax.random.key(0), (1, 64, 4, 64), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (1, 64, 4, 64), jnp.bfloat16)
    f = jax.jit(lambda a, b: fixed_order.tree_sum(a * b, -1))
    first = f(a[:, :1], b[:, :1])[0, 0]
    for t in (2, 3, 8, 16, 17, 64):
        assert bool((f(a[:, :t], b[:, :t])[0, 0] == first).all()), t
    exact = (a.astype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32) * b).sum(-1)
    assert jnp.allclose(f(a, b).astype(jnp.float32), exact.astype(jnp.float32), atol=0.02, rtol=0.008)
    x = jax.random.normal(jax.random.key(2), (3, 37))  # not a power of two: zero-padded
    assert jnp.allclose(fixed_order.tree_sum(x, 1), x.sum(1), atol=1e-5)
    assert jnp.allclose(fixed_order.log_softmax(x), jax.nn.log_softmax(x), atol=1e-5)
    assert jnp.allclose(fixed_order.softmax(x, 0), jax.nn.softmax(x, 0), atol=1e-6)
    assert fixed_order.logsumexp(jnp.full((3,), -jnp.inf)) == -jnp.inf


def test_engine_default_is_invariant_on_every_backend(monkeypatch):
    """The engine's default (`default_mode()`) is on for the GPU too since token kinds brought its cost to ~1.1x a
    decode step (docs/batch-invariance.md, "Stop 46"); code traced outside an engine context keeps the fast
    dispatch on the GPU (`traced_default()`) and the invariant forms on the CPU; a context overrides both."""
    from pallas_kernels import fixed_order

    for backend, traced in (("cpu", True), ("gpu", False)):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert fixed_order.default_mode() is True
        assert fixed_order.enabled() is traced, backend
        with fixed_order.batch_invariant(not traced):
            assert fixed_order.enabled() is (not traced)
        assert fixed_order.enabled() is traced


def test_linear_one_row_equals_the_same_row_among_others():
    """XLA's CPU backend computes a one-row dot as a matrix-vector product that rounds differently (at this size:
    bench/results/invariance_probe_cpu.json); `linear` sends one row in as two."""
    from flashnext_jax.layers import linear

    x = jax.random.normal(jax.random.key(0), (33, 2560), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (4096, 2560), jnp.float32) * 0.02).astype(jnp.bfloat16)
    f = jax.jit(linear)
    one = f(x[:1], w)[0]
    for m in (2, 3, 8, 9, 33):
        assert bool((f(x[:m], w)[0] == one).all()), m
    assert bool((f(x[None, :1], w)[0, 0] == one).all())  # [B, T, D] with B * T = 1


def _gdn_inputs(b=2, t=200, h=2, dk=8, dv=8):
    ks = jax.random.split(jax.random.key(0), 5)
    q = jax.random.normal(ks[0], (b, t, h, dk))
    k = jax.random.normal(ks[1], (b, t, h, dk)) * 0.3
    v = jax.random.normal(ks[2], (b, t, h, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
    return q, k, v, g, beta, jnp.zeros((b, h, dk, dv))


def _gdn_in_steps(cuts, width, inputs, rows=None):
    """The delta rule over tokens cuts[0]..cuts[-1], one call per [cuts[i], cuts[i+1]) padded to `width` tokens
    (padding: identities), as the engine's steps run it."""
    from flashnext_jax.gdn import delta_rule_absolute

    q, k, v, g, beta, s = inputs
    f = jax.jit(delta_rule_absolute)
    outs = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        n, pad = b - a, width - (b - a)
        cut = lambda x: jnp.pad(x[:, a:b], ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
        bsz = q.shape[0]
        out, cols = f(cut(q), cut(k), cut(v), cut(g), cut(beta), s, jnp.full((bsz,), a), jnp.full((bsz,), n))
        outs.append(out[:, :n])
        s = cols[:, 0]
    return jnp.concatenate(outs, 1), s


def test_gdn_chunks_at_absolute_positions_make_steps_invisible():
    """A prompt cut into steps on the 64-token grid (and decoded token by token after) gives the bits of one step;
    the result is the gated delta rule (the sequential recurrence, fp32)."""
    from flashnext_jax.gdn import delta_rule_recurrent

    inputs = _gdn_inputs()
    one, s_one = _gdn_in_steps([0, 200], 256, inputs)
    ref, s_ref = delta_rule_recurrent(*inputs)
    assert float(jnp.abs(one - ref).max()) < 1e-4 and float(jnp.abs(s_one - s_ref).max()) < 1e-5
    for cuts, width in (([0, 64, 128, 200], 128), ([0, 128, 192, 200], 256)):
        out, s = _gdn_in_steps(cuts, width, inputs)
        assert bool((out == one).all()) and bool((s == s_one).all()), cuts
    # a 150-token prompt in one step or in two on the grid, then 50 decode steps of one token
    decode = list(range(151, 201))
    one, s_one = _gdn_in_steps([0, 150] + decode, 256, inputs)
    out, s = _gdn_in_steps([0, 64, 150] + decode, 128, inputs)
    assert bool((out == one).all()) and bool((s == s_one).all())
    # a cut off the grid puts that chunk through the recurrence: close, but (here) not the same bits
    one, _ = _gdn_in_steps([0, 200], 256, inputs)
    off, _ = _gdn_in_steps([0, 30, 200], 256, inputs)
    assert float(jnp.abs(off - one).max()) < 1e-4 and not bool((off == one).all())


def test_gdn_row_does_not_depend_on_the_other_rows_of_its_step():
    """Rows at different positions in one call (a decode row beside a prefill chunk) equal each row alone."""
    from flashnext_jax.gdn import delta_rule_absolute

    q, k, v, g, beta, s = _gdn_inputs(b=3, t=128)
    start, n = jnp.array([0, 64, 7]), jnp.array([128, 1, 90])
    valid = (jnp.arange(128)[None] < n[:, None])[..., None]
    g, beta = jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)
    ends = jnp.stack([n - 1, n], 1)  # two checkpoint columns, as with one MTP draft
    f = jax.jit(delta_rule_absolute)
    out, cols = f(q, k, v, g, beta, s, start, n, ends)
    for r in range(3):
        t = 128 if r == 0 else 8 if r == 1 else 128
        one = lambda x: x[r:r + 1, :t]  # noqa: E731
        o, c = f(one(q), one(k), one(v), one(g), one(beta), s[r:r + 1], start[r:r + 1], n[r:r + 1], ends[r:r + 1])
        m = int(n[r])
        assert bool((o[0, :m] == out[r, :m]).all()) and bool((c[0] == cols[r]).all()), r


def test_scheduler_cuts_long_prompts_on_the_grid():
    """With prefill_align 64, a chunk of a long prompt ends on the grid (or waits a step when the budget left
    cannot reach it); past the prompt's last whole block, and for prompts shorter than a block, anywhere."""
    from flashnext_jax.scheduler import Request, Scheduler, SchedulerConfig

    class Ledger:
        def has_snapshot(self, *a):
            return False

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_model_len=1024, prefill_align=64), Ledger())
    req = Request("a", list(range(1, 201)), fj.SamplingParams(max_tokens=4), 0)
    assert sched._chunk(req, 0, 100)[0] == 64  # 100 -> the grid
    assert sched._chunk(req, 64, 100)[0] == 64
    assert sched._chunk(req, 128, 100)[0] == 72  # to the prompt's end: 192 is the last whole block
    assert sched._chunk(req, 64, 50)[0] == 0  # 114 is off the grid and 128 is out of reach: wait
    short = Request("b", list(range(1, 41)), fj.SamplingParams(max_tokens=4), 1)
    assert sched._chunk(short, 0, 25)[0] == 25  # no whole block in the prompt: cut anywhere
    assert sched.cut_allowed(req, 192) and sched.cut_allowed(req, 195) and not sched.cut_allowed(req, 100)
