"""vLLM's defaults for long prompts (issue 14 item 3): the KV page pool sized from the device memory left after
the weights (gpu_memory_utilization), the CPU fallback, the log line, a clear error for a request that can never
fit, and the LLM / `flashnext serve` defaults (max_num_batched_tokens 8192, max_model_len = the model's)."""

import argparse
import logging

import jax.numpy as jnp
import pytest

from flashnext_jax import page_pool
from flashnext_jax.engine import Engine, EngineConfig
from flashnext_jax.llm import LLM
from flashnext_jax.sampling import SamplingParams
from flashnext_jax.state_store import Leaf, StoreSpec, round_pages_down, round_pages_up
from flashnext_jax.toy_model import ToyConfig, ToyRunner

SPEC = StoreSpec(slot={"rec": Leaf((4,), jnp.float32)}, page={"k": Leaf((2, 8), jnp.bfloat16),
                                                               "v": Leaf((2, 8), jnp.bfloat16)})
PAGE_BYTES = 16 * (2 * 8 * 2) * 2  # page_size 16 x (k + v of 2 x 8 bf16)


def test_pool_from_device_memory():
    """90% of a 1 GiB device with 300 MiB in use: the pages that fit in the rest after the slot / snapshot pools,
    rounded down to 6 significant bits."""
    limit, in_use = 1 << 30, 300 << 20
    slot_bytes = 4 * 4 * (8 * 2 + 64)  # rec float32[4] x (8 slots x K1 2 + 64 snapshots)
    want = round_pages_down((int(0.9 * limit) - in_use - slot_bytes) // PAGE_BYTES)
    pool = page_pool.size_pool(SPEC, 16, 8, 64, 2, 262144, 0.9, (limit, in_use))
    assert pool.num_pages == want and want > 0.96 * (int(0.9 * limit) - in_use) // PAGE_BYTES
    assert pool.page_bytes == PAGE_BYTES and "0.90 of jax's 1.0 GiB device memory limit" in pool.source
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        page_pool.size_pool(SPEC, 16, 8, 64, 2, 4096, 1.5, (limit, in_use))


def test_pool_on_the_cpu_fallback(monkeypatch):
    """No device statistics: max_num_seqs full sequences when that is small, else capped by the host's memory."""
    pool = page_pool.size_pool(SPEC, 16, 2, 64, 2, 4096, 0.9, None)
    assert pool.num_pages == round_pages_down(256 * 2 + 2 * 256) and "max_num_seqs" in pool.source
    monkeypatch.setattr(page_pool, "host_available_bytes", lambda: 8 << 30)
    pool = page_pool.size_pool(SPEC, 16, 256, 64, 2, 262144, 0.9, None)  # 4 GiB wanted
    assert pool.num_pages == round_pages_down((2 << 30) // PAGE_BYTES) and "capped" in pool.source


def test_page_counts_round_to_six_significant_bits():
    for n in range(1, 3000):
        up, down = round_pages_up(n), round_pages_down(n)
        assert down <= n <= up and up < 1.04 * n + 1 and down > 0.96 * n - 1
        for m in (up, down):
            assert bin(m).rstrip("0").count("1") <= 6 and len(bin(m).rstrip("0")) - 2 <= 6


def test_engine_logs_its_pool_and_refuses_a_request_that_can_never_fit(caplog):
    cfg = ToyConfig(vocab_size=64, max_model_len=256)
    with caplog.at_level(logging.INFO, logger="flashnext_jax.engine"):
        eng = Engine(ToyRunner(cfg, 1), EngineConfig(max_num_seqs=2, page_size=8, min_batch_bucket=4,
                                                     min_token_bucket=4, min_pool_capacity=(4, 64, 4)))
    assert eng.cfg.num_pages == round_pages_down(32 * 2 + 2 * 32)
    assert any("KV page pool" in r.getMessage() and "concurrent sequences" in r.getMessage() for r in caplog.records)
    small = Engine(ToyRunner(cfg, 1), EngineConfig(max_num_seqs=2, page_size=8, num_pages=4, min_batch_bucket=4,
                                                   min_token_bucket=4, min_pool_capacity=(4, 64, 4)))
    with pytest.raises(ValueError, match=r"needs 40 tokens of KV cache .* at most 32 tokens"):
        small.add_request("r", list(range(1, 11)), SamplingParams(max_tokens=30))
    small.add_request("ok", list(range(1, 11)), SamplingParams(max_tokens=20))  # 30 tokens fit


def test_llm_and_serve_defaults():
    llm = LLM(ToyConfig(vocab_size=64, max_model_len=128), min_batch_bucket=4, min_token_bucket=4)
    assert llm.engine.cfg.max_num_batched_tokens == 8192 and llm.engine.cfg.max_model_len == 128
    assert llm.engine.cfg.gpu_memory_utilization == 0.9
    from serving.cli import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve"])
    assert args.max_num_batched_tokens == 8192 and args.max_model_len is None
    assert args.gpu_memory_utilization == 0.9
