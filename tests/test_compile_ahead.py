"""The engine compiles the decode step for the next page-table width in the background (compile_ahead.py), so a
request whose context outgrows its width does not stall the engine for a compile.

Evidence that the engine's own thread no longer compiles at those widths: JAX's compile log (jax_log_compiles)
records which thread compiled the step (`jit(run)`); with compile_ahead every decode width after the first is
compiled on the compile-ahead thread, without it on the engine's thread. Outputs equal the greedy reference either
way."""

import logging

import jax
import pytest

from flashnext_jax import compile_ahead
from flashnext_jax.engine import Engine, EngineConfig
from flashnext_jax.sampling import SamplingParams
from flashnext_jax.toy_model import ToyConfig, ToyRunner, solo_greedy

CFG = ToyConfig(vocab_size=64, max_model_len=64)
PROMPT = [5, 9, 3, 7, 11]


class _Compiles(logging.Handler):
    """(thread name, message) of every compile of the engine step that JAX logs."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str]] = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Compiling jit(run)"):
            self.records.append((record.threadName, msg))


@pytest.fixture
def compile_log():
    handler = _Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    old = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    yield handler
    jax.config.update("jax_log_compiles", old)
    logger.removeHandler(handler)


def _run(ahead: bool):
    runner = ToyRunner(CFG, 1)  # a fresh runner: its own jitted step, nothing compiled yet
    eng = Engine(runner, EngineConfig(max_num_seqs=1, max_model_len=64, page_size=4, compile_ahead=ahead))
    eng.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    widths, out = [], None
    while eng.has_unfinished():
        done = eng.step()
        eng._ahead.wait_all()  # let a background compile finish before the next step (a real server does not wait)
        widths.append(eng.counters["steps"])
        for req in done:
            if req.finished:
                out = list(req.output)
    return eng, out


def test_decode_widths_after_the_first_are_compiled_ahead(compile_log):
    eng, out = _run(ahead=True)
    assert out == solo_greedy(CFG, PROMPT, 40, ignore_eos=True)
    main = [m for t, m in compile_log.records if t != compile_ahead.THREAD_NAME]
    ahead = [m for t, m in compile_log.records if t == compile_ahead.THREAD_NAME]
    # 45 tokens in pages of 4: the prefill and the first decode width (2 pages) on the engine's thread; widths 4, 8
    # and 16 pages on the compile-ahead thread, before the engine needed them
    assert len(main) == 2, main
    assert len(ahead) == 3, ahead
    assert eng.counters["compiles_ahead"] == 3


def test_without_compile_ahead_the_engine_compiles_every_width(compile_log):
    eng, out = _run(ahead=False)
    assert out == solo_greedy(CFG, PROMPT, 40, ignore_eos=True)
    assert not [t for t, _ in compile_log.records if t == compile_ahead.THREAD_NAME]
    assert len(compile_log.records) == 5  # prefill + decode at 2, 4, 8, 16 pages, all on the engine's thread
    assert eng.counters["compiles_ahead"] == 0


def test_a_failed_compile_ahead_is_logged_and_left_to_the_engine(caplog):
    def broken(key, args):
        raise RuntimeError("no compiler today")

    done: set = set()
    ahead = compile_ahead.CompileAhead(broken, done.__contains__)
    with caplog.at_level(logging.WARNING, logger="flashnext_jax.engine"):
        assert ahead.request("k", lambda: (), "a test shape")
        ahead.wait_all()  # (not wait("k"): a compile that fails at once may be over before it is called)
    assert "k" not in done and "no compiler today" in ahead.failed["k"]
    assert any("background compile of the engine step for a test shape failed" in r.getMessage()
               for r in caplog.records)
    assert not ahead.request("k", lambda: (), "a test shape")  # not retried: the engine compiles it if needed
    assert not ahead.wait("k")  # nothing queued or running for it now
    assert not ahead.wait("never requested")


def test_abstract_keeps_types_not_buffers():
    x = jax.numpy.ones((3, 2), jax.numpy.bfloat16)
    a = compile_ahead.abstract({"x": x, "n": 3})
    assert isinstance(a["x"], jax.ShapeDtypeStruct) and a["x"].shape == (3, 2) and a["x"].dtype == x.dtype
    assert a["n"] == 3


def test_real_model_decode_widths_are_compiled_ahead(compile_log):
    """The same on the real (demo) model: its params (stacked layers, quantized weights) and store are abstracted
    for the background compile, and the engine's later call at each new width compiles nothing."""
    import flashnext_jax as fj
    from flashnext_jax.runner import RealRunner

    model = fj.load(dtype="float32")
    runner = RealRunner(model, 0)
    eng = Engine(runner, EngineConfig(max_num_seqs=1, max_model_len=64, page_size=4, page_table_width="bucket"))
    eng.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    out = None
    while eng.has_unfinished():
        for req in eng.step():
            if req.finished:
                out = list(req.output)
        eng._ahead.wait_all()
    assert out == model.generate(PROMPT, 20)
    main = [m for t, m in compile_log.records if t != compile_ahead.THREAD_NAME]
    ahead = [m for t, m in compile_log.records if t == compile_ahead.THREAD_NAME]
    assert len(main) == 2, main  # the prefill and the first decode width (2 pages)
    # 4, 8 and 16 pages: the request ends at 7 pages (25 tokens), so the 16-page step is compiled and never used,
    # the price of compiling ahead
    assert len(ahead) == 3, ahead


_EXIT_SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(threadName)s %(message)s")
import flashnext_jax as fj
from flashnext_jax.engine import Engine, EngineConfig
from flashnext_jax.runner import RealRunner
from flashnext_jax.sampling import SamplingParams
eng = Engine(RealRunner(fj.load(dtype="float32"), 0), EngineConfig(max_num_seqs=1, max_model_len=64, page_size=16,
                                                                  page_table_width="bucket"))
eng.add_request("r", [5, 9, 3], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
while eng.has_unfinished():
    eng.step()
assert eng.counters["compiles_ahead"] == 1
print("main thread done")
"""


def test_exit_while_compiling_ahead_waits_and_exits_cleanly(tmp_path):
    """A process that ends while the worker is compiling: the exit waits for that compile and exits with 0 (without
    the wait, the H200 run died with SIGSEGV at interpreter teardown and the CPU suite with 'FATAL: exception not
    rethrown')."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    text = out.stdout
    assert "main thread done" in text
    marks = [text.find(m) for m in ("main thread done", "waiting for a background compile", ": done in")]
    assert -1 < marks[0] < marks[1] < marks[2], text[-3000:]  # the compile outlived the main code; exit waited
