"""bench/batch_invariance.py (issue 19): its comparison sees a one-ulp logprob difference, and the whole benchmark
runs at a tiny scale on the CPU, where the batch-invariant engine must give every request its solo run's tokens and
logprobs bitwise in every case (B = 2, B = 8, prefill beside decode, a repeat)."""

import json

import numpy as np

from bench import batch_invariance


def _run(tokens, logprobs):
    return dict(tokens=tokens, logprobs=[(t, lp, ((t, lp), (7, lp - 1.0))) for t, lp in zip(tokens, logprobs)])


def test_compare_is_bitwise_and_finds_the_first_difference():
    lp = [-1.25, -0.5, -2.0]
    solo = _run([3, 4, 5], lp)
    assert batch_invariance.compare(solo, _run([3, 4, 5], list(lp))) == dict(
        tokens_equal=True, logprobs_equal=True, first_token_diff=None, first_logprob_diff=None,
        max_abs_logprob_diff=0.0, outputs=3)
    ulp = float(np.nextafter(np.float32(lp[1]), np.float32(0)))  # one float32 ulp
    c = batch_invariance.compare(solo, _run([3, 4, 5], [lp[0], ulp, lp[2]]))
    assert (c["tokens_equal"], c["logprobs_equal"], c["first_logprob_diff"]) == (True, False, 1)
    assert 0 < c["max_abs_logprob_diff"] < 1e-6
    c = batch_invariance.compare(solo, _run([3, 9, 5], lp))
    assert (c["tokens_equal"], c["first_token_diff"], c["first_logprob_diff"]) == (False, 1, 1)
    c = batch_invariance.compare(solo, _run([3, 4], lp[:2]))  # a shorter output differs at its end
    assert (c["tokens_equal"], c["first_token_diff"]) == (False, 2)


def test_tiny_run_writes_the_summary_and_the_invariant_engine_matches_solo_runs(tmp_path):
    out = tmp_path / "batch_invariance.json"
    batch_invariance.main(["--tiny", "--compile-threads", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert {"equal_tokens", "equal_logprobs", "decode_ms", "cost_invariant_over_fastest"} <= set(summary)
    modes, cases = set(batch_invariance.MODES), set(batch_invariance.CASES)
    for key in ("equal_tokens", "equal_logprobs"):
        assert set(summary[key]) == modes and all(set(v) == cases for v in summary[key].values()), summary[key]
    assert all(v > 0 for ms in summary["decode_ms"].values() for v in ms.values()), summary["decode_ms"]
    assert set(summary["cost_invariant_over_fastest"]) == {"B=1", "B=2"}
    assert all(v > 0 for v in summary["cost_invariant_over_fastest"].values())
    rows = result["rows"]
    assert not [r for r in rows if "error" in r]
    assert all(e["model_steps_compiled_in_runs"] == 0 for e in result["engines"].values())  # all precompiled
    for r in rows:  # the cases run what they say: 8 rows at once, prefill chunks beside decode rows
        if r["case"] in ("B=8", "mixed"):
            assert r["steps"]["max_rows"] == 8, r["steps"]
        if r["case"] == "mixed":
            assert r["steps"]["mixed_steps"] > 0, r["steps"]

    # the CPU guarantee (EngineConfig.batch_invariant): every request bitwise its solo run, tokens and logprobs
    bad = {case: (summary["equal_tokens"]["invariant"][case], summary["equal_logprobs"]["invariant"][case])
           for case in batch_invariance.CASES}
    assert all(t.split("/")[0] == t.split("/")[1] and lp == t for t, lp in bad.values()), bad
    invariant = [r for r in rows if r["mode"] == "invariant"]
    assert {r["case"] for r in invariant} == cases
    assert all(r["first_difference"] is None and r["max_abs_logprob_diff"] == 0 for r in invariant), invariant
