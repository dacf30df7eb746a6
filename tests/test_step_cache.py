"""Compiled engine steps are bounded in number (EngineConfig.max_compiled_steps, least recently used dropped) and
a dropped step's executable is released: the backend's live executables stay bounded while a run goes through
more step shapes than the limit, and outputs stay right (a dropped shape needed again is compiled again)."""

import gc

import jax
import jax.extend

from flashnext_jax.engine import Engine, EngineConfig
from flashnext_jax.sampling import SamplingParams
from flashnext_jax.step_cache import StepCache
from flashnext_jax.toy_model import ToyConfig, ToyRunner, solo_greedy

CFG = ToyConfig(vocab_size=64, max_model_len=64)


def _live() -> int:
    """Live executables of the engine step (the jitted function is `run`: step_cache.StepCache.compile)."""
    gc.collect()
    return sum(e.hlo_modules()[0].name == "jit_run" for e in jax.extend.backend.get_backend().live_executables())


def test_more_shapes_than_the_limit_keep_the_live_executables_bounded():
    runner = ToyRunner(CFG, 1)  # a fresh runner: its own step cache
    eng = Engine(runner, EngineConfig(max_num_seqs=1, max_model_len=64, page_size=4, compile_ahead=False,
                                      max_compiled_steps=2))
    before = _live()
    peak = 0
    # prompts of 3, 6, 12 and 24 tokens: prefill steps of 4, 8, 16, 32 tokens and decode at several widths
    for n in (3, 6, 12, 24, 3):
        prompt = [(7 * i + n) % 60 + 1 for i in range(n)]
        eng.add_request(f"r{n}-{eng.step_id}", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        while eng.has_unfinished():
            for req in eng.step():
                if req.finished:
                    assert req.output == solo_greedy(CFG, prompt, 6, ignore_eos=True)
            assert len(eng._steps) <= 2
            peak = max(peak, _live() - before)
    assert eng.counters["compiles"] > 4 and eng._steps.counters["evicted"] >= eng.counters["compiles"] - 2
    assert peak <= 2, peak
    assert _live() - before <= 2


def test_a_dropped_executable_is_released():
    calls = []

    def run(params, store, batch, targets):
        calls.append(targets)
        return store, {"y": batch * 2.0}

    cache = StepCache(run, 1)
    x = jax.numpy.ones(3)
    before = _live()
    for n in (3, 4, 5):
        args = (None, jax.numpy.zeros(1), jax.numpy.ones(n), None)
        _, out = cache.call(("k", n), args)
        assert out["y"].shape == (n,) and float(out["y"][0]) == 2.0
    del out, args
    assert cache.keys() == [("k", 5)] and cache.counters["evicted"] == 2
    assert _live() - before == 1
    cache.set_limit(0)  # at least one stays
    assert len(cache) == 1 and x is not None


def test_precompiled_decode_shapes_compile_nothing_while_decoding():
    """After Engine.precompile() (the decode shapes: every row bucket x every page-table width), greedy decoding
    of requests coming and going compiles only their prefill steps, never a decode step."""
    runner = ToyRunner(CFG, 1)
    eng = Engine(runner, EngineConfig(max_num_seqs=2, max_model_len=32, page_size=8, compile_ahead=False))
    assert eng.precompile(progress=False) == len(eng.decode_shapes()) == 2 * 3  # rows 1, 2 x widths 1, 2, 4 pages
    assert eng.precompile(progress=False) == 0
    decode = set(eng.decode_shapes())
    launched = []
    orig = eng._steps.call

    def call(key, args):
        launched.append((key, key in eng._steps))
        return orig(key, args)

    eng._steps.call = call
    prompts = [[5, 9, 3], [7, 1, 2, 8, 4, 6], [2, 2]]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=20 - 5 * i, ignore_eos=True))
    outs = {}
    while eng.has_unfinished():
        for req in eng.step():
            if req.finished:
                outs[req.request_id] = req.output
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == solo_greedy(CFG, p, 20 - 5 * i, ignore_eos=True, max_len=32)
    decode_steps = [(k, hit) for k, hit in launched if k in decode]
    assert len(decode_steps) > 20 and all(hit for _, hit in decode_steps)
    assert len({k for k, _ in decode_steps}) > 2  # several widths and row counts


def _live_samplers() -> int:
    gc.collect()
    return sum(e.hlo_modules()[0].name == "jit_choose_tokens"
               for e in jax.extend.backend.get_backend().live_executables())


def test_compiled_samplers_are_bounded_too():
    """The samplers (step_programs.choose_tokens) have an LRU of their own (EngineConfig.max_compiled_samplers)."""
    runner = ToyRunner(CFG, 1)
    eng = Engine(runner, EngineConfig(max_num_seqs=1, max_model_len=64, page_size=4, compile_ahead=False,
                                      max_compiled_samplers=2))
    before = _live_samplers()
    variants = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1),
                SamplingParams(temperature=0.8, seed=1, max_tokens=3, ignore_eos=True),
                SamplingParams(temperature=0.8, top_k=3, seed=1, max_tokens=3, ignore_eos=True),
                SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={5: 1.0})]
    for i, params in enumerate(variants):
        eng.add_request(f"r{i}", [3, 1, 4], params)
        while eng.has_unfinished():
            eng.step()
        assert len(eng._samplers) <= 2 and _live_samplers() - before <= 2
    assert eng._samplers.counters["compiled"] == 4 and eng._samplers.counters["evicted"] == 2


def test_a_dropped_runner_releases_its_executables():
    """The compiled programs live with their runner (step_programs.jitted_step): an engine and its runner dropped leave
    no live executable behind (a module-level registry once kept every runner a process had used, and a notebook
    or benchmark making engine after engine ran out of memory mappings)."""
    before = _live()
    for _ in range(2):
        runner = ToyRunner(CFG, 1)
        eng = Engine(runner, EngineConfig(max_num_seqs=1, max_model_len=64, page_size=4))
        eng.add_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        assert eng.requests["r"].output == solo_greedy(CFG, [5, 6, 7], 4, ignore_eos=True)
        assert _live() - before >= 1
        eng._ahead.wait_all()
        del eng, runner
        assert _live() == before
