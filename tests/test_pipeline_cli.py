"""`flashnext generate --pipeline-parallel-size N --pp-layer-partition ...`: runs as stages, bad values are one line."""

import os
import subprocess
import sys
from pathlib import Path

from flashnext_jax.cli import main

ROOT = Path(__file__).parents[1]


def _generate(*extra, devices=1):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip(),
               JAX_COMPILATION_CACHE_DIR=str(ROOT / f".jax_cache_cli{devices}"))
    return subprocess.run([sys.executable, "-m", "flashnext_jax.cli", "generate", "--token-ids", "5,9,2,7,1",
                           "--max-new-tokens", "6", "--dtype", "float32", *extra], capture_output=True, text=True,
                          env=env, timeout=900)


def test_generate_with_two_stages_prints_the_one_stage_tokens():
    one = _generate()
    two = _generate("--pipeline-parallel-size", "2", "--pp-layer-partition", "3,5", devices=2)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    line = [x for x in one.stdout.splitlines() if x.startswith("output_token_ids")]
    assert line and line == [x for x in two.stdout.splitlines() if x.startswith("output_token_ids")]


def test_more_stages_than_devices_is_one_line_error(capsys):
    assert main(["generate", "--token-ids", "1,2", "--pipeline-parallel-size", "2", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs 2 devices, 1 available" in err[0], err


def test_bad_partition_is_one_line_error(capsys):
    assert main(["generate", "--token-ids", "1,2", "--pipeline-parallel-size", "2", "--pp-layer-partition", "3,4",
                 "--dtype", "float32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: layer partition 3,4 sums to 7, the model has 8 layers"], err


def test_converted_per_stage_directories_load_as_stages(tmp_path):
    """flashnext-convert --pp-partition 5,3 writes stage_0/ and stage_1/; both load into a 2-stage pipeline."""
    from convert import convert
    from flashnext_jax.api import DEMO_MODEL

    dst = tmp_path / "demo_pp"
    convert(str(DEMO_MODEL), str(dst), pp_partition=[5, 3], progress=False)
    assert (dst / "stage_0").is_dir() and (dst / "stage_1").is_dir()
    one = _generate()
    two = _generate("--model", str(dst), "--pipeline-parallel-size", "2", "--pp-layer-partition", "5,3", devices=2)
    assert two.returncode == 0, two.stderr[-2000:]
    assert [x for x in one.stdout.splitlines() if x.startswith("output_token_ids")] == \
        [x for x in two.stdout.splitlines() if x.startswith("output_token_ids")]
