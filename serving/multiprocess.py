"""`flashnext serve` with the pipeline's stages in several processes (docs/pipeline.md, "Beyond one host").

Every process runs the same engine loop over the same inputs (flashnext_jax/multihost.py), but the inputs of a
server (requests, client disconnects, the frees after a response) arrive in process 0 only, where the HTTP server
runs. So process 0's engine is a `Leader`: it records each input as the server makes it and, before each engine
step, sends the ones recorded since the last step to the other processes (`Agreement.share`: a jitted collective,
no sockets of our own), as jax-llm-examples' serving loop and sglang-jax broadcast their scheduler's inputs from
process 0. Every other process runs `follow`: apply those inputs in the same order, then step when process 0 steps.
The per-step agreement still checks that every process made process 0's decisions.

What crosses, as JSON (`StepInputs`): the requests added (id, prompt token ids, every SamplingParams field, the seed
a sampled request drew included), aborted and freed, in order; whether process 0 steps now; and, last, shutdown.
While process 0 has nothing to run it still sends an empty message every `tick_s` seconds: the other processes never
wait long inside one collective, and a failure on either side is seen within that time.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from typing import Callable

import jax

from flashnext_jax.sampling import SamplingParams
from flashnext_jax.structured_output import StructuredOutputsParams

log = logging.getLogger("flashnext_jax.serving")


def params_to_json(params: SamplingParams) -> dict:
    """Every SamplingParams field as JSON: the logit bias as [id, bias] pairs (JSON keys are strings), a grammar as
    its own fields. Python's JSON writes floats exactly (repr), so the other side gets the same numbers."""
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    out["logit_bias"] = None if params.logit_bias is None else [[t, b] for t, b in params.logit_bias.items()]
    grammar = params.structured_outputs
    out["structured_outputs"] = None if grammar is None else {
        f.name: getattr(grammar, f.name) for f in dataclasses.fields(grammar)}
    return out


def params_from_json(fields: dict) -> SamplingParams:
    fields = dict(fields)
    if fields["logit_bias"] is not None:
        fields["logit_bias"] = {int(t): b for t, b in fields["logit_bias"]}
    if fields["structured_outputs"] is not None:
        fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
    return SamplingParams(**fields)


@dataclasses.dataclass
class StepInputs:
    """What process 0 tells the others before one of its engine steps (or instead of one: a tick, the shutdown).
    `ops` in the order process 0 made them: ["add", id, prompt ids, params_to_json(...)], ["abort", id],
    ["free", id]."""

    ops: list = dataclasses.field(default_factory=list)
    step: bool = False
    shutdown: bool = False

    def encode(self) -> bytes:
        """A step with nothing new (most decode steps) is no bytes at all: `share` then sends nothing."""
        if self == StepInputs(step=True):
            return b""
        return json.dumps(dataclasses.asdict(self), allow_nan=False).encode()

    @classmethod
    def decode(cls, data: bytes) -> "StepInputs":
        return cls(**json.loads(data)) if data else cls(step=True)

    def apply(self, llm) -> None:
        """Make process 0's inputs in this process's LLM: the same calls its server made (`_add` builds the same
        stop-string checker from this process's copy of the tokenizer)."""
        for op, request_id, *rest in self.ops:
            if op == "add":
                prompt, params = rest
                llm._add(prompt, params_from_json(params), request_id)
            elif op == "abort":
                log.info("request %s aborted in process 0 (its client went away): aborted here too", request_id)
                llm.engine.abort(request_id)
            elif op == "free":
                llm._forget(request_id)
            else:
                raise ValueError(f"unknown input {op!r} from process 0")


class Leader:
    """Process 0's engine as its server sees it: installed as `llm.engine`, it passes every call to the engine and
    records the inputs (a request added, aborted, freed); `step` first shares the inputs recorded since the last
    step with the other processes. The LLM makes all of these calls under its lock, and the ticks take the same
    lock, so the inputs and the steps have one order, the one every process applies.

    `on_fault(message)`: called when a tick fails (a peer failed or went away while process 0 was idle): the
    server's fault path, which answers the requests in flight with an error and exits."""

    def __init__(self, llm, on_fault: Callable[[str], None], tick_s: float = 1.0):
        self._llm, self._engine, self._inputs = llm, llm.engine, []
        self._on_fault, self._tick_s = on_fault, tick_s
        self._last_share, self._failed = time.monotonic(), False
        self._closing = threading.Event()
        llm.engine = self
        self._ticks = threading.Thread(target=self._tick, name="flashnext-ticks", daemon=True)
        self._ticks.start()

    def __getattr__(self, name):  # the engine's other attributes (cfg, requests, usage, ...)
        return getattr(self._engine, name)

    def encode_images(self, request_id, prompt, images):
        raise ValueError("images are not served across processes")

    def add_request(self, request_id, prompt, params=None, stop_checker=None, images=None):
        if images is not None:  # pipeline stages take none (docs/vision.md); they would not cross as JSON either
            raise ValueError("images are not served across processes")
        req = self._engine.add_request(request_id, prompt, params, stop_checker=stop_checker)
        self._inputs.append(["add", request_id, req.prompt, params_to_json(req.params)])  # with its drawn seed
        return req

    def abort(self, request_id: str):
        self._engine.abort(request_id)
        self._inputs.append(["abort", request_id])

    def free_request(self, request_id: str):
        self._engine.free_request(request_id)
        self._inputs.append(["free", request_id])

    def step(self):
        self._share(StepInputs(step=True))
        try:
            return self._engine.step()
        except BaseException:
            self._failed = True  # (the engine told the peers, or they learn it from this process's exit)
            raise

    def close(self) -> None:
        """The server stopped: tell the other processes to end (unless a failure ended them already)."""
        self._closing.set()
        self._ticks.join()
        with self._llm._lock:
            if not self._failed:
                self._share(StepInputs(shutdown=True))

    def _share(self, inputs: StepInputs) -> None:
        inputs.ops, self._inputs = self._inputs, []
        try:
            settle(self._engine)
            self._engine.peers.share(inputs.encode())
        except BaseException as e:
            self._failed = True
            self._engine.peers.failed(e)  # (not when a peer's failure is what we learnt)
            raise
        self._last_share = time.monotonic()

    def _tick(self) -> None:
        while not self._closing.wait(self._tick_s):
            with self._llm._lock:
                if self._failed or time.monotonic() - self._last_share < self._tick_s:
                    continue
                try:
                    self._share(StepInputs())
                except Exception as e:  # noqa: BLE001 - the server's fault path reports it and exits
                    self._on_fault(f"{type(e).__name__}: {e}")
                    return


def settle(engine) -> None:
    """Wait until the steps in flight have their outputs. Their collectives (the hidden state's hop, the outputs'
    send) are dispatched asynchronously, and a `share` collective started while one of them still runs was seen to
    pair up with the other process's step collective (gloo: "Received data size doesn't match expected size"), so
    every process shares only once its own steps' collectives are done. The cost: a step no longer overlaps the
    previous step's later stages (docs/pipeline.md)."""
    jax.block_until_ready([item[1] for item in engine.pending if item is not None])


def follow(llm) -> dict:
    """A process > 0 of the server: process 0's inputs in, a step whenever process 0 steps, until it shuts down.
    -> how many of each input it applied, and its steps. Any failure here is told to process 0 (which answers its
    clients with an error) and raised."""
    engine, peers = llm.engine, llm.engine.peers
    done = collections.Counter()
    try:
        while True:
            settle(engine)
            inputs = StepInputs.decode(peers.share(None))
            inputs.apply(llm)
            done.update(op for op, *_ in inputs.ops)
            if inputs.shutdown:
                return dict(done)
            if inputs.step:
                engine.step()
                done["step"] += 1
    except BaseException as e:
        peers.failed(e)
        raise
