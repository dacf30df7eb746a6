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
