"""The MTP head's QSA layer read from its pages (mtp_paged.py) equals its dense oracle (RealRunner(paged_mtp=False)).

The embedded demo model in float32 (budget 16 = 4 blocks of 4: a query past 19 tokens attends a selection), two
engines that differ only in the MTP layer's path, the same requests through both: two concurrent prompts of 83
and 58 tokens prefilled in 24-token chunks (chunk ends inside blocks and 8-token pages), then a third sharing 48
tokens with the first (a prefix-cache hit), each decoding with k = 1, 2, 3 drafts per step, a draft hook
rejecting about half of them (so the next step starts inside the rejected tail and rewrites its pages and block
keys). Every step's draft logits (each live row's tail columns: different tails in one step) must agree, and the
greedy tokens must equal each other and Model.generate. Coverage is asserted from the recorded steps: draft
chains that cross a block boundary, tails whose block straddles two pages, rejected drafts.
"""

import dataclasses
import random
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashnext_jax as fj
from flashnext_jax.runner import RealRunner

PAGE, RATIO = 8, 4
RNG = random.Random(11)
A, B = ([RNG.randrange(1, 509) for _ in range(n)] for n in (83, 58))
C = A[:48] + [RNG.randrange(1, 509) for _ in range(13)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model():
    return fj.load(dtype="float32")


@pytest.fixture(scope="module")
def reference(model):
    """Model.generate of the three prompts (the same for every k)."""
    return [model.generate(p, MAX_TOKENS) for p in (A, B, C)]


class RecordingRunner(RealRunner):
    """RealRunner that records each step's draft logits per live row, keyed by (slot, start)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records: dict = {}

    def step(self, params, store, batch, all_positions: bool = False):
        store, out = super().step(params, store, batch, all_positions)
        jax.debug.callback(self._record, batch.slot, batch.start, batch.n_valid, out["draft_logits"])
        return store, out

    def _record(self, slot, start, n_valid, draft_logits):
        K1 = draft_logits.shape[1]
        for b in np.nonzero((np.asarray(slot) >= 0) & (np.asarray(n_valid) > 0))[0]:
            n = int(n_valid[b])
            columns = min(n, K1)  # tail columns inside the row's tokens: base + c < n_valid
            self.records[(int(slot[b]), int(start[b]))] = (n, np.array(draft_logits[b, :columns]))


def run(model, k: int, paged: bool):
    runner = RecordingRunner(model, k, paged_mtp=paged)
    lm = fj.LLM(runner, speculative_config={"method": "mtp", "num_speculative_tokens": k}, max_model_len=128,
                page_size=PAGE, max_num_seqs=2, max_num_batched_tokens=24, enable_prefix_caching=True,
                block_size=PAGE, page_table_width="max", min_batch_bucket=2)
    rejected = []

    def hook(req, proposed):  # about half the drafts replaced by a wrong token: rejected in the next step
        r = random.Random(zlib.crc32(f"{req.request_id}/{len(req.output)}".encode()))
        out = [d if r.random() < 0.5 else (d + 1) % 509 for d in proposed]
        rejected.append(out != list(proposed))
        return out

    lm.engine.draft_hook = hook
    greedy = fj.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    first = lm.generate([A, B], greedy)
    third = lm.generate([C], greedy)[0]
    assert third.metrics["num_cached_tokens"] >= 48
    return [o.token_ids for o in first + [third]], runner.records, lm.engine.counters, any(rejected)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_paged_mtp_equals_dense_oracle(model, reference, k):
    tokens, got, counters, rejected = run(model, k, paged=True)
    want_tokens, want, _, _ = run(model, k, paged=False)
    assert tokens == want_tokens == reference
    assert rejected and 0 < counters["accepted"] < counters["drafts"], counters

    assert got.keys() == want.keys()
    crossing = straddling = 0
    for key, (n, logits) in got.items():
        assert want[key][0] == n
        ref = want[key][1]
        assert np.all(np.isfinite(logits)), key
        np.testing.assert_allclose(logits, ref, rtol=0, atol=2e-5 * np.abs(ref).max(), err_msg=str(key))
        start = key[1]
        base = max(n - (k + 1), 0)
        for c in range(logits.shape[0]):
            t = start + base + c  # the column's tail token (cache index of its first draft query)
            crossing += t // RATIO != (t + k - 1) // RATIO
            straddling += (t // RATIO + 1) * RATIO % PAGE == 0  # its block ends on page position 4j + 4 = 8n
    assert straddling > 5, straddling
    assert k == 1 or crossing > 5, crossing


# ---- the layer alone: many exact ties, the tiled selection, image positions

def _tiny_head(budget=64):
    """A tiny random config with one index head (a block whose score is negative relus to exactly 0, so the
    top-k boundary is full of ties) and MTP params whose attention is scaled up (scores spread)."""
    from flashnext_jax.weights import random_params
    from tiny_configs import tiny_config

    cfg = tiny_config(indexer_budget=budget, indexer_n_heads=1)
    params = random_params(cfg, 5, jnp.float32)
    attn = params["mtp"]["layers"][0]["self_attn"]
    params["mtp"]["layers"][0]["self_attn"] = jax.tree.map(lambda x: x * 30, attn)
    return cfg, params


def _dense_drafts(params, cfg, hyper, tokens, n, h_tail, y0, tails, k, mrope):
    """The oracle as RealRunner(paged_mtp=False) runs it: fold pairs 1 .. n - 1 into a dense cache (index q - 1),
    then per tail column its own copy of the cache, chained k times from cache index tails[b, c]."""
    from flashnext_jax.mtp import init_mtp_cache, mtp_forward

    b, K1 = tails.shape
    L = hyper.shape[1] + k + RATIO
    cache = init_mtp_cache(cfg, b, L, jnp.float32)
    _, _, cache = mtp_forward(params, cfg, hyper[:, :-1], tokens[:, 1:], jnp.zeros((b,), jnp.int32),
                              jnp.asarray(n) - 1, cache, mrope)
    rows = lambda a: jnp.repeat(a, K1, axis=0)  # noqa: E731
    cc = tuple(rows(a) for a in cache)
    spans = None if mrope is None else dataclasses.replace(mrope, spans=rows(mrope.spans))
    h, y, pos = h_tail.reshape(b * K1, 1, -1), y0.reshape(b * K1, 1), tails.reshape(b * K1)
    out = []
    for i in range(k):
        dl, h, cc = mtp_forward(params, cfg, h, y, pos + i, jnp.ones((b * K1,), jnp.int32), cc, spans)
        out.append(dl[:, 0])
        y = jnp.argmax(dl, axis=-1).astype(jnp.int32)
    return np.asarray(jnp.stack(out, 1).reshape(b, K1, k, -1))


def _paged_drafts(params, cfg, hyper, tokens, n, h_tail, y0, tails, k, mrope, score_elements, chunk=13):
    """The same through mtp_paged: pairs folded chunk by chunk into poisoned pools whose pages are scattered."""
    from flashnext_jax.mtp_paged import drafts, fold
    from flashnext_jax.qsa_paged import PagedKV

    b, t = tokens.shape
    per_row = -(-(t + 1) // PAGE)
    ids = np.random.default_rng(0).permutation(b * per_row + 3)[: b * per_row].reshape(b, per_row)
    nan = lambda rows, *s: jnp.full((b * per_row + 4, rows, 1, *s), jnp.nan, jnp.float32)  # noqa: E731
    kvh = (cfg.num_key_value_heads, cfg.head_dim)
    di = cfg.indexer_head_dim
    pools = (nan(PAGE, *kvh), nan(PAGE, *kvh), nan(PAGE, di), nan(PAGE // RATIO, di))
    table = jnp.asarray(ids, jnp.int32)

    @jax.jit
    def fold_chunk(pools, hyper, tokens, q, write):
        return fold(params, cfg, PagedKV(*pools, table, write, 0, score_elements), hyper, tokens, q, mrope)[:4]

    for s in range(1, t, chunk):
        q = s + jnp.arange(chunk)[None].repeat(b, 0)
        at = jnp.minimum(q, t - 1)
        pools = fold_chunk(pools, jnp.take_along_axis(hyper, at[..., None] - 1, 1), jnp.take_along_axis(tokens, at, 1),
                           q, q < jnp.asarray(n)[:, None])
    run = jax.jit(lambda pools: drafts(params, cfg, PagedKV(*pools, table, None, 0, score_elements), h_tail,
                                       jax.nn.one_hot(y0, cfg.vocab_size), tails, k, mrope))
    return np.asarray(run(pools))


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("score_elements,images", [(1 << 24, False), (3 * 4 * 8, False), (1 << 24, True)])
def test_drafts_equal_the_dense_chain_with_ties(k, score_elements, images):
    """Rows of 101 and 86 tokens (25 and 21 blocks, 16 chosen: about half score 0, so the 16th ties with
    unchosen ones, fresh blocks among them), K1 = 4 tails each covering every offset in a block; the one-pass and
    the tiled scoring; image spans (3-D positions) in the fold and the drafts."""
    from flashnext_jax.mrope import SpanRope

    cfg, params = _tiny_head()
    n = [101, 86]
    t = max(n)
    key = jax.random.split(jax.random.key(2), 4)
    sh = cfg.hc_count * cfg.hidden_size
    hyper = jax.random.normal(key[0], (2, t, sh))
    tokens = jax.random.randint(key[1], (2, t), 0, cfg.vocab_size)
    tails = jnp.asarray([[97, 98, 99, 100], [82, 83, 84, 85]], jnp.int32)
    h_tail = jax.random.normal(key[2], (2, 4, sh))
    y0 = jax.random.randint(key[3], (2, 4), 0, cfg.vocab_size)
    mrope = None
    if images:  # row 0: a 1 x 4 x 6 image at indices 5 .. 28 (positions fall behind the indices after it)
        spans = jnp.zeros((2, 2, 4), jnp.int32).at[0, 0].set(jnp.asarray([5, 1, 4, 6]))
        mrope = SpanRope(spans, (2, 1, 1))
    want = _dense_drafts(params, cfg, hyper, tokens, n, h_tail, y0, tails, k, mrope)
    got = _paged_drafts(params, cfg, hyper, tokens, n, h_tail, y0, tails, k, mrope, score_elements)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
