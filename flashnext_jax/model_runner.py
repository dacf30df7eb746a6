"""What the engine and a model runner exchange: the step's padded batch (`Batch`, and `PackedBatch`, the form that
crosses to the device), what the host hook sees of a row (`HostRow`) and the runner's interface (`ModelRunner`).
A row of a batch means something only inside its step: the slot and generation it names are how the step reaches
a request's state (state_store.py, docs/engine-design.md)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, Protocol, Sequence

import jax
import numpy as np

from . import token_kinds
from .compile_ahead import abstract
from .state_store import StateStore, StoreSpec


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slot", "gen", "tokens", "n_valid", "start", "page_table", "host"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Batch:
    """One step's padded inputs. Row b is meaningful only inside this step; slot -1 marks a padding row."""

    slot: jax.Array  # [B] int32, -1 = padding
    gen: jax.Array  # [B] int32 generation the row was scheduled with (stale -> treated as padding)
    tokens: jax.Array  # [B, T] int32, right-padded
    n_valid: jax.Array  # [B] int32 real tokens in the row
    start: jax.Array  # [B] int32 absolute position of tokens[:, 0] (= tokens already in the slot's state)
    page_table: jax.Array  # [B, MP] int32 page ids of the row's slot, -1 = unmapped
    host: dict  # model-defined host-computed inputs from `host_prepare` (e.g. PLE n-gram rows [B, T, E])


@functools.partial(jax.tree_util.register_dataclass, data_fields=["ints", "host"],
                   meta_fields=["num_tokens", "generated_tokens"])
@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """A Batch as it crosses to the device: its integer arrays side by side in one int32 array
    [B, 5 + T + MP] = (slot, gen, n_valid, start, generated, tokens, page_table), so a step costs one host->device
    copy for them, not seven (each transfer and each jitted-call argument costs host time per step). `unpack` runs
    inside the jitted step (slices: free). `generated` (1: the row's tokens are generated tokens) and
    `generated_tokens` (> 0: the decode step's width) are the step's token kinds (token_kinds.py); 0 without."""

    ints: Any
    host: dict
    num_tokens: int
    generated_tokens: int = 0

    LEAD: ClassVar[int] = 5  # columns before the tokens; column 5 is a row's first token

    @staticmethod
    def pack(slot, gen, tokens, n_valid, start, page_table, host, generated=None,
             generated_tokens: int = 0) -> "PackedBatch":
        generated = np.zeros_like(slot) if generated is None else generated
        ints = np.concatenate([np.stack([slot, gen, n_valid, start, generated], axis=1), tokens, page_table], axis=1)
        return PackedBatch(ints.astype(np.int32), host, tokens.shape[1], generated_tokens)

    @property
    def page_table_width(self) -> int:
        return self.ints.shape[1] - self.LEAD - self.num_tokens

    def abstract_at_width(self, page_table_width: int) -> "PackedBatch":
        """This batch's types (compile_ahead.abstract) with page tables of another width: what compiling the step
        for that width needs."""
        ints = abstract(self.ints)  # the sharding only if the array is committed to a device, as jit sees it
        ints = jax.ShapeDtypeStruct((ints.shape[0], self.LEAD + self.num_tokens + page_table_width), ints.dtype,
                                    sharding=ints.sharding)
        return PackedBatch(ints, abstract(self.host), self.num_tokens, self.generated_tokens)

    def unpack(self) -> Batch:
        a, t, lead = self.ints, self.num_tokens, self.LEAD
        return Batch(slot=a[:, 0], gen=a[:, 1], tokens=a[:, lead: lead + t], n_valid=a[:, 2], start=a[:, 3],
                     page_table=a[:, lead + t:], host=self.host)

    def token_kinds(self) -> token_kinds.TokenKinds | None:
        """The kinds context its step is traced in (None: the batch carries none)."""
        if not self.generated_tokens:
            return None
        return token_kinds.TokenKinds(generated=self.ints[:, 4] == 1, tokens=self.generated_tokens,
                                      all_generated=self.num_tokens <= self.generated_tokens)


def unpacked(batch) -> tuple[Batch, token_kinds.TokenKinds | None]:
    """A step's Batch and its token kinds, from a PackedBatch (inside the jitted step) or a Batch as it is."""
    if isinstance(batch, PackedBatch):
        return batch.unpack(), batch.token_kinds()
    return batch, None


@dataclasses.dataclass(frozen=True)
class HostRow:
    """What the host hook sees of one row: a suffix of the request's tokens before `start`, the row tokens, and
    the request's images (request_images.RequestImages; None for text), whose rows the pads it covers take."""

    history: tuple[int, ...]
    start: int
    tokens: tuple[int, ...]
    images: Any = None


class ModelRunner(Protocol):
    vocab_size: int
    eos_token_id: int
    max_model_len: int
    k: int  # MTP draft tokens the model can produce per position (0 = no MTP head)
    params: Any

    def store_spec(self) -> StoreSpec: ...

    def host_prepare(self, rows: Sequence[HostRow | None], T: int) -> dict[str, np.ndarray]: ...

    def step(self, params, store: StateStore, batch: Batch) -> tuple[StateStore, dict[str, jax.Array]]:
        """Pure. Reads each live row's committed column, writes K1 checkpoint columns (column c = state after row
        token base + c, base = max(n_valid - K1, 0)), writes per-token page entries at start..start+n_valid-1,
        returns {"logits": [B, K1, V] f32 at those tail tokens, "draft_logits": [B, K1, k, V]}."""
        ...


__all__ = ["Batch", "HostRow", "ModelRunner", "PackedBatch", "unpacked"]
