"""The isolation state machine and soak with the toy model as a 3-stage pipeline (docs/pipeline.md).

Same oracles as test_engine_toy.py (every committed state, page and snapshot equals the pure-Python fold after
every step, free and null slots poisoned, every request equals its solo run), plus: every stage's store holds the
same cursors and generations (invariant 10: the same commits in the same order). The stages share this process's
one device (separate stores, params and jitted steps; placement on several devices is test_pipeline.py's); up to
three micro-batches are in flight (pipeline_delay 2..3, a micro-batch capped at 1..slots rows).
"""

import dataclasses
import random

import jax
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule, run_state_machine_as_test

from flashnext_jax.engine import Engine, EngineConfig
from flashnext_jax.pipeline import PipelineRunner, make_pipeline
from flashnext_jax.stages import StagePlan
from flashnext_jax.toy_model import ToyRunner, solo_greedy
from state_machine import STEPS, EngineMachine
from test_engine_toy import CFG, MAX_LEN, SHAPES, Harness

DEV = jax.devices()[0]
PIPES = {k: PipelineRunner(ToyRunner(CFG, k), StagePlan.build(CFG.num_layers, 3, devices=[DEV] * 3))
         for k in (1, 2)}


class PipeHarness(Harness):
    """Harness with the engine on the 3-stage toy pipeline; solo runs stay on the one-stage toy."""

    def __init__(self, D, k, block, page, slots, budget, prefix, seed, tight_pages, rows):
        self.rows = rows
        super().__init__(D, k, block, page, slots, budget, prefix, seed, tight_pages)

    def build_engine(self, runner: int, cfg: EngineConfig) -> Engine:
        """The harness's engine config (no async scheduling here: runner = max(k, 1)), on the 3-stage pipeline, a
        micro-batch capped at `rows` rows."""
        return Engine(PIPES[runner], dataclasses.replace(cfg, max_rows_per_step=self.rows), draft_hook=self.hook)


class PipeMachine(EngineMachine):
    @initialize(D=st.integers(2, 3), k=st.sampled_from([0, 1, 1, 2]), block=st.integers(2, 5),
                page=st.sampled_from([2, 4]), slots=st.integers(1, 3), budget=st.integers(3, 12),
                prefix=st.booleans(), seed=st.integers(0, 2**16), tight=st.booleans(), rows=st.integers(1, 3))
    def setup(self, D, k, block, page, slots, budget, prefix, seed, tight, rows):
        self.h = PipeHarness(D, k, block, page, slots, budget, prefix, seed, tight, rows)

    @rule(m=st.integers(0, 5), delta=st.sampled_from([-1, 0, 0, 1]), corpus=st.integers(0, 1),
          mutate=st.booleans(), max_tokens=st.integers(1, 12), ignore_eos=st.booleans(),
          stop=st.one_of(st.none(), st.integers(1, 63)), seed=st.one_of(st.none(), st.none(), st.integers(0, 99)))
    def arrive(self, m, delta, corpus, mutate, max_tokens, ignore_eos, stop, seed):
        self.h.add(self.h.prompt(m, delta, corpus, mutate), max_tokens, ignore_eos, stop, seed)


def _run_machine(examples, steps, floor):
    start = STEPS["n"]
    run_state_machine_as_test(PipeMachine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck)))
    assert STEPS["n"] - start >= floor, STEPS["n"] - start


def test_pipeline3_machine_2000_steps():
    _run_machine(110, 25, 2000)


@pytest.mark.slow
def test_pipeline3_machine_10000_steps():
    _run_machine(450, 40, 10000)


def test_pipeline3_greedy_equals_solo_with_micro_batches_in_flight():
    """Two requests, one micro-batch each, three stages: bubbles are counted and tokens equal the solo fold."""
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12]]
    eng = Engine(PIPES[1], EngineConfig(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=MAX_LEN,
                                        num_speculative_tokens=1, enable_prefix_caching=True, block_size=2,
                                        page_size=2, pipeline_delay=2, max_rows_per_step=1, **SHAPES))
    from flashnext_jax.sampling import SamplingParams

    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    for i, p in enumerate(prompts):
        assert eng.requests[f"r{i}"].output == solo_greedy(CFG, p, 10, max_len=MAX_LEN, ignore_eos=True)
    assert eng.counters["bubbles"] > 0 and eng.counters["steps"] > 0


def test_more_stages_than_layers_is_one_clear_error():
    with pytest.raises(ValueError, match="would hold no layers|sums to"):
        make_pipeline(ToyRunner(CFG, 1), 4, devices=[DEV] * 4)
