"""A ModelRunner that runs its model as a pipeline of stages (docs/pipeline.md).

`PipelineRunner(runner, plan)` takes a runner whose step can run a range of layers (`stage_step`, `store_spec(
layers)`, `stage_params(layers)`: RealRunner and ToyRunner) and a `stages.StagePlan`. Each stage gets its own
params (its layers only; stage 0 the embeddings, the last stage the final mixer, lm_head and MTP), its own state
store (its layers' state; the engine's one `StoreLedger` addresses every stage's store with the same indices and
applies each queued device op to all of them in order), and its own jitted step on its own devices. One engine
step launches the micro-batch through every stage: stage s's jitted call, then `jax.device_put` of its hidden
state to stage s + 1's sharding. JAX dispatch is asynchronous, so the host loop goes on to launch the next
micro-batch while the devices work: with `pipeline_delay = stages - 1` up to `stages` micro-batches are in flight,
each with its own ticket, committed once on the host (the accepted-draft count reaches every stage through the
ledger's queued cursor op, never through a table or a batch row).

Stages may sit on the devices of several processes, one per host (multihost.py): each process runs the stages it
holds, hands the hidden state to another process's stage through a collective, and gets the last stage's outputs
the same way; the stages it does not hold are only their types here.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from typing import Any, NamedTuple

import jax

from pallas_kernels import fixed_order

from . import token_kinds
from .compile_ahead import abstract
from .host_outputs import crossing_outputs
from .model_runner import unpacked
from .multihost import Send, owned
from .stages import StagePlan, StagePlanError
from .step_cache import CompiledLRU
from .step_programs import model_step

log = logging.getLogger(__name__)


class PipelineRunner:
    """The engine's ModelRunner over a StagePlan. `profile=True` records when each stage finished each micro-batch
    (a waiter thread per stage) for `StageTimeline.idle_fractions`. `batch_invariant`: the mode every stage's
    program is traced and compiled in (pallas_kernels/fixed_order.py; the engine's config must agree)."""

    def __init__(self, runner, plan: StagePlan, profile: bool = False, batch_invariant: bool = True):
        if plan.num_layers != runner.num_layers:
            raise ValueError(f"the stage plan covers {plan.num_layers} layers, the model has {runner.num_layers}")
        self.base, self.plan = runner, plan
        self.vocab_size, self.eos_token_id = runner.vocab_size, runner.eos_token_id
        self.max_model_len, self.k = runner.max_model_len, runner.k
        self.num_stages = plan.size
        self.batch_invariant = batch_invariant
        self.shardings = tuple(st.sharding for st in plan.stages)
        # stages on other processes' devices (multihost.py): this process holds only their types
        self.local = tuple(owned(st.devices) for st in plan.stages)
        self.multiprocess = jax.process_count() > 1
        self.params = tuple(jax.device_put(runner.stage_params(st.layers), st.sharding) if here else
                            _placed(runner.stage_params(st.layers), st.sharding)
                            for st, here in zip(plan.stages, self.local))
        # where the engine finds a step's outputs (its samplers run there): the last stage, or with several
        # processes each process's own device that the last stage's outputs are sent to
        self.output_devices = _output_devices(plan) if self.multiprocess else ()
        self.holds_outputs = self.local[-1]  # the last stage's outputs are here (its samplers run here)
        self.output_sharding = self.shardings[-1] if self.holds_outputs else jax.sharding.SingleDeviceSharding(
            next(d for d in self.output_devices if d.process_index == jax.process_index()))
        self._sends: dict = {}  # the outputs' compiled collectives by the types that cross (output_send)
        self._sends_lock = threading.Lock()
        # per shared step (share_outputs): the names of the outputs that crossed and their bytes
        self.outputs_sent: collections.deque = collections.deque(maxlen=256)
        self.shapes_seen: set = set()
        self.bytes_between_stages = 0  # hidden states sent from a stage to the next (device_put payloads)
        self.timeline = StageTimeline(plan.size) if profile else None
        self._steps = None
        self._fns, self._jits = [], []
        for st in plan.stages:
            fn = _StageFn(runner, st.layers)
            if st.index == plan.size - 1:  # the engine's sampler runs after it, on the same devices
                fn = model_step(fn, getattr(runner, "logits", None))
            options = fixed_order.compiler_options(batch_invariant)
            self._fns.append(fn)
            self._jits.append(jax.jit(fn, donate_argnums=(1,), compiler_options=options))

    # ---- the ModelRunner protocol
    def store_spec(self):
        return tuple(self.base.store_spec(st.layers) for st in self.plan.stages)

    def host_prepare(self, rows, T: int):
        return self.base.host_prepare(rows, T)

    def steps(self) -> "PipelineSteps":
        """What the engine holds in place of its StepCache (step_programs.jitted_step): one per pipeline."""
        if self._steps is None:
            self._steps = PipelineSteps(self)
        return self._steps

    def pipeline_step(self, params, stores, batch, prompt_targets, programs: "StagePrograms"):
        """One micro-batch through every stage (asynchronously dispatched) with the stages' compiled executables
        for these argument types (`compile_programs`): -> (new stores, last stage's outputs: those of
        step_programs.model_step)."""
        return self._launch(params, stores, batch, prompt_targets, programs)

    def compile_programs(self, args: tuple) -> "StagePrograms":
        """Compile every stage's program for the engine's step arguments `args` = (params, stores, batch,
        prompt_targets), arrays or their types (compile_ahead.abstract), without running anything: stage s's
        hidden-state input is stage s-1's compiled output type placed on stage s's devices, as `_launch` passes it.
        A stage on another process's devices is not compiled here, only traced for its output types. With stages
        in several processes, also the collectives this process takes part in (each hop across processes, the last
        stage's outputs to every process): they too are programs per shape, so a precompiled step compiles nothing
        in a request."""
        params, stores, batch, targets = args
        x, programs, store_types, hops, last = None, [], [], [], self.plan.size - 1
        with fixed_order.batch_invariant(self.batch_invariant):
            for st, p, store, jitted in zip(self.plan.stages, params, stores, self._jits, strict=True):
                b = _placed(self._stage_batch(batch, st), st.sharding)
                x = None if x is None else _placed(x, st.sharding)
                if st.index == last:
                    pt = None if targets is None else _placed(targets, st.sharding)
                    stage_args = (p, store, b, pt, x)
                else:
                    stage_args = (p, store, b, x)
                if self.local[st.index]:
                    compiled = jitted.lower(*stage_args).compile(fixed_order.compiler_options(self.batch_invariant))
                    store_type, out = compiled.out_info
                else:
                    compiled, (_, out) = None, jax.eval_shape(self._fns[st.index], *stage_args)
                    store_type = store
                programs.append(compiled)
                store_types.append(store_type)
                if st.index != last:
                    x = out
                    hops.append(self._hop(out, st.index))
        if self.multiprocess:
            # compiled now and kept by output_send: a greedy step's outputs to every process (the engine compiles
            # the other sets it sends: the samplers' outputs, the raw logits)
            self.output_send(crossing_outputs(out, host_logits=False))
        return StagePrograms(tuple(programs), (tuple(store_types), out), tuple(hops))

    def output_send(self, like: dict) -> Send:
        """The compiled collective that sends outputs of the types `like` (name -> array type) from the last
        stage's process to every process: compiled once per set of types (a step key's greedy set in
        compile_programs, the sampler's and the logits' sets where the engine precompiles or first needs them)."""
        sig = tuple((n, tuple(t.shape), str(t.dtype)) for n, t in sorted(like.items()))
        with self._sends_lock:
            send = self._sends.get(sig)
            if send is None:
                types = {n: jax.ShapeDtypeStruct(t.shape, t.dtype) for n, t in like.items()}
                send = self._sends[sig] = Send(types, self.output_devices,
                                               self.output_devices.index(self.plan.stages[-1].devices[0]))
            return send

    def share_outputs(self, out: dict | None, like: dict) -> dict:
        """With stages in several processes, called by every process at the same point of its step (after the
        samplers, which run in the last stage's process only): the outputs named in `like` (of those types) from
        the last stage's process to every other. The last stage's process keeps all of its outputs (`out`, the raw
        logits included); the others get the crossing ones only."""
        send = self.output_send(like)
        got = send({n: out[n] for n in like} if self.holds_outputs else None)
        self.outputs_sent.append((tuple(sorted(like)), sum(math.prod(t.shape) * t.dtype.itemsize
                                                            for t in send.types)))
        return out if self.holds_outputs else got

    def _hop(self, like, s: int) -> Send | None:
        """The compiled collective that hands stage s's hidden state (of types `like`) to stage s + 1 in another
        process, from the first device of one to the first of the other; None where no collective runs here (both
        stages in this process: a device_put; neither)."""
        if self.local[s] == self.local[s + 1]:
            return None
        return Send(like, (self.plan.stages[s].devices[0], self.plan.stages[s + 1].devices[0]), 0)

    def _stage_batch(self, batch, st):
        """The batch a stage takes: only the host-gathered inputs it reads (PLE rows: the PLE layers' stage)."""
        names = self.base.stage_host_inputs(st.layers)
        return dataclasses.replace(batch, host={n: batch.host[n] for n in names})

    def _launch(self, params, stores, batch, prompt_targets, programs):
        x, out, new, last = None, None, [], self.plan.size - 1
        for st, p, store, fn in zip(self.plan.stages, params, stores, programs.stages, strict=True):
            if self.local[st.index]:
                b = jax.device_put(self._stage_batch(batch, st), st.sharding)
                if st.index == last:
                    pt = None if prompt_targets is None else jax.device_put(prompt_targets, st.sharding)
                    store, out = fn(p, store, b, pt, x)
                else:
                    store, x = fn(p, store, b, x)
                    if self.timeline is not None:
                        self.timeline.launched(st.index, x)
            if st.index != last:
                x = self._hand_over(x, st.index, programs.hops[st.index])
            new.append(store)
        if self.timeline is not None and self.local[last]:
            self.timeline.launched(last, out["logits"])
        # with stages in several processes the engine sends what the host loops read (share_outputs); None in a
        # process without the last stage
        return tuple(new), out

    def _hand_over(self, x, s: int, hop: Send | None):
        """Stage s's hidden state to stage s + 1's devices: a device_put within a process; across processes the
        compiled collective `hop`, which both processes call (the receiver passing nothing); None in a process
        holding neither stage."""
        here, there = self.local[s], self.local[s + 1]
        if here:
            self.bytes_between_stages += sum(a.nbytes for a in jax.tree.leaves(x))
        if here and there:
            return jax.device_put(x, self.shardings[s + 1])
        if not (here or there):
            return None
        y = hop(x if here else None)
        return jax.device_put(y, self.shardings[s + 1]) if there else None

    def step(self, params, store, batch):
        raise TypeError("a PipelineRunner runs through pipeline_step (one jitted step per stage)")


@dataclasses.dataclass(frozen=True)
class _StageFn:
    """runner.stage_step for one layer range, as a hashable callable jit can take (PackedBatch unpacked inside)."""

    runner: Any
    layers: range

    def __call__(self, params, store, batch, x=None, all_positions=False):
        batch, kinds = unpacked(batch)
        with token_kinds.token_kinds(kinds):
            return self.runner.stage_step(params, store, batch, x, self.layers, all_positions)

    def __hash__(self):
        return hash((id(self.runner), self.layers))


class StagePrograms(NamedTuple):
    """One step shape's compiled executables, one per stage (None: a stage of another process), and the types of
    what the step returns: out_info = (the stages' stores, the last stage's outputs), as a compiled single
    program's `out_info` (the engine compiles its samplers for those logits). With stages in several processes,
    the step's compiled collectives (multihost.Send): `hops[s]` hands stage s's hidden state to stage s + 1 when
    one of the two is this process's and the other is not (else None). (The last stage's outputs cross through
    PipelineRunner.output_send, compiled here for a greedy step's set and kept there by types.)"""

    stages: tuple
    out_info: tuple
    hops: tuple = ()


def _output_devices(plan: StagePlan) -> tuple:
    """One device per process, in process order: the device of its last stage, or its first device if it holds
    none. The last stage's outputs are sent to these (multihost.Send)."""
    per_process = {d.process_index: d for d in jax.devices()[::-1]}  # each process's first device
    for st in plan.stages:
        if len({d.process_index for d in st.devices}) != 1:
            raise StagePlanError(f"stage {st.index}'s devices belong to several processes: a stage must be one "
                                 "process's (one host's)")
        per_process[st.devices[0].process_index] = st.devices[0]
    return tuple(per_process[p] for p in sorted(per_process))


def _placed(tree, sharding):
    """Array types of `tree` (compile_ahead.abstract's) placed on `sharding`: what device_put(tree, sharding) gives."""
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding, weak_type=getattr(a, "weak_type", False)),
        abstract(tree))


class PipelineSteps(CompiledLRU):
    """The engine's StepCache interface (step_cache.py) for its model steps over a PipelineRunner: per step key the
    stages' compiled executables (`PipelineRunner.compile_programs`), least recently used dropped past `limit`, so
    startup precompile, compile ahead and the LRU bound work as for one program. (The engine's samplers are its
    own StepCache, on the last stage's devices.)"""

    def __init__(self, runner: "PipelineRunner"):
        super().__init__(32, "pipeline step")
        self.runner = runner

    def compile(self, key, args) -> StagePrograms:
        """Compile every stage's program for `key` (args: arrays or their types), unless it is cached."""
        hit = self.get(key)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        programs = self.runner.compile_programs(abstract(args))
        log.info("compiled %d pipeline stages in %.1f s", len(programs.stages), time.perf_counter() - t0)
        self.runner.shapes_seen.add(key)
        return self._keep(key, programs)

    def call(self, key, args):
        programs = self.get(key) or self.compile(key, args)
        return self.runner.pipeline_step(*args, programs=programs)


class StageTimeline:
    """When each stage finished each micro-batch (one waiter thread per stage blocks on its outputs in launch order).

    Stage s works on micro-batch m from max(launch, stage s-1 done with m, stage s done with m-1) until it is done
    with m; its idle fraction is 1 - busy / (last done - first launch). An estimate from completion times (a stage
    that waits for its input counts as idle), what `bench/pp_gpus.py` reports."""

    def __init__(self, num_stages: int):
        self.n = num_stages
        self.events: list[list[tuple[float, float]]] = [[] for _ in range(num_stages)]  # (launch, done) per mb
        self._queues = [collections.deque() for _ in range(num_stages)]
        self._cv = threading.Condition()
        self._pending = 0
        for s in range(num_stages):
            threading.Thread(target=self._wait, args=(s,), daemon=True, name=f"stage-{s}-timeline").start()

    def launched(self, stage: int, out):
        with self._cv:
            self._queues[stage].append((time.perf_counter(), out))
            self._pending += 1
            self._cv.notify_all()

    def _wait(self, s: int):
        while True:
            with self._cv:
                while not self._queues[s]:
                    self._cv.wait()
                t0, out = self._queues[s].popleft()
            jax.block_until_ready(out)
            done = time.perf_counter()
            with self._cv:
                self.events[s].append((t0, done))
                self._pending -= 1
                self._cv.notify_all()

    def drain(self):
        with self._cv:
            while self._pending:
                self._cv.wait()

    def idle_fractions(self) -> list[float]:
        self.drain()
        if not self.events[0]:
            return [0.0] * self.n
        begin = min(t0 for t0, _ in self.events[0])
        end = max(d for ev in self.events for _, d in ev)
        out = []
        for s in range(self.n):
            busy, prev_done = 0.0, begin
            for m, (t0, done) in enumerate(self.events[s]):
                start = max(t0, prev_done, self.events[s - 1][m][1] if s else t0)
                busy += max(done - start, 0.0)
                prev_done = done
            out.append(1.0 - busy / max(end - begin, 1e-9))
        return out


def schedule_idle_fractions(launched: list[bool], num_stages: int) -> list[float]:
    """Idle fraction of each stage from the engine's launch record alone (one tick per engine step, each stage
    one tick per micro-batch): stage s is busy at tick t iff a micro-batch was launched at tick t - s."""
    ticks = len(launched) + num_stages - 1
    busy = sum(launched)
    return [1.0 - busy / ticks if ticks else 0.0 for _ in range(num_stages)]


def make_pipeline(runner, pipeline_parallel_size: int, pp_layer_partition=None, devices=None,
                  profile: bool = False, batch_invariant: bool = True) -> PipelineRunner:
    plan = StagePlan.build(runner.num_layers, pipeline_parallel_size, pp_layer_partition, devices)
    return PipelineRunner(runner, plan, profile=profile, batch_invariant=batch_invariant)


__all__ = ["PipelineRunner", "StageTimeline", "make_pipeline", "schedule_idle_fractions"]
