"""The engine state machine shared by `test_engine_toy.py` (exactly checkable toy model) and `test_engine_real.py`
(the real demo model): requests arrive, the engine steps, requests are aborted, and at the end everything drains.

Oracle: every greedy request's tokens equal its solo run (a prefix of it while running or when aborted). The two
models differ only in how the engine is built, what a solo run is and which extra oracles apply, so:
* `EngineHarness` holds an engine and the shared oracle; a subclass builds `self.eng` (with `self.hook` as its draft
  hook) and implements `solo_greedy` (and `solo_sampled` if it submits sampled requests), and may add checks after
  every step (`check_step`) and after the drain (`check_drained`).
* `EngineMachine` holds the shared rules (run, abort, drain at teardown); a subclass adds the `@initialize` rule
  that builds its harness into `self.h` and the `arrive` rule, whose strategies are model-specific.
"""

from __future__ import annotations

import random
import zlib

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

STEPS = {"n": 0}  # launched engine steps over all harnesses (pipeline bubbles not counted)
ACCEPT_P = [0.0, 0.5, 0.9, 1.0]


class EngineHarness:
    """An engine plus its oracles; shared by the state machines and the toy soak test.

    Prompts are prefixes of one of two random corpora, with lengths clustered around multiples of the snapshot
    `block` (so prefix hits land on and off block boundaries); `mutate` changes the last token (a near miss).
    """

    vocab: int  # token ids of prompts and wrong drafts lie below this
    max_prompt: int
    corpus_len: int
    drain_limit: int

    def __init__(self, seed: int, block: int, accept_p: float | None = None):
        self.rng = random.Random(seed)
        self.seed, self.block = seed, block
        self.accept_p = self.rng.choice(ACCEPT_P) if accept_p is None else accept_p  # None: drawn from the seed
        self.corpus = [[self.rng.randrange(1, self.vocab) for _ in range(self.corpus_len)] for _ in range(2)]
        self.requests: dict[str, tuple[list[int], object]] = {}  # request id -> (prompt, SamplingParams)
        self.solo: dict[str, list[int]] = {}  # greedy requests' solo runs (sampled ones are run solo at drain)
        self.aborted: set[str] = set()
        self.n = 0
        self.eng = None  # built by the subclass

    # ---- what a subclass provides
    def solo_greedy(self, prompt: list[int], params) -> list[int]:
        raise NotImplementedError

    def solo_sampled(self, rid: str) -> list[int]:
        raise NotImplementedError(f"{type(self).__name__} submits no sampled requests")

    def check_step(self) -> None:
        """Extra oracles after every step."""

    def check_drained(self) -> None:
        """Extra oracles once every request has finished."""

    # ---- shared
    def hook(self, req, proposed):
        """Draft override: each draft right (accepted) with probability accept_p, else wrong. Decisions depend on
        (seed, request, output index, draft index) only, so a request's solo engine run sees the same drafts."""
        j, ref, out = len(req.output), self.solo.get(req.request_id), []
        for i, d in enumerate(proposed):
            r = random.Random(zlib.crc32(f"{self.seed}/{req.request_id}/{j}/{i}".encode()))
            right = ref[j + i] if ref is not None and j + i < len(ref) else d
            out.append(right if r.random() < self.accept_p else (right + 1 + r.randrange(3)) % self.vocab)
        return out

    def prompt(self, m: int, delta: int, corpus: int, mutate: bool) -> list[int]:
        n = max(1, min(self.max_prompt, self.block * m + delta))
        p = list(self.corpus[corpus][:n])
        if mutate:
            p[-1] = (p[-1] + 1) % self.vocab
        return p

    def submit(self, prompt: list[int], params) -> str:
        rid = f"r{self.n}"
        self.n += 1
        self.requests[rid] = (prompt, params)
        if params.temperature == 0.0:
            self.solo[rid] = self.solo_greedy(prompt, params)
        self.eng.add_request(rid, prompt, params)
        return rid

    def step(self):
        before = self.eng.counters["steps"]
        self.eng.step()
        STEPS["n"] += self.eng.counters["steps"] - before
        self.check_step()
        for rid, req in self.eng.requests.items():
            assert req.finish_reason != "error", req.error
            if rid in self.solo:
                assert req.output == self.solo[rid][: len(req.output)], f"{rid} diverged from its solo run"

    def abort_some(self, i: int):
        live = [r for r in self.eng.requests.values() if not r.finished]
        if live:
            r = live[i % len(live)]
            self.aborted.add(r.request_id)
            self.eng.abort(r.request_id)

    def drain(self):
        for _ in range(self.drain_limit):
            if not self.eng.has_unfinished():
                break
            self.step()
        assert not self.eng.has_unfinished(), "engine did not drain"
        for rid, req in self.eng.requests.items():
            assert req.finish_reason != "error", req.error
            solo = self.solo[rid] if rid in self.solo else self.solo_sampled(rid)
            if rid in self.aborted:
                assert req.output == solo[: len(req.output)], f"{rid} (aborted) diverged from its solo run"
            else:
                assert req.output == solo, f"{rid}: {req.output} != solo {solo}"
        self.eng.ledger.flush()
        assert self.eng.usage()["slots_used"] == 0
        self.check_drained()


class EngineMachine(RuleBasedStateMachine):
    """Shared rules. A subclass adds an `@initialize` rule that sets `self.h` and an `arrive` rule."""

    @precondition(lambda self: hasattr(self, "h"))
    @rule(n=st.integers(1, 4))
    def run(self, n):
        for _ in range(n):
            self.h.step()

    @precondition(lambda self: hasattr(self, "h"))
    @rule(i=st.integers(0, 7))
    def abort(self, i):
        self.h.abort_some(i)

    def teardown(self):
        if hasattr(self, "h"):
            self.h.drain()
