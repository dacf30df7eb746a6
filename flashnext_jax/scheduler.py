"""Continuous batching (vLLM-V1 style): running requests first (decodes and prefill chunks share a step), then
FCFS admission; chunked prefill under `max_num_batched_tokens`; preemption by recompute when pages run out; a
request with an uncommitted step is never scheduled again (per-request serialisation, invariant 5), except, with
async scheduling, once as a chained decode row: its input token is the in-flight step's device output
(tickets.TokenSource), and the device runs the two steps in order on the same slot.

The scheduler only plans; the engine turns a plan into immutable tickets and performs the device work.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from .state_store import SlotRef, SnapEntry, StoreLedger
from .tickets import Capture, TokenSource


CHAINED = -1  # a chained row's input token: on the device only (RowPlan.token_from)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: Any  # SamplingParams
    arrival: int
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)  # TokenLogprob per output token, if params.logprobs
    prompt_logprobs: list | None = None  # TokenLogprob per prompt position (entry 0 None), if params.prompt_logprobs
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None
    num_computed: int = 0  # tokens folded into the committed state
    drafts: list[int] = dataclasses.field(default_factory=list)
    draft_probs: list = dataclasses.field(default_factory=list)  # q(.) per draft (None when greedy)
    slot: SlotRef | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    inflight: int = 0  # uncommitted steps holding the request (2 only with a chained row)
    chain: TokenSource | None = None  # set while its in-flight step's token may feed a chained row (async)
    aborted: bool = False
    freed: bool = False  # the caller took its output (Engine.free_request): forget it once no step holds it
    stop_checker: Any = None  # callable(token_ids) -> bool for stop strings (set by the LLM layer)
    images: Any = None  # request_images.RequestImages of an image prompt (None: text)
    slot_values: dict | None = None  # integer slot leaves the ledger writes at each allocation (the image spans)
    bans: Any = None  # token_bans.TokenBans: min_tokens / allowed_token_ids / bad_words (None: none)
    step_mask: Any = None  # the packed token masks of its columns in the step in flight (grammar and bans; None: none)
    metrics: dict = dataclasses.field(default_factory=lambda: {
        "num_cached_tokens": 0, "num_drafts": 0, "num_accepted": 0, "num_preemptions": 0, "num_steps": 0})

    @property
    def tokens(self) -> list[int]:
        """prompt + output: a new list of every token (O(context): the per-step paths use the ones below)."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    def token_slice(self, start: int, stop: int) -> list[int]:
        """tokens[start:stop] (0 <= start <= stop) without building the whole list: at 128K tokens each copy of
        `tokens` cost ~0.3 ms of host time per decode step (H200 profile, docs/long-context.md)."""
        p = len(self.prompt)
        if stop <= p:
            return self.prompt[start:stop]
        if start >= p:
            return self.output[start - p:stop - p]
        return self.prompt[start:] + self.output[:stop - p]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def prefix_salt(self, length: int) -> bytes:
        """What keys a prefix of `length` tokens besides its ids: the content of the images it holds pads of."""
        return b"" if self.images is None else self.images.prefix_salt(length)


@dataclasses.dataclass(frozen=True)
class RowPlan:
    request: Request
    start: int
    tokens: tuple[int, ...]
    num_drafts: int
    samples: bool
    capture: Capture | None
    token_from: TokenSource | None = None  # a chained row (async scheduling): tokens == (CHAINED,)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    num_speculative_tokens: int = 0
    enable_prefix_caching: bool = False
    block_size: int = 16  # prefix-snapshot granularity (independent of the KV page size)
    # rows per step (a micro-batch) when a pipeline keeps several steps in flight; None = max_num_seqs
    max_rows_per_step: int | None = None
    # prefill chunks take the largest of these token counts that fits (EngineConfig.prefill_buckets)
    prefill_buckets: tuple[int, ...] | None = None
    # batch invariance (docs/batch-invariance.md): where a prompt may be cut (a chunk's end, a prefix snapshot),
    # `cut_allowed`. The model computes whole aligned blocks of its prompt (GDN: 64-token chunks) in one piece only
    # when one step holds them, so a cut inside such a block would change the prompt's numbers. 1: anywhere.
    prefill_align: int = 1
    # plan a decode row for a request whose step is still in flight, its token from that step's device output
    # (the engine sets Request.chain where that is allowed)
    async_scheduling: bool = False
    # token kinds (flashnext_jax/token_kinds.py), > 0: the decode step's width G. A row's tokens are all prompt
    # tokens or all generated ones, a generated row (a recompute after a preemption too) holds at most G, and
    # prefix snapshots stop at the prompt's end, so every token is computed as its kind in any batch. 0: off.
    token_kinds: int = 0

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError(f"invalid scheduler limits: {self}")
        if self.max_num_batched_tokens < self.num_speculative_tokens + 1:
            raise ValueError("max_num_batched_tokens must be >= num_speculative_tokens + 1")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, ledger: StoreLedger):
        self.cfg, self.ledger = cfg, ledger
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    # ---- admission control
    def add(self, req: Request):
        n = len(req.prompt)
        if n == 0:
            raise ValueError(f"request {req.request_id}: empty prompt")
        if n >= self.cfg.max_model_len:
            raise ValueError(f"request {req.request_id}: prompt has {n} tokens but max_model_len is "
                             f"{self.cfg.max_model_len} (needs room for at least one output token)")
        # the most context the request can reach (prompt + max_tokens, at most max_model_len) must fit the pool
        # alone, or it could never finish: refuse it now, naming both numbers
        max_tokens = getattr(req.params, "max_tokens", None) or self.cfg.max_model_len
        need = min(n + max_tokens, self.cfg.max_model_len)
        dims = self.ledger.dims
        if self._pages_for(need) > dims.num_pages:
            raise ValueError(f"request {req.request_id}: prompt ({n} tokens) + max_tokens ({max_tokens}) needs "
                             f"{need} tokens of KV cache but the KV page pool holds at most "
                             f"{dims.num_pages * dims.page_size} tokens ({dims.num_pages} pages of {dims.page_size})")
        self._insert_waiting(req)

    def _insert_waiting(self, req: Request):
        req.status = Status.WAITING
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].arrival > req.arrival:
            i -= 1
        self.waiting.insert(i, req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def cut_allowed(self, req: Request, length: int) -> bool:
        """Whether a prompt may be cut after `length` tokens: on the prefill_align grid, or past the prompt's
        last whole block (a block the prompt does not fill is never computed in one piece)."""
        a = self.cfg.prefill_align
        return length % a == 0 or length >= len(req.prompt) // a * a

    # ---- the plan of one step
    def schedule(self) -> list[RowPlan]:
        budget = self.cfg.max_num_batched_tokens
        plans: list[RowPlan] = []
        planned: set[str] = set()
        rows = self.cfg.max_rows_per_step or self.cfg.max_num_seqs
        for req in sorted(self.running, key=lambda r: r.arrival):
            if budget <= 0 or len(plans) >= rows:
                break
            if req.finished or req.status is not Status.RUNNING:
                continue
            if req.inflight:
                plan = self._plan_chained(req) if self.cfg.async_scheduling and req.inflight == 1 else None
            else:
                plan = self._plan_running(req, budget)
            if plan is None:
                continue
            if not self._ensure_pages(req, plan.start + len(plan.tokens), planned):
                if req.status is not Status.RUNNING:  # preempted itself
                    continue
                continue
            plans.append(plan)
            planned.add(req.request_id)
            budget -= len(plan.tokens)
        # FCFS admission (no preemption on behalf of waiting requests)
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs \
                and self.ledger.num_free_slots() > 0 and len(plans) < rows:
            req = self.waiting[0]
            plan = self._admit(req, budget)
            if plan is None:
                break
            self.waiting.pop(0)
            plans.append(plan)
            planned.add(req.request_id)
            budget -= len(plan.tokens)
        return plans

    def _chunk(self, req: Request, start: int, budget: int) -> tuple[int, Capture | None]:
        known = req.num_tokens
        if req.drafts:  # drafts kept across a preemption: the last token is verified with them (decode path)
            known -= 1
        n = min(known - start, budget)
        if self.cfg.token_kinds:  # one kind per row: up to the prompt's end, or a decode-sized generated row
            prompt = len(req.prompt)
            n = min(n, prompt - start) if start < prompt else min(n, self.cfg.token_kinds)
        fits = [b for b in self.cfg.prefill_buckets or () if b <= n]
        if fits:  # a bucket-sized chunk; a rest below the smallest bucket runs as it is, padded to that bucket
            n = fits[-1]
        cap = None
        if self.cfg.enable_prefix_caching:
            bs = self.cfg.block_size
            b = ((start + n) // bs) * bs
            if start < b < start + n and self.cut_allowed(req, b):
                n = b - start  # end chunks on the snapshot grid so the boundary state is a checkpoint column
        if start + n < known and not self.cut_allowed(req, start + n):
            a = self.cfg.prefill_align
            n = (start + n) // a * a - start  # back to the grid; 0: the budget left cannot reach it, wait a step
            if n <= 0:
                return 0, None
        if self.cfg.enable_prefix_caching and (start + n) % self.cfg.block_size == 0 \
                and self._may_snapshot(req, start + n) \
                and not self.ledger.has_snapshot(req.tokens[: start + n], req.prefix_salt(start + n)):
            cap = Capture(offset=n - 1, length=start + n)
        return n, cap

    def _plan_running(self, req: Request, budget: int) -> RowPlan | None:
        start, known = req.num_computed, req.num_tokens
        if known - start > 1:  # prefill (or recompute) chunk
            n, cap = self._chunk(req, start, budget)
            if n == 0:
                return None
            return RowPlan(req, start, tuple(req.token_slice(start, start + n)), 0, start + n == known, cap)
        limit = self.cfg.max_model_len - 1 - (start + 1)  # accepted drafts + bonus must fit
        nd = max(0, min(len(req.drafts), self.cfg.num_speculative_tokens, limit))
        if 1 + nd > budget:
            # never trim drafts to fit the step: the number verified would then depend on the other requests,
            # and with sampling so would the tokens (isolation, invariant 11). Wait for the next step instead.
            return None
        toks = (req.last_token, *req.drafts[:nd])
        return RowPlan(req, start, toks, nd, True, self._decode_capture(req, start, len(toks)))

    def _may_snapshot(self, req: Request, length: int) -> bool:
        """Whether a prefix snapshot may end after `length` tokens: anywhere, but with token kinds only inside the
        prompt (a later request reading a generated token from the cache would read it computed as generated,
        where its solo run computes it as a prompt token)."""
        return not self.cfg.token_kinds or length <= len(req.prompt)

    def _decode_capture(self, req: Request, start: int, n: int) -> Capture | None:
        """The prefix snapshot a decode row of n tokens from `start` publishes: after its last token that ends a
        block (with prefix caching), if any."""
        if self.cfg.enable_prefix_caching:
            for j in range(n - 1, -1, -1):
                if (start + j + 1) % self.cfg.block_size == 0 and self._may_snapshot(req, start + j + 1):
                    return Capture(offset=j, length=start + j + 1)
        return None

    def _plan_chained(self, req: Request) -> RowPlan | None:
        """A decode row after the request's in-flight step, whose output token (req.chain) is its input; None when
        the request may not chain (the engine left req.chain unset) or that token may end it (max_tokens, length):
        a chained row is wasted work when the request finishes at the token before it (EOS, a stop string)."""
        src = req.chain
        if src is None:
            return None
        start = src.position
        assert start == req.num_tokens, (start, req.num_tokens)  # the in-flight step samples the next token
        max_tokens = getattr(req.params, "max_tokens", None)
        if (max_tokens is not None and len(req.output) + 2 > max_tokens) or start + 2 > self.cfg.max_model_len:
            return None
        return RowPlan(req, start, (CHAINED,), 0, True, self._decode_capture(req, start, 1), src)

    def _pages_for(self, length: int) -> int:
        return -(-length // self.ledger.dims.page_size)

    def _ensure_pages(self, req: Request, length: int, planned: set[str]) -> bool:
        need = self._pages_for(length) - len(req.pages)
        while need > 0 and not self.ledger.can_allocate_pages(need):
            later = [r for r in self.running if r.arrival > req.arrival and not r.inflight
                     and r.request_id not in planned and r.status is Status.RUNNING]
            if later:  # FCFS priority: the latest arrival gives its pages back (recompute later)
                self.preempt(max(later, key=lambda r: r.arrival))
                continue
            if req.inflight or any(r is not req and r.inflight for r in self.running):
                return False  # an in-flight request cannot be preempted (its ticket holds it): wait a step
            self.preempt(req)  # the latest itself: step aside so earlier requests progress
            return False
        if need > 0:
            req.pages.extend(self.ledger.allocate_pages(need, req.request_id))
        return True

    def _admit(self, req: Request, budget: int) -> RowPlan | None:
        hit: SnapEntry | None = None
        # a request asking for prompt logprobs computes every prompt position (vLLM skips the prefix cache too)
        if self.cfg.enable_prefix_caching and getattr(req.params, "prompt_logprobs", None) is None:
            # with kept drafts the last token must stay uncomputed (it is verified together with them)
            hit = self.ledger.lookup(req.tokens[:-1] if req.drafts else req.tokens, self.cfg.block_size,
                                     req.prefix_salt, allowed=lambda length: self.cut_allowed(req, length))
        start = len(hit.tokens) if hit else 0
        if hit:
            self.ledger.acquire(hit)
        try:
            n, cap = self._chunk(req, start, budget)
            if n == 0:
                return None
            ps = self.ledger.dims.page_size
            shared = list(hit.pages[: start // ps]) if hit else []
            partial = hit.pages[start // ps] if hit and start % ps else None
            need = self._pages_for(start + n) - len(shared)
            if not self.ledger.can_allocate_pages(need):
                return None
            req.slot = self.ledger.allocate_slot(req.request_id, hit)
            if req.slot_values:  # after the reset / restore: a restored snapshot holds its publisher's values
                self.ledger.set_slot_values(req.slot, req.slot_values)
            for p in shared:
                self.ledger.share_page(p)
            own = self.ledger.allocate_pages(need, req.request_id)
            if partial is not None:
                self.ledger.copy_page(partial, own[0])  # copy-on-write of the snapshot's partial page
            req.pages = shared + own
        finally:
            if hit:
                self.ledger.release(hit)
        req.num_computed = start
        req.metrics["num_cached_tokens"] = max(req.metrics["num_cached_tokens"], start)
        req.status = Status.RUNNING
        self.running.append(req)
        known = req.num_tokens
        return RowPlan(req, start, tuple(req.token_slice(start, start + n)), 0, start + n == known, cap)

    # ---- leaving
    def preempt(self, req: Request):
        """Recompute-style preemption: drop all state; the request re-prefills prompt + output later."""
        assert not req.inflight
        self._free(req)
        req.num_computed = 0  # drafts are kept: after the recompute they are verified exactly as they would be
        req.metrics["num_preemptions"] += 1
        self.running.remove(req)
        self._insert_waiting(req)

    def finish(self, req: Request, reason: str):
        """Mark finished; resources go back only when no uncommitted ticket references them (invariant 4)."""
        if req.finished:
            return
        req.status, req.finish_reason = Status.FINISHED, reason
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        if not req.inflight:
            self._free(req)

    def retire(self, req: Request):
        """Called when a finished request's last ticket committed."""
        if req.finished and not req.inflight:
            self._free(req)

    def _free(self, req: Request):
        if req.slot is not None:
            self.ledger.release_slot(req.slot)
            req.slot = None
        if req.pages:
            self.ledger.release_pages(req.pages)
            req.pages = []
