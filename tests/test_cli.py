"""`flashnext generate` on the embedded demo model (through the engine), and its one-line errors."""

import subprocess
import sys

import flashnext_jax


def run(*args):
    return subprocess.run([sys.executable, "-m", "flashnext_jax.cli", *args], capture_output=True, text=True,
                          timeout=600)


def test_generate_with_prompt_on_the_demo_model_is_deterministic_and_matches_the_api():
    proc = run("generate", "--prompt", "The quick brown fox", "--max-new-tokens", "5", "--dtype", "float32")
    prompt_ids, new_ids = eval(field(proc, "prompt_token_ids")), output_ids(proc)
    assert len(new_ids) == 5 and field(proc, "finish_reason") == "length" and "\ntext: " in proc.stdout
    assert flashnext_jax.load(dtype="float32").generate(prompt_ids, max_new_tokens=5) == new_ids


def field(proc, name):
    """One `name: value` line of the output (the text line may span lines: only the id lines are parsed)."""
    assert proc.returncode == 0, proc.stderr
    return next(line.split(": ", 1)[1] for line in proc.stdout.splitlines() if line.startswith(name + ": "))


def output_ids(proc):
    return eval(field(proc, "output_token_ids"))


def test_generate_samples_reproducibly_and_mtp_keeps_the_output():
    """Seeded sampling gives the same tokens twice and other tokens with another seed; MTP (trained demo head: a
    mix of accepted and rejected drafts) leaves the greedy output unchanged, and a seeded MTP run repeats itself (its
    rejection sampling draws from other streams than plain sampling: the same distribution, not the same tokens)."""
    base = ["generate", "--token-ids", "5,17,230,41", "--max-new-tokens", "6", "--dtype", "float32"]
    sampled = base + ["--temperature", "0.9", "--top-k", "50", "--top-p", "0.95"]
    first = output_ids(run(*sampled, "--seed", "3"))
    assert output_ids(run(*sampled, "--seed", "3")) == first
    assert output_ids(run(*sampled, "--seed", "4")) != first
    assert output_ids(run(*base, "--num-speculative-tokens", "1")) == output_ids(run(*base))
    mtp = run(*sampled, "--seed", "3", "--num-speculative-tokens", "1")
    assert float(field(mtp, "mtp_acceptance_rate")) >= 0.0
    assert output_ids(run(*sampled, "--seed", "3", "--num-speculative-tokens", "1")) == output_ids(mtp)


def test_bad_input_gives_one_line_and_nonzero_exit(tmp_path):
    for args in (["generate", "--token-ids", "1,2,99999"],
                 ["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"],
                 ["generate", "--token-ids", "1,2", "--temperature", "-1"],
                 ["generate", "--token-ids", "1,2", "--top-p", "0"]):
        proc = run(*args)
        assert proc.returncode != 0
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error:"), proc.stderr
