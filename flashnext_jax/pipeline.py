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
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any

import jax

from pallas_kernels import fixed_order

from .engine import PackedBatch, model_step
from .stages import StagePlan


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
        self.params = tuple(jax.device_put(runner.stage_params(st.layers), st.sharding) for st in plan.stages)
        self.shapes_seen: set = set()
        self.bytes_between_stages = 0  # hidden states sent from a stage to the next (device_put payloads)
        self.timeline = StageTimeline(plan.size) if profile else None
        self._steps = None
        self._jits = []
        for st in plan.stages:
            fn = _StageFn(runner, st.layers)
            if st.index == plan.size - 1:  # the engine's sampler runs after it, on the same devices
                fn = model_step(fn, getattr(runner, "logits", None))
            options = fixed_order.compiler_options(batch_invariant)
            self._jits.append(jax.jit(fn, donate_argnums=(1,), compiler_options=options))

    # ---- the ModelRunner protocol
    def store_spec(self):
        return tuple(self.base.store_spec(st.layers) for st in self.plan.stages)

    def host_prepare(self, rows, T: int):
        return self.base.host_prepare(rows, T)

    def steps(self) -> "PipelineSteps":
        """What the engine holds in place of its StepCache (engine.jitted_step): one per pipeline."""
        if self._steps is None:
            self._steps = PipelineSteps(self)
        return self._steps

    def pipeline_step(self, params, stores, batch, prompt_targets=None):
        """One micro-batch through every stage (asynchronously dispatched): -> (new stores, last stage's outputs:
        engine.model_step's)."""
        with fixed_order.batch_invariant(self.batch_invariant):  # a stage traced here keeps this mode
            return self._launch(params, stores, batch, prompt_targets)

    def _launch(self, params, stores, batch, prompt_targets):
        x, new, last = None, [], self.plan.size - 1
        for st, p, store, fn in zip(self.plan.stages, params, stores, self._jits, strict=True):
            names = self.base.stage_host_inputs(st.layers)
            b = jax.device_put(dataclasses.replace(batch, host={n: batch.host[n] for n in names}), st.sharding)
            if st.index == last:
                pt = None if prompt_targets is None else jax.device_put(prompt_targets, st.sharding)
                store, out = fn(p, store, b, pt, x)
            else:
                store, x = fn(p, store, b, x)
                if self.timeline is not None:
                    self.timeline.launched(st.index, x)
                x = jax.device_put(x, self.shardings[st.index + 1])
                self.bytes_between_stages += x.nbytes
            new.append(store)
        if self.timeline is not None:
            self.timeline.launched(last, out["logits"])
        return tuple(new), out

    def step(self, params, store, batch):
        raise TypeError("a PipelineRunner runs through pipeline_step (one jitted step per stage)")


@dataclasses.dataclass(frozen=True)
class _StageFn:
    """runner.stage_step for one layer range, as a hashable callable jit can take (PackedBatch unpacked inside)."""

    runner: Any
    layers: range

    def __call__(self, params, store, batch, x=None, all_positions=False):
        if isinstance(batch, PackedBatch):
            batch = batch.unpack()
        return self.runner.stage_step(params, store, batch, x, self.layers, all_positions)

    def __hash__(self):
        return hash((id(self.runner), self.layers))


class PipelineSteps:
    """The engine's StepCache interface (step_cache.py) for its model steps over a PipelineRunner (its samplers are
    the engine's own StepCache, on the last stage's devices). Each stage's own `jax.jit` compiles a shape on its
    first call and keeps its executables, so `compile` (startup precompile, compile ahead) does nothing yet and the
    LRU bound does not apply to pipelines (docs/pipeline.md, "Not yet")."""

    def __init__(self, runner: "PipelineRunner"):
        self.runner, self.limit = runner, 0
        self.counters: collections.Counter = collections.Counter()

    def __contains__(self, key) -> bool:
        return key in self.runner.shapes_seen

    def __len__(self) -> int:
        return len(self.runner.shapes_seen)

    def keys(self) -> list:
        return list(self.runner.shapes_seen)

    def set_limit(self, limit: int):
        self.limit = limit

    def compile(self, key, args):
        return None

    def get(self, key):
        return None

    def call(self, key, args):
        if key not in self.runner.shapes_seen:
            self.runner.shapes_seen.add(key)
            self.counters["compiled"] += 1
        return self.runner.pipeline_step(*args)


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
