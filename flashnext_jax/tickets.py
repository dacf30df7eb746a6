"""Immutable tickets: everything deferred work needs, captured as values when a step is scheduled.

A commit that runs D steps later (pipeline delay, overlap scheduling) reads only its ticket and the outputs of
*its own* step; it never reads a batch-ordered structure that a later step rewrote. The row index in a ticket
indexes that step's outputs only; persistent state is reached through `slot` (a SlotRef with its generation).
"""

from __future__ import annotations

import dataclasses

from .state_store import SlotRef


@dataclasses.dataclass(frozen=True)
class Capture:
    """Publish a prefix snapshot of the state after row token `offset` (= after `length` tokens) if accepted."""

    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class TokenSource:
    """Where a chained row's input token is (async scheduling): column `col` of row `row` of step `step_id`'s
    outputs, the token that step chose for the request (sampled on the device, else its argmax), at absolute
    position `position`. Taken from that step's own ticket, so it names that step's outputs and nothing later."""

    step_id: int
    row: int
    col: int
    sampled: bool
    position: int


@dataclasses.dataclass(frozen=True)
class RowTicket:
    request_id: str
    slot: SlotRef
    row: int  # row of THIS step's output arrays; meaningless for any other step
    start: int  # absolute position of tokens[0]
    tokens: tuple[int, ...]  # input tokens (prefix/last token, then drafts)
    num_drafts: int
    samples: bool  # the row ends at the last known token: sample (and verify drafts)
    base: int  # output column c holds the state after token base + c
    pages: tuple[int, ...]  # page table at scheduling time
    capture: Capture | None = None
    token_from: TokenSource | None = None  # a chained row: its one input token is on the device (tokens == (-1,))

    @property
    def n(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class StepTicket:
    step_id: int
    rows: tuple[RowTicket, ...]
    batch_size: int  # padded B
    num_tokens: int  # padded T
