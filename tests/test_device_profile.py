"""bench/device_profile.py maps compiled HLO instructions to the model's named scopes (GPU time is grouped by them)."""

import jax
import jax.numpy as jnp

from bench import device_profile


def test_scope_of_paths():
    assert device_profile.scope_of("jit(run)/while/body/qsa/select/top_k") == "qsa/select"
    assert device_profile.scope_of("jit(run)/moe/dot_general") == "moe"
    assert device_profile.scope_of("jit(run)/add") == "other"
    assert device_profile.scope_of(None) == "unmapped"


def test_op_names_from_optimized_hlo(tmp_path):
    def run(x):
        with jax.named_scope("moe"):
            y = jnp.sin(x) @ x
        with jax.named_scope("qsa"), jax.named_scope("select"):
            return jax.lax.top_k(y, 4)[0]

    text = jax.jit(run).lower(jnp.ones((64, 64))).compile().as_text()
    (tmp_path / "module_0001.jit_run.cpu_after_optimizations.txt").write_text(text)
    scopes = {device_profile.scope_of(op) for op in device_profile.op_names(str(tmp_path)).values()}
    assert {"moe", "qsa/select"} <= scopes
    assert device_profile.op_names(None) == {}


def test_timeline_counts_the_device_work_of_a_trace():
    f = jax.jit(lambda x: jnp.sin(x) @ x + 1)
    x = jnp.ones((128, 128))
    f(x).block_until_ready()
    with device_profile.capture() as trace:
        for _ in range(3):
            f(x).block_until_ready()
    tl = device_profile.timeline(trace.xspace)  # on the CPU: XLA's thunks stand in for kernels
    assert tl["kernels"] >= 3 and 0 < tl["busy_ms"] <= tl["span_ms"]
    assert tl["busy_ms"] <= tl["kernel_ms"] + tl["copy_ms"] + 1e-9  # overlaps counted once
    assert device_profile.summarize(trace.xspace)["kernels"] == tl["kernels"] + tl["copies"]
