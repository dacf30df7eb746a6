"""bench/real_size.py (issue 16): its forced MTP acceptance does what it says and leaves the engine as it was, and the
whole benchmark (MTP tensors, forced acceptance, profile parse, JSON summary) runs at a tiny scale on the CPU."""

import json

import numpy as np
import pytest

from bench import real_size
from flashnext_jax import sampling
from flashnext_jax.sampling import SamplingParams

ENGINE_FUNCTIONS = (sampling.verify, sampling.verify_argmax, sampling.verify_sampled)


def test_forced_acceptance_greedy_patterns():
    argmax, finite = np.array([5, 6]), np.array([True, True])
    with real_size.forced_acceptance("all"):
        assert sampling.verify_argmax(argmax, finite, [9], "r") == (1, [9, 6])
        assert sampling.verify_argmax(argmax[:1], finite[:1], [], "r") == (0, [5])  # no draft: the argmax alone
    with real_size.forced_acceptance("none"):
        assert sampling.verify_argmax(argmax, finite, [9], "r") == (0, [5])
    with real_size.forced_acceptance("alternate"):  # all, none, all, ... per request
        assert [sampling.verify_argmax(argmax, finite, [9], rid)[0] for rid in "aabab"] == [1, 0, 1, 1, 0]


def test_forced_acceptance_sampled_rows_run_the_engines_rejection_sampling():
    target = np.random.default_rng(0).standard_normal((2, 50)).astype(np.float32)
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=3)
    draft = int(np.argmin(target[0]))  # a token the real test would almost never accept
    with real_size.forced_acceptance("all"):
        m, tokens = sampling.verify(target, [draft], [None], params, [1, 2, 3], 0, "r")
    assert (m, tokens[0], len(tokens)) == (1, draft, 2)
    draft = int(np.argmax(target[0]))
    with real_size.forced_acceptance("none"):
        m, tokens = sampling.verify(target, [draft], [None], params, [1, 2, 3], 0, "r")
    assert m == 0 and tokens[0] != draft and len(tokens) == 1


def test_forced_acceptance_device_sampled_rows():
    """Rows verified on the device: the accepted drafts, then the device's token of the column after them."""
    tokens, accepted, finite = np.array([9, 4]), np.array([False]), np.array([True, True])
    with real_size.forced_acceptance("all"):  # the device rejected draft 9 (its draw 9 is a stand-in): forced in
        assert sampling.verify_sampled(tokens, accepted, finite, [9], "r") == (1, [9, 4])
    with real_size.forced_acceptance("none"):
        assert sampling.verify_sampled(np.array([7, 4]), np.array([True]), finite, [7], "r") == (0, [7])


def test_forced_acceptance_restores_the_engine_functions():
    engine_functions = lambda: (sampling.verify, sampling.verify_argmax, sampling.verify_sampled)  # noqa: E731
    with pytest.raises(RuntimeError):
        with real_size.forced_acceptance("all"):
            assert all(a is not b for a, b in zip(engine_functions(), ENGINE_FUNCTIONS))
            raise RuntimeError("a failing run")
    assert engine_functions() == ENGINE_FUNCTIONS
    with real_size.forced_acceptance(None):
        assert engine_functions() == ENGINE_FUNCTIONS


def test_tiny_run_writes_the_summary_and_forced_all_gives_two_tokens_per_step(tmp_path):
    out = tmp_path / "real_size.json"
    real_size.main(["--tiny", "--compile-threads", "2", "--async-scheduling", "--out", str(out)])
    result = json.loads(out.read_text())
    assert tuple(result["summary"]) == real_size.SUMMARY_KEYS
    assert all(v is not None for v in result["summary"].values()), result["summary"]
    rows = result["rows"]
    assert not [r for r in rows if "error" in r]
    expected = {None: 1.0, "none": 1.0, "all": 2.0, "alternate": 1.5}  # tokens per row and step
    for r in rows:
        assert r["tokens_per_step_per_row"] == pytest.approx(expected[r["pattern"]]), r
    assert {(r["engine"], r["context"], r["batch"]) for r in rows} == {
        ("plain", "4k", 1), ("plain", "4k", 2), ("plain", "32k", 1), ("plain", "32k", 2), ("mtp", "4k", 1),
        ("mtp", "4k", 2), ("async", "4k", 1), ("async", "4k", 2), ("async", "32k", 1), ("async", "32k", 2)}
    assert set(result["ratios"]["async_tokens_per_s_over_plain"]) == {
        "4k_b1_greedy", "4k_b2_greedy", "4k_b1_sampled", "4k_b2_sampled", "32k_b1_greedy", "32k_b2_greedy"}
    verify = next(r for r in rows if r["mtp"] and r["batch"] == 1 and r["sampling"] == "greedy" and r["pattern"] == "all")
    assert verify["profile"]["kernels_per_step"] > 0 and verify["acceptance"] == 1.0
    assert all(e["model_steps_compiled_in_runs"] == 0 for e in result["engines"].values())  # all precompiled
    assert (sampling.verify, sampling.verify_argmax, sampling.verify_sampled) == ENGINE_FUNCTIONS
