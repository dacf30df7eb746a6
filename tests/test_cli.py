"""`flashnext generate` on the embedded demo model, and its one-line errors."""

import subprocess
import sys

import flashnext_jax


def run(*args):
    return subprocess.run([sys.executable, "-m", "flashnext_jax.cli", *args], capture_output=True, text=True,
                          timeout=600)


def test_generate_with_prompt_on_the_demo_model_is_deterministic_and_matches_the_api():
    proc = run("generate", "--prompt", "The quick brown fox", "--max-new-tokens", "5", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(": ", 1) for line in proc.stdout.strip().splitlines())
    prompt_ids = eval(lines["prompt_token_ids"])
    output_ids = eval(lines["output_token_ids"])
    assert len(output_ids) == 5 and "text" in lines
    assert flashnext_jax.load(dtype="float32").generate(prompt_ids, max_new_tokens=5) == output_ids


def test_bad_input_gives_one_line_and_nonzero_exit(tmp_path):
    for args in (["generate", "--token-ids", "1,2,99999"], ["generate", "--model", str(tmp_path / "nope"),
                                                             "--prompt", "x"]):
        proc = run(*args)
        assert proc.returncode != 0
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error:"), proc.stderr
