"""Pipeline stages of the real model (the demo model, 8 layers, float32) placed on 3 simulated CPU devices.

The checks run in one subprocess (tests/pipeline_real_check.py: XLA_FLAGS has to be set before jax is imported,
and this process keeps seeing one device). Oracles: PP=1 (the one-stage engine) and `Model.generate` (dense
state, no store); two concurrent requests of mixed lengths, MTP k=1, prefix caching, chunked prefill (6-token
budget), rows permuted every step. PP=2 runs on one page-table width (one step shape), PP=3 on the bucketed widths.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(ROOT / ".jax_cache_pp3"))  # its own cache: never two writers at once
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "pipeline_real_check.py")], capture_output=True,
                       text=True, env=env, timeout=1500)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("pp", ["2", "3"])
def test_pipeline_greedy_tokens_equal_one_stage(report, pp):
    assert report["devices"] == 3
    assert report["results"][pp]["tokens"] == report["results"]["1"]["tokens"] == report["solo"]
    assert report["results"][pp]["again"] == report["results"]["1"]["again"]
    assert report["results"][pp]["sampled"] == report["results"]["1"]["sampled"]  # the sampler on the last stage
    assert report["results"][pp]["sampled"]["samplers"] >= 1


def test_pipeline_with_token_kinds_equals_one_stage(report):
    """PP=2 with the token-kind scheduling (EngineConfig.token_kinds): the same tokens, prefix hit and sampler
    outputs as PP=1 without it."""
    kinds, one = report["token_kinds"], report["results"]["1"]
    assert kinds["tokens"] == one["tokens"] and kinds["again"] == one["again"]
    assert kinds["sampled"] == one["sampled"] and kinds["prefix_hits"] > 0


@pytest.mark.parametrize("pp", ["2", "3"])
def test_pipeline_logits_equal_one_stage_to_fp32_rounding(report, pp):
    d = report["logit_diffs"][pp]
    assert d["positions"] >= 20 and d["max_abs"] < 1e-4, d


def test_each_stage_holds_its_own_layers_state_on_its_own_device(report):
    r3 = report["results"]["3"]
    assert r3["store_devices"] == [[0], [1], [2]] and r3["param_devices"] == [[0], [1], [2]]
    assert r3["gdn_layers_per_stage"] == [3, 2, 1]  # layers 0-2 | 3-5 | 6-7 with QSA at 3 and 7
    assert report["results"]["2"]["gdn_layers_per_stage"] == [4, 2]
    assert r3["bytes_between_stages"] > 0


def test_pipeline_runs_mtp_prefix_hits_and_micro_batches(report):
    for pp in ("2", "3"):
        c = report["results"][pp]["counters"]
        assert c["drafts"] > 0 and c["steps"] > 0
        assert report["results"][pp]["prefix_hits"] > 0


def test_bad_partitions_are_one_clear_error_each(report):
    e = report["errors"]
    assert e["sum"] == "layer partition 4,3 sums to 7, the model has 8 layers"
    assert e["empty"] == "layer partition 8,0,0: stage 1 would hold no layers (every stage needs at least one)"
    assert e["devices"].startswith("pipeline_parallel_size 4 x 1 device(s) per stage needs 4 devices, 3 available")


def test_pipeline_precompile_leaves_no_compile_in_a_request(report):
    """LLM(pipeline_parallel_size=3, precompile=True) compiles every stage's program of each startup shape before
    any request (issue 14 item 4 for pipelines); the requests then compile no step and still equal the solo runs.
    The same counter counts the compiles of the pipelines run without precompile (so it is live)."""
    pc = report["precompiled"]
    assert pc["before"]["steps"] >= 2 and pc["before"]["stage_programs"] == 3, pc
    assert pc["compiles_in_requests"] == 0, pc
    assert (pc["steps_after"], pc["samplers_after"]) == (pc["before"]["steps"], pc["before"]["samplers"]), pc
    assert pc["tokens"] == report["solo"]
    assert report["results"]["3"]["counters"]["compiles"] > 0
