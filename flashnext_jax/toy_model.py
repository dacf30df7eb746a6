"""An exactly-checkable toy model with the same KINDS of per-request state as Qwen3.8-Flash-Next.

Integer arithmetic mod a prime M (int32, no overflow), so a pure-Python fold is an exact oracle. Per token x at
position p with host-gathered n-gram row g (the PLE stand-in; the table lives on the host):
  c    = conv·(3,5,7) + ctx·(11,13)                         conv state = last 3 layer inputs, ctx = last 2 ids
  r0   = rec0*P0 + x + S0 + c + g                           recurrent layer 0   (GDN stand-in)
  e    = r0*31 + x ; att = sum of e over positions <= p     paged per-token entry (QSA KV stand-in)
  r_l  = rec_l*P_l + x + S_l + (att if l == 1 else r_{l-1}) recurrent layers 1..L-1
  me   = r_last*17 + x ; matt = sum of me                   the MTP layer's own paged cache
  logits = one-hot-ish of h = (r_last*40503 + att*7) mod V
Draft head: greedily rolls the toy forward k tokens from each position (n-gram rows from its own table copy),
and errs on purpose when (matt + guess*5 + i) % 4 == 0, so acceptance varies.
Poisoned state (negative ints) makes the row's logits NaN: a freed/padding slot can never produce a token quietly.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .state_store import Leaf, StoreSpec, live_rows, read_pages, read_slots, write_pages, write_slots

M = 32749
TABLE = 4099


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    vocab_size: int = 64
    num_layers: int = 3
    eos_token_id: int = 0
    max_model_len: int = 4096  # att sums stay < 2**31

    @property
    def pad_id(self) -> int:  # n-gram context before the first token
        return self.vocab_size

    @property
    def P(self):
        return [(1103 + 977 * l) % 29989 for l in range(self.num_layers)]

    @property
    def S(self):
        return [17 + 12 * l for l in range(self.num_layers)]


def ngram_table() -> np.ndarray:
    return ((np.arange(TABLE, dtype=np.int64) * 7919 + 13) % 101).astype(np.int32)


def ngram_id(prev2, prev1, x):
    return (prev2 * 1009 + prev1 * 31 + x) % TABLE


def advance(cfg: ToyConfig, rec, conv, ctx, att, matt, x, g):
    """One token through the toy. Works on Python ints and on jnp int32 arrays alike (all values in [0, M))."""
    P, S = cfg.P, cfg.S
    c = (conv[0] * 3 + conv[1] * 5 + conv[2] * 7 + ctx[0] * 11 + ctx[1] * 13) % M
    u = (x * 7 + g) % M
    r0 = (rec[0] * P[0] + x + S[0] + c + g) % M
    e = (r0 * 31 + x) % M
    att = (att + e) % M
    new = [r0]
    prev = att
    for l in range(1, cfg.num_layers):
        r = (rec[l] * P[l] + x + S[l] + prev) % M
        new.append(r)
        prev = r
    me = (new[-1] * 17 + x) % M
    matt = (matt + me) % M
    return new, [conv[1], conv[2], u], [ctx[1], x], att, matt, e, me


def head(cfg: ToyConfig, rec, att):
    return (rec[-1] * 40503 + att * 7) % cfg.vocab_size


def logits_row(cfg: ToyConfig, h, xp=np):
    """Float logits with a unique argmax h (h's logit >= 4 > 3 >= every other)."""
    v = xp.arange(cfg.vocab_size)
    h = xp.asarray(h)[..., None]
    base = ((h * 131 + v * (v + 3) * 7) % 97).astype(xp.float32) / 32.0
    return base + xp.where(v == h, xp.float32(4.0), xp.float32(0.0))


# ------------------------------------------------------------------------------------------------- Python fold


@dataclasses.dataclass
class FoldState:
    rec: list
    conv: list
    ctx: list
    att: int
    matt: int
    kv: list  # per position
    mtp_kv: list
    tokens: list


def fold_init(cfg: ToyConfig) -> FoldState:
    return FoldState([0] * cfg.num_layers, [0, 0, 0], [cfg.pad_id, cfg.pad_id], 0, 0, [], [], [])


def fold_step(cfg: ToyConfig, s: FoldState, x: int, table=None) -> FoldState:
    table = ngram_table() if table is None else table
    full = s.tokens
    prev2 = full[-2] if len(full) >= 2 else cfg.pad_id
    prev1 = full[-1] if len(full) >= 1 else cfg.pad_id
    g = int(table[ngram_id(prev2, prev1, x)])
    rec, conv, ctx, att, matt, e, me = advance(cfg, s.rec, s.conv, s.ctx, s.att, s.matt, x, g)
    return FoldState(rec, conv, ctx, att, matt, s.kv + [e], s.mtp_kv + [me], full + [x])


def fold(cfg: ToyConfig, tokens: Sequence[int]) -> FoldState:
    table = ngram_table()
    s = fold_init(cfg)
    for x in tokens:
        s = fold_step(cfg, s, int(x), table)
    return s


def greedy_next(cfg: ToyConfig, s: FoldState) -> int:
    return int(head(cfg, s.rec, s.att))


def solo_greedy(cfg: ToyConfig, prompt: Sequence[int], max_tokens: int, stop_ids=(), max_len=None,
                ignore_eos: bool = False) -> list[int]:
    """Reference output of greedy decoding (stops on eos/stop ids like the engine with ignore_eos=False)."""
    s = fold(cfg, prompt)
    out: list[int] = []
    table = ngram_table()
    max_len = max_len or cfg.max_model_len
    while len(out) < max_tokens and len(prompt) + len(out) < max_len:
        y = greedy_next(cfg, s)
        out.append(y)
        if (y == cfg.eos_token_id and not ignore_eos) or y in stop_ids:
            break
        s = fold_step(cfg, s, y, table)
    return out


# ------------------------------------------------------------------------------------------------- JAX runner


class ToyRunner:
    """Implements the engine's ModelRunner protocol (docs/engine-design.md) for the toy model."""

    def __init__(self, cfg: ToyConfig = ToyConfig(), num_speculative_tokens: int = 1):
        self.cfg = cfg
        self.k = num_speculative_tokens
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = cfg.eos_token_id
        self.max_model_len = cfg.max_model_len
        self.table = ngram_table()
        self.params = {"ngram_table": jnp.asarray(self.table)}  # only the draft head uses the device copy
        self._jit = None

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    def store_spec(self, layers: range | None = None) -> StoreSpec:
        """The state of toy layers `layers` (a pipeline stage; default all): each layer its recurrent value; the
        stage with layer 0 also the conv / n-gram context and the per-token entries, the last stage the MTP cache."""
        c = self.cfg
        layers = range(c.num_layers) if layers is None else layers
        slot, page = {"rec": Leaf((len(layers),), jnp.int32, 0)}, {}
        if layers.start == 0:
            slot |= {"conv": Leaf((3,), jnp.int32, 0), "ctx": Leaf((2,), jnp.int32, c.pad_id)}
            page["kv"] = Leaf((), jnp.int32)
        if layers.stop == c.num_layers:
            page["mtp_kv"] = Leaf((), jnp.int32)
        return StoreSpec(slot=slot, page=page)

    def stage_params(self, layers: range) -> dict:
        return dict(self.params) if layers.stop == self.cfg.num_layers else {}

    def stage_host_inputs(self, layers: range) -> tuple[str, ...]:
        return ("ngram_rows",) if layers.start == 0 else ()

    def host_prepare(self, rows, T: int) -> dict[str, np.ndarray]:
        """Host hook: hashed n-gram ids from each row's token history, rows gathered from the host table."""
        g = np.zeros((len(rows), T), np.int32)
        for b, row in enumerate(rows):
            if row is None:
                continue
            hist = list(row.history[-2:])
            ctx = [self.cfg.pad_id] * (2 - len(hist)) + hist
            for t, x in enumerate(row.tokens):
                g[b, t] = self.table[ngram_id(ctx[-2], ctx[-1], x)]
                ctx.append(x)
        return {"ngram_rows": g}

    # async scheduling (engine.py): a chained row's n-gram input from its device token
    chain_context_len = 2

    def place_chain_inputs(self) -> dict:
        return {"ngram_table": jnp.asarray(self.table)}

    def chained_host_inputs(self, chain_params: dict, tokens, positions, context) -> dict:
        context = jnp.where(context < 0, self.cfg.pad_id, context)
        return {"ngram_rows": chain_params["ngram_table"][ngram_id(context[:, 0], context[:, 1], tokens)]}

    def logits(self, params, hidden):
        """The step's "hidden" output (the head value h of each position) -> float logits [..., V]."""
        return logits_row(self.cfg, hidden, jnp)

    # -- the pure step (one stage holding every layer)
    def step(self, params, store, batch, all_positions: bool = False):
        return self.stage_step(params, store, batch, None, range(self.cfg.num_layers), all_positions)

    def stage_step(self, params, store, batch, x, layers: range, all_positions: bool = False):
        """Toy layers `layers` on their own store. Between stages `x` [B, T, L + 7] int32 carries, after each
        token, every layer's recurrent value so far, conv (3), ctx (2), att, and a poisoned-input flag (the toy's
        hidden state: the last stage's head and draft need the whole state at the tail)."""
        cfg, k = self.cfg, self.k
        L = cfg.num_layers
        first, last = layers.start == 0, layers.stop == L
        B, T = batch.tokens.shape
        K1 = store.slot["rec"].shape[1]
        live = live_rows(store, batch.slot, batch.gen)
        st = read_slots(store, batch.slot, live)
        valid = jnp.arange(T)[None, :] < batch.n_valid[:, None]
        bad = jnp.any(st["rec"] < 0, 1)

        def context_sum(name):  # running sum of a per-token page entry over the positions before start
            pos = jnp.arange(store.page[name].shape[1] * batch.page_table.shape[1])[None, :]
            ctx_mask = pos < batch.start[:, None]
            a = read_pages(store, name, batch.page_table)
            return jnp.sum(jnp.where(ctx_mask, a, 0), axis=1) % M, jnp.any(ctx_mask & (a < 0), 1)

        zero = jnp.zeros((B,), jnp.int32)
        if first:
            att0, bad_kv = context_sum("kv")
            bad = bad | jnp.any(st["conv"] < 0, 1) | jnp.any(st["ctx"] < 0, 1) | bad_kv
            x = jnp.zeros((B, T, L + 7), jnp.int32)
            carry0 = (st["rec"], st["conv"], st["ctx"], att0)
        else:
            bad = bad | (x[:, 0, L + 6] > 0)
            carry0 = (st["rec"], jnp.zeros((B, 3), jnp.int32), jnp.zeros((B, 2), jnp.int32), zero)
        matt0, bad_m = context_sum("mtp_kv") if last else (zero, jnp.zeros((B,), bool))
        bad = bad | bad_m
        P, S = cfg.P, cfg.S

        def body(carry, xs):
            rec, conv, ctx, att, matt = carry
            tok, g, ok, hin = xs
            if first:
                c = (conv[:, 0] * 3 + conv[:, 1] * 5 + conv[:, 2] * 7 + ctx[:, 0] * 11 + ctx[:, 1] * 13) % M
                r0 = (rec[:, 0] * P[0] + tok + S[0] + c + g) % M
                e = (r0 * 31 + tok) % M
                att = (att + e) % M
                new, prev = [r0], att
                conv, ctx = jnp.stack([conv[:, 1], conv[:, 2], (tok * 7 + g) % M], 1), jnp.stack([ctx[:, 1], tok], 1)
            else:  # layer `start` reads the previous layer's value (att for layer 1)
                att, conv, ctx, e = hin[:, L + 5], hin[:, L: L + 3], hin[:, L + 3: L + 5], zero
                new, prev = [], (att if layers.start == 1 else hin[:, layers.start - 1])
            for i, l in enumerate(layers):
                if l == 0:
                    continue
                r = (rec[:, i] * P[l] + tok + S[l] + prev) % M
                new.append(r)
                prev = r
            me = (new[-1] * 17 + tok) % M if last else zero
            new = (jnp.stack(new, 1), conv, ctx, att, (matt + me) % M)
            carry = jax.tree.map(lambda n, o: jnp.where(ok.reshape((-1,) + (1,) * (n.ndim - 1)), n, o), new, carry)
            rec, conv, ctx, att, _ = carry
            hout = jnp.concatenate([hin[:, : layers.start], rec, hin[:, layers.stop: L], conv, ctx, att[:, None],
                                    hin[:, L + 6:]], axis=1)
            return carry, (carry, hout, e, me)

        xs = (batch.tokens.T, batch.host["ngram_rows"].T if first else jnp.zeros((T, B), jnp.int32), valid.T,
              jnp.moveaxis(x, 1, 0))
        _, (states, hidden, e, me) = jax.lax.scan(body, (*carry0, matt0), xs)
        hidden = jnp.moveaxis(hidden, 0, 1).at[:, :, L + 6].set(bad.astype(jnp.int32)[:, None])  # [B, T, L + 7]
        # tail positions: column c holds the state after row token base + c
        base = jnp.maximum(batch.n_valid - K1, 0)
        idx = jnp.clip(base[:, None] + jnp.arange(K1)[None, :], 0, jnp.maximum(batch.n_valid - 1, 0)[:, None])
        tail = jax.tree.map(lambda a: jnp.take_along_axis(
            jnp.moveaxis(a, 0, 1), idx.reshape(B, K1, *([1] * (a.ndim - 2))), axis=1), states)
        rec, conv, ctx, att, matt = tail  # [B, K1, ...]
        cols = {"rec": rec, "conv": conv, "ctx": ctx} if first else {"rec": rec}
        cols = {n: jnp.where(bad.reshape((-1,) + (1,) * (a.ndim - 1)), -(2**31) + 7, a) for n, a in cols.items()}
        store = write_slots(store, batch.slot, live, cols)
        positions = batch.start[:, None] + jnp.arange(T)[None, :]
        wvalid = valid & live[:, None]
        if first:
            store = write_pages(store, "kv", batch.page_table, positions, wvalid, e.T)
        if not last:
            return store, hidden
        store = write_pages(store, "mtp_kv", batch.page_table, positions, wvalid, me.T)

        h_tail = jnp.take_along_axis(hidden, idx[..., None], axis=1)  # [B, K1, L + 7]: the whole state at the tail
        rec, conv, ctx, att = h_tail[..., :L], h_tail[..., L: L + 3], h_tail[..., L + 3: L + 5], h_tail[..., L + 5]
        h = head(cfg, [rec[..., l] for l in range(L)], att)
        logits = logits_row(cfg, h, jnp)
        logits = jnp.where(bad[:, None, None], jnp.nan, logits)
        if k:
            dlogits = logits_row(cfg, self._draft(params, rec, conv, ctx, att, matt, h), jnp)
        else:
            dlogits = jnp.zeros((B, K1, 0, cfg.vocab_size), jnp.float32)
        dlogits = jnp.where(bad[:, None, None, None], jnp.nan, dlogits)
        out = {"logits": logits, "draft_logits": dlogits}
        if all_positions:  # h after each row token [B, T] (the state after token t predicts token t + 1)
            out["hidden"] = head(cfg, [hidden[..., l] for l in range(L)], hidden[..., L + 5])  # [B, T]
        return store, out

    def _draft(self, params, rec, conv, ctx, att, matt, y):
        cfg, L = self.cfg, self.cfg.num_layers
        table = params["ngram_table"]
        r, cv, cx = [rec[..., l] for l in range(L)], [conv[..., i] for i in range(3)], [ctx[..., 0], ctx[..., 1]]
        out = []
        for i in range(self.k):
            g = table[ngram_id(cx[0], cx[1], y)]
            r, cv, cx, att, matt, _, _ = advance(cfg, r, cv, cx, att, matt, y, g)
            y = head(cfg, r, att)
            wrong = (matt + y * 5 + i) % 4 == 0
            out.append(jnp.where(wrong, (y + 1) % cfg.vocab_size, y))
            y = out[-1]
        return jnp.stack(out, -1)  # [B, K1, k]


# ------------------------------------------------------------------------------------------ oracles for tests

_FOLDS: dict = {}


def fold_cached(cfg: ToyConfig, tokens: Sequence[int]) -> FoldState:
    key = (cfg, tuple(tokens))
    hit = _FOLDS.get(key)
    if hit is None:
        n = len(tokens)
        i = n
        while i > 0 and (cfg, tuple(tokens[:i])) not in _FOLDS:
            i -= 1
        s = _FOLDS[(cfg, tuple(tokens[:i]))] if i else fold_init(cfg)
        table = ngram_table()
        for j in range(i, n):
            s = fold_step(cfg, s, int(tokens[j]), table)
            if len(_FOLDS) > 200_000:
                _FOLDS.clear()
            _FOLDS[(cfg, tuple(tokens[: j + 1]))] = s
        hit = s
    return hit


def check_engine_against_fold(engine, cfg: ToyConfig):
    """Oracles: every committed live state and every snapshot equals the fold; free slots/pages are poisoned."""
    from .state_store import INT_POISON

    led = engine.ledger
    led.flush()
    stores = led.store if led.staged else (led.store,)
    cursor = np.asarray(stores[0].cursor)
    for st in stores[1:]:  # invariant 10: every stage applied the same commits (cursors and generations agree)
        assert np.array_equal(np.asarray(st.cursor), cursor) and np.array_equal(np.asarray(st.gen), np.asarray(
            stores[0].gen)), "pipeline stages disagree on cursors / generations"
    # the stages' leaves side by side (the per-layer "rec" concatenated in layer order): the whole model's view
    slot = {n: np.concatenate([np.asarray(st.slot[n]) for st in stores if n in st.slot], axis=-1) if n == "rec"
            else np.asarray(next(st.slot[n] for st in stores if n in st.slot)) for n in ("rec", "conv", "ctx")}
    page = {n: np.asarray(st.page[n]) for st in stores for n in st.page}
    snap = {n: np.concatenate([np.asarray(st.snap[n]) for st in stores if n in st.snap], axis=-1) if n == "rec"
            else np.asarray(next(st.snap[n] for st in stores if n in st.snap)) for n in ("rec", "conv", "ctx")}
    ps = led.dims.page_size
    for req in engine.requests.values():
        if req.slot is None or req.inflight or req.finished:
            continue
        led.check(req.slot, owner=req.request_id)
        f = fold_cached(cfg, req.tokens[: req.num_computed])
        s, c = req.slot.slot, cursor[req.slot.slot]
        got = (list(slot["rec"][s, c]), list(slot["conv"][s, c]), list(slot["ctx"][s, c]))
        assert got == (f.rec, f.conv, f.ctx), f"request {req.request_id} state {got} != fold {(f.rec, f.conv, f.ctx)}"
        kv = [int(page["kv"][req.pages[p // ps], p % ps]) for p in range(req.num_computed)]
        mkv = [int(page["mtp_kv"][req.pages[p // ps], p % ps]) for p in range(req.num_computed)]
        assert kv == f.kv and mkv == f.mtp_kv, f"request {req.request_id} KV != fold"
    for e in led.snaps.values():
        f = fold_cached(cfg, e.tokens)
        got = (list(snap["rec"][e.snap_id]), list(snap["conv"][e.snap_id]), list(snap["ctx"][e.snap_id]))
        assert got == (f.rec, f.conv, f.ctx), f"snapshot of {len(e.tokens)} tokens != fold"
        kv = [int(page["kv"][e.pages[p // ps], p % ps]) for p in range(len(e.tokens))]
        assert kv == f.kv, "snapshot pages != fold"
    for s in led.free_slots:
        assert all(np.all(a[s] == INT_POISON) for a in slot.values()), f"free slot {s} not poisoned"
    for p in led.free_pages:
        assert all(np.all(a[p] == INT_POISON) for a in page.values()), f"free page {p} not poisoned"
    for n, a in slot.items():
        assert np.all(a[-1] == INT_POISON), "null slot written"
