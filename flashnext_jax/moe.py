"""Mixture of experts (every layer): fp32 softmax router, top-k, renormalise, plus a sigmoid-gated shared expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import fixed_order, moe_matmul

from . import token_kinds
from .config import ModelConfig
from .layers import linear, linear_group


def route(logits: jax.Array, cfg: ModelConfig, dtype) -> tuple[jax.Array, jax.Array]:
    """Router logits [M, E] -> (expert ids [M, k] int32, weights [M, k] in dtype). Ties: lowest expert index first."""
    probs = fixed_order.softmax(logits.astype(jnp.float32), axis=-1)
    top_p, top_i = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top_p = top_p / fixed_order.tree_sum(top_p, -1, keepdims=True)
    return top_i.astype(jnp.int32), top_p.astype(dtype)


def routed_experts_reference(x, expert_ids, expert_weights, w_gate_up, w_down):
    """sum_j w[m,j] * (silu(x W_gate_e) * (x W_up_e)) W_down_e over the selected experts, by gathering their weights.

    Plain arrays only: w_gate_up [E, H, 2I] (gate columns first), w_down [E, I, H].
    """
    inter = w_down.shape[-2]
    gu_w = w_gate_up[expert_ids]  # [M, k, H, 2I]
    precision = jax.lax.Precision.HIGHEST if gu_w.dtype == jnp.float32 else None
    gu = jnp.einsum("mh,mkhn->mkn", x, gu_w, precision=precision, preferred_element_type=jnp.float32)
    gu = gu.astype(x.dtype)
    act = (jax.nn.silu(gu[..., :inter]) * gu[..., inter:]).astype(x.dtype)
    down = jnp.einsum("mki,mkih->mkh", act, w_down[expert_ids], precision=precision,
                      preferred_element_type=jnp.float32).astype(x.dtype)
    weighted = (down * expert_weights[..., None]).astype(x.dtype)
    # Add the k contributions in ascending expert id, one at a time, like the reference's per-expert index_add.
    order = jnp.argsort(expert_ids, axis=1)
    weighted = jnp.take_along_axis(weighted, order[..., None], axis=1)
    out = jnp.zeros_like(x)
    for j in range(weighted.shape[1]):
        out = out + weighted[:, j]
    return out


def routed_experts_dense(x, expert_ids, expert_weights, w_gate_up, w_down):
    """Same sum as `routed_experts_reference` (up to the order of the additions), computed by running every
    expert on every token and weighting with the sparse [M, E] routing matrix: no weight gather, so its gradient
    needs no scatter. For training (flashnext_jax.training): 7x faster forward + backward on CPU at the demo size."""
    inter = w_down.shape[-2]
    m = x.shape[0]
    combine = jnp.zeros((m, w_gate_up.shape[0]), jnp.float32).at[jnp.arange(m)[:, None], expert_ids].add(
        expert_weights.astype(jnp.float32))
    gu = jnp.einsum("mh,ehn->men", x, w_gate_up, precision="highest")
    act = jax.nn.silu(gu[..., :inter]) * gu[..., inter:]
    return jnp.einsum("mei,eih,me->mh", act, w_down, combine.astype(x.dtype), precision="highest").astype(x.dtype)


# Set by flashnext_jax.training while tracing a loss: plain-array experts then go through routed_experts_dense.
TRAINING_DENSE_EXPERTS = False


def routed_experts(x, expert_ids, expert_weights, w_gate_up, w_down, path: str = "auto"):
    if isinstance(w_gate_up, jax.Array) and TRAINING_DENSE_EXPERTS:
        return routed_experts_dense(x, expert_ids, expert_weights, w_gate_up, w_down)
    if isinstance(w_gate_up, jax.Array):
        return routed_experts_reference(x, expert_ids, expert_weights, w_gate_up, w_down)
    from pallas_kernels.moe_matmul import routed_experts as kernel  # quantized experts

    impl = "reference" if x.dtype == jnp.float32 else None  # float32 runs stay exact (kernels use bf16 operands)
    return kernel(x, expert_ids, expert_weights, w_gate_up, w_down, impl=impl, path=path)


def moe_forward(p: dict, cfg: ModelConfig, u: jax.Array) -> jax.Array:
    """u [..., H] -> routed + gated shared expert output [..., H]. In a step with token kinds (token_kinds.py)
    u is [rows, tokens, ..., H] and the generated rows' routed experts take the fixed per-pair GEMV path."""
    router_logits, shared_gate = linear_group(u, p, ("gate", "shared_expert_gate"))
    ids, weights = route(router_logits, cfg, u.dtype)
    w_gate_up, w_down = p["experts"]["gate_up_proj"], p["experts"]["down_proj"]

    def routed(path):
        def run(args):  # [rows, tokens, ..., H] (or any leading axes) -> the routed experts' output, same shape
            v, i, w = args
            y = routed_experts(v.reshape(-1, v.shape[-1]), i.reshape(-1, i.shape[-1]), w.reshape(-1, w.shape[-1]),
                               w_gate_up, w_down, path)
            return y.reshape(v.shape)
        return run

    quantized = not isinstance(w_gate_up, jax.Array)
    if quantized and token_kinds.current() is not None \
            and moe_matmul.gemv_fixed_fits(u.shape[-1], ids.shape[-1], w_gate_up, w_down):
        routed_out = token_kinds.by_kind((u, ids, weights), routed("gemv_fixed"), routed("auto"))
    else:
        routed_out = routed("auto")((u, ids, weights))
    se = p["shared_expert"]
    gate, up = linear_group(u, se, ("gate_proj", "up_proj"))
    shared = linear(jax.nn.silu(gate) * up, se["down_proj"])
    shared = jax.nn.sigmoid(shared_gate) * shared
    return routed_out + shared
