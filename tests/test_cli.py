"""`flashnext generate` on the embedded demo model (through the engine), and its one-line errors."""

import subprocess
import sys

import pytest

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


BASE = ["generate", "--token-ids", "5,17,230,41", "--max-new-tokens", "6", "--dtype", "float32"]
SAMPLED = BASE + ["--temperature", "0.9", "--top-k", "50", "--top-p", "0.95"]
_SEED3: list = []


def sampled_seed3() -> list[int]:
    """The tokens of one `generate *SAMPLED --seed 3` run, made once per session: every test here compares other
    runs with it (each comparison still starts its own run)."""
    if not _SEED3:
        _SEED3.append(output_ids(run(*SAMPLED, "--seed", "3")))
    return _SEED3[0]


def test_generate_samples_reproducibly_and_mtp_keeps_the_greedy_output():
    """Seeded sampling gives the same tokens twice; MTP (trained demo head: a mix of accepted and rejected drafts)
    leaves the greedy output unchanged."""
    assert output_ids(run(*SAMPLED, "--seed", "3")) == sampled_seed3()
    assert output_ids(run(*BASE, "--num-speculative-tokens", "1")) == output_ids(run(*BASE))


def test_async_scheduling_keeps_the_output():
    assert output_ids(run(*SAMPLED, "--seed", "3", "--async-scheduling")) == sampled_seed3()


@pytest.mark.slow
def test_other_seeds_sample_other_tokens_and_seeded_mtp_repeats_itself():
    """Another seed gives other tokens, and a seeded MTP run repeats itself (its rejection sampling draws from
    other streams than plain sampling: the same distribution, not the same tokens)."""
    assert output_ids(run(*SAMPLED, "--seed", "4")) != sampled_seed3()
    mtp = run(*SAMPLED, "--seed", "3", "--num-speculative-tokens", "1")
    assert float(field(mtp, "mtp_acceptance_rate")) >= 0.0
    assert output_ids(run(*SAMPLED, "--seed", "3", "--num-speculative-tokens", "1")) == output_ids(mtp)


def test_bad_input_gives_one_line_and_nonzero_exit(tmp_path):
    for args in (["generate", "--token-ids", "1,2,99999"],
                 ["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"],
                 ["generate", "--token-ids", "1,2", "--temperature", "-1"],
                 ["generate", "--token-ids", "1,2", "--top-p", "0"],
                 ["generate", "--token-ids", "1,2", "--async-scheduling", "--num-speculative-tokens", "1"]):
        proc = run(*args)
        assert proc.returncode != 0
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error:"), proc.stderr


def test_generate_uses_the_compilation_cache_and_compiles_nothing_ahead(tmp_path):
    """`generate` writes JAX's persistent cache (--compilation-cache DIR) like `serve`, and starts no background
    compile (so it never waits for one at exit); -v after the subcommand turns the engine log on."""
    cache = tmp_path / "cache"
    proc = run("generate", "--token-ids", "5,6,7", "--max-new-tokens", "3", "--dtype", "float32",
               "--compilation-cache", str(cache), "-v")
    assert proc.returncode == 0, proc.stderr
    assert any(cache.iterdir()), "no compiled program was written to the cache"
    assert "compiling the engine step" in proc.stderr  # the engine's log (-v)
    assert "background compile" not in proc.stderr


def test_cli_flags_parse_like_vllm():
    from flashnext_jax.cli import build_parser

    p = build_parser()
    assert p.parse_args(["generate", "--token-ids", "1", "-v"]).verbose
    assert p.parse_args(["-v", "generate", "--token-ids", "1"]).verbose
    assert not p.parse_args(["generate", "--token-ids", "1"]).verbose
    args = p.parse_args(["serve", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}',
                         "--api-key", "k", "--served-model-name", "m", "--max-model-len", "64",
                         "--generation-config", "vllm", "--chat-template", "{{ messages }}", "-v"])
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 1} and args.api_key == "k"
    assert args.verbose and args.served_model_name == "m" and args.max_model_len == 64


def test_help_shows_defaults_and_bad_flags_are_one_line_errors():
    help_text = run("serve", "--help").stdout
    for default in ("(default: 8000)", "(default: 127.0.0.1)", "(default: auto)", "(default: 8192)"):
        assert default in " ".join(help_text.split()), default
    assert "(default: None)" not in help_text
    assert "(default: 32)" in " ".join(run("generate", "--help").stdout.split())
    proc = run("generate", "--prompt", "")
    assert proc.returncode != 0 and proc.stderr.strip() == "error: --prompt must not be empty"
    proc = run("generate", "--token-ids", "1,2", "--max-new-tokens", "2", "--min-tokens", "3")  # (SamplingParams')
    assert proc.returncode != 0 and "min_tokens=3" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_generation_config_defaults(tmp_path):
    from serving.cli import generation_defaults

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95, "top_k": 20, '
                                                     '"max_new_tokens": 99, "do_sample": true}')
    assert generation_defaults("auto", tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                     "max_tokens": 99}
    assert generation_defaults("vllm", tmp_path) == {}
    assert generation_defaults(str(tmp_path), tmp_path / "elsewhere")["top_k"] == 20
