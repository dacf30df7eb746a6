"""End-to-end decode step of the real-size model with INT4-Mixed weights: ms per step vs the weight-streaming floor.

The model at its real shapes (48 layers: 36 GDN + 12 QSA, hidden 2560, 4 hyper streams, PLE, vocab 248,320) with
random weights in the INT4-Mixed release's quantization scheme (routed experts int4 g128; GDN / attention /
shared-expert projections int6 g64; hyper-connection mixers int8 g64; lm_head, embeddings, indexer and PLE
projections int8 g128; routers, norms, conv taps and the small in_proj_a/b dense bf16), laid out as the converter
writes it. Only the number of routed experts is cut (`--experts`, default 32 of 512) so the weights fit with room to
spare: a decode step reads top-10 experts per token and layer either way, so the bytes per step are those of the
full model. Each step is `model.forward` for B rows x 1 token on a state of `--context` tokens, jitted with the
state donated, dispatched back to back; the switch (FLASHNEXT_KERNELS, default auto) picks the kernels.

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 bench/decode_step.py     # JSON to $OUT or bench/results
  DECODE_BENCH_SMOKE=1 JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/decode_step.py  # CPU check of this script

Prints a table last: ms per step, tokens/s, weight bytes streamed per step, floor = bytes / copy bandwidth measured
in the same run, fraction of the floor reached, compile time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from bench.quant_matmul import copy_bandwidth, device_time
from bench.results_io import save_result
from flashnext_jax.config import from_hf_config
from flashnext_jax.layer_stack import build_stacked_on_host, to_host, with_stacked_layers
from flashnext_jax.model import Batch, forward, init_state
from flashnext_jax.weights import _lists, _set, expected_tensors, fuse_projections, orient, param_path
from pallas_kernels.quant_layout import PLANE_FORMATS, QuantizedWeight

SMOKE = bool(os.environ.get("DECODE_BENCH_SMOKE"))
HERE = os.path.dirname(os.path.abspath(__file__))
REAL_CONFIG = os.path.join(HERE, "..", "flashnext_jax", "reference", "qwen38_text_config.json")
DEMO_CONFIG = os.path.join(HERE, "..", "flashnext_jax", "demo_model", "config.json")

# (bits, group) per canonical tensor name, read off the INT4-Mixed checkpoint's packed widths and scale counts
# (shared/reference/real_tensors_minachist.tsv): layer and expert indices are wildcards.
SCHEME = [
    (r"layers\.\d+\.mlp\.experts\.(gate_up|down)_proj$", (4, 128)),
    (r"layers\.\d+\.linear_attn\.(in_proj_qkv|in_proj_z|out_proj)\.weight$", (6, 64)),
    (r"layers\.\d+\.self_attn\.(q|k|v|o)_proj\.weight$", (6, 64)),
    (r"layers\.\d+\.mlp\.shared_expert\.(gate|up|down)_proj\.weight$", (6, 64)),
    (r"hyper_connection(_mixer)?\.input_mix_weight_(down|up)\.weight$", (8, 64)),
    (r"self_attn\.indexer\.index_qk_proj\.weight$", (8, 128)),
    (r"ple\.(key|value)_proj\.weight$", (8, 128)),
    (r"^(lm_head|embed_tokens)\.weight$", (8, 128)),
]


def cut_config(cfg, layers: int, experts: int | None = None):
    """cfg with its first `layers` decoder layers (and the PLE layers among them) and, given `experts`, that many
    routed experts: the real model's layer kinds at a size a bench (or a test) can build."""
    layers = min(layers, cfg.num_hidden_layers)
    cfg = dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=cfg.layer_types[:layers],
                              ple_layers=tuple(p for p in cfg.ple_layers if p < layers))
    return cfg if experts is None else dataclasses.replace(cfg, num_experts=min(experts, cfg.num_experts))


def abstract_params(cfg, with_mtp: bool = False) -> dict:
    """The params `build` would draw for cfg, layers stacked as api.Model stacks them, as types only
    (jax.eval_shape): what lowering or compiling a step needs, with no weight drawn."""
    return jax.eval_shape(lambda: with_stacked_layers(build(cfg, jax.random.key(0), stack=False,
                                                            with_mtp=with_mtp)[0]))


def scheme_of(name: str):
    for pattern, bg in SCHEME:
        if re.search(pattern, name):
            return bg
    return None


def random_quantized(key, shape_in_out, bits, group) -> QuantizedWeight:
    """Random packed planes + signed scales of a logical [..., K, N] weight (any bytes are a valid weight)."""
    *lead, k, n = shape_in_out
    if k % group:  # e.g. a tiny smoke config: fall back to a group that divides K
        group = max(g for g in (16, 32, 64, 128) if k % g == 0)
    planes = []
    for width, r in PLANE_FORMATS[bits]:
        key, sub = jax.random.split(key)
        rows = k * width // 8
        dtype = jnp.int8 if bits == 8 else jnp.uint8
        planes.append(jax.random.bits(sub, (*lead, rows, n), jnp.uint8).view(dtype))
    key, sub = jax.random.split(key)
    scales = (jax.random.normal(sub, (*lead, k // group, n), jnp.float32) * 2e-3).astype(jnp.bfloat16)
    return QuantizedWeight(planes=tuple(planes), scales=scales, bits=bits, group_size=group, k=k, n=n)


def build(cfg, key, stack: bool = True, with_mtp: bool = False, mtp_quantized: bool = False):
    """Params tree of random weights in the INT4-Mixed scheme, drawn on the device, layers stacked unless
    stack=False (stacked as flashnext_jax.load does: each tensor goes to the host as it is drawn, each stack to
    the device once, layer_stack.build_stacked_on_host); and the bytes a step reads: (bytes read whatever the
    routing, bytes of one routed expert summed over all layers), of the decoder and its head (not the MTP head).

    with_mtp: the MTP head's tensors too (`params["mtp"]`), in BF16 as the INT4-Mixed release stores them
    (shared/reference/real_tensors_minachist.tsv: every `mtp.*` tensor BF16, its 512 experts per expert, ~5 GB),
    or with mtp_quantized in the scheme of the decoder's matching tensors (what a re-quantized head would read).
    The decoder's tensors are drawn from the same keys either way (the `mtp.*` names sort after them)."""
    if not stack:
        tree, always, per_expert = _draw(cfg, key, lambda x: x, with_mtp, mtp_quantized)
        return fuse_projections(tree), always, per_expert
    device, sizes = jax.devices()[0], []

    def on_host():  # returns the only reference to the per-layer tree, so that stacking can release it
        with jax.default_device(device):  # drawn on the accelerator (fast), kept on the host
            tree, *counts = _draw(cfg, key, to_host, with_mtp, mtp_quantized)
        sizes.extend(counts)
        return fuse_projections(tree)
    params = build_stacked_on_host(on_host, device)
    return params, *sizes


def _draw(cfg, key, place, with_mtp: bool = False, mtp_quantized: bool = False):
    tree: dict = {}
    always, per_expert = 0, 0
    for i, (name, shape) in enumerate(sorted(expected_tensors(cfg, with_mtp=with_mtp).items())):
        k = jax.random.fold_in(key, i)
        mtp = name.startswith("mtp.")
        bg = None if mtp and not mtp_quantized else scheme_of(name)
        if bg is not None:
            # torch [.., out, in] -> quantized [.., in, out]; the embedding [V, H] becomes [K=H, N=V] (model.embed)
            logical = tuple(shape[:-2]) + (shape[-1], shape[-2])
            value = random_quantized(k, logical, *bg)
            nbytes = sum(p.nbytes for p in value.planes) + value.scales.nbytes
        else:
            value = orient(name, (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(jnp.bfloat16))
            nbytes = value.nbytes
        if not mtp:  # the MTP head's bytes: the caller counts them (a step reads the head several times)
            if "mlp.experts." in name:
                per_expert += nbytes // cfg.num_experts
            elif name != "embed_tokens.weight":  # the embedding is a row gather, not streamed
                always += nbytes
        _set(tree, param_path(name), jax.tree.map(place, value))
    return _lists(tree), always, per_expert


def fusion_bodies(hlo: str, names, max_chars=1500):
    """For each kernel name of the profile, the fused computation XLA emitted for it (op lines, truncated), so a
    slow XLA fusion can be traced back to the model code that produced it."""
    out = {}
    for name in names:
        alias = "(" + re.escape(name) + "|" + re.escape(re.sub(r"_(\d+)$", r".\1", name)) + ")"
        m = re.search(r"%" + alias + r" = [^\n]*calls=(%[\w.\-]+)", hlo)
        if not m:
            continue
        body = re.search(re.escape(m.group(2)) + r" [^\n]*\{\n(.*?)\n\}", hlo, re.S)
        lines = [ln.strip() for ln in (body.group(1).splitlines() if body else [])]
        meta = re.findall(r'op_name="([^"]+)"', body.group(1) if body else "")
        out[name] = {"ops": "\n".join(re.sub(r", metadata=\{.*", "", ln) for ln in lines)[:max_chars],
                     "op_names": sorted(set(meta))[:12]}
    return out


def run(cfg, params, bsz, context, steps, key, hlo=True):
    dtype = jnp.bfloat16
    state = init_state(cfg, bsz, context + 64, dtype)
    n_ple = len(cfg.ple_layers)
    width = cfg.ple_embed_dim
    batches = []
    for s in range(4):  # a few distinct token sets, rotated (never one input reused by XLA)
        k = jax.random.fold_in(key, s)
        batches.append(Batch(tokens=jax.random.randint(k, (bsz, 1), 0, cfg.vocab_size, jnp.int32),
                             start=jnp.full((bsz,), context, jnp.int32), n_valid=jnp.ones((bsz,), jnp.int32),
                             ple_rows=(jax.random.normal(k, (n_ple, bsz, 1, width), jnp.float32) * 0.02
                                       ).astype(dtype)))
    step = jax.jit(lambda p, b, st: forward(p, cfg, b, st, logits_last_only=True)[::2], donate_argnums=(2,))
    t0 = time.perf_counter()
    logits, state = step(params, batches[0], state)
    jax.block_until_ready(logits)
    compile_s = time.perf_counter() - t0
    if not bool(jnp.isfinite(logits).all()):
        raise FloatingPointError("non-finite logits")
    ts = []
    for rep in range(3):
        t0 = time.perf_counter()
        for i in range(steps):
            logits, state = step(params, batches[i % len(batches)], state)
        jax.block_until_ready(logits)
        ts.append((time.perf_counter() - t0) / steps)
    profile = None
    if not SMOKE:  # where the device time goes: summed kernel durations per step, the largest kernels by name
        def one_step():
            nonlocal state
            out, state = step(params, batches[0], state)
            return out
        dev, top = device_time(one_step, reps=3, top=25)
        if dev:
            profile = {"device_ms_per_step": dev * 1e3,
                       "top_kernels_ms_per_step": {k: v * 1e3 for k, v in top.items()}}
        if dev and hlo:  # compiles the step once more (~1 min at real size)
            text = step.lower(params, batches[0], state).compile().as_text()
            profile["top_kernels_hlo"] = fusion_bodies(text, list(top)[:8])
            if os.environ.get("OUT"):  # the whole optimized HLO, to read the fusions offline
                import gzip
                with gzip.open(os.path.join(os.environ["OUT"], f"decode_step_b{bsz}.hlo.txt.gz"), "wt") as fh:
                    fh.write(text)
    return statistics.median(ts), compile_s, profile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=32, help="routed experts kept (real: 512)")
    ap.add_argument("--batch", default="1,2")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-hlo", action="store_true", help="skip the HLO of the top kernels (saves a compile)")
    args = ap.parse_args()
    with open(DEMO_CONFIG if SMOKE else REAL_CONFIG) as f:
        hf = json.load(f)
    cfg = from_hf_config(hf)
    experts = min(args.experts, cfg.num_experts)
    cfg = dataclasses.replace(cfg, num_experts=experts)
    context = 32 if SMOKE else args.context
    dev = jax.devices()[0]
    print(f"{dev.device_kind} jax {jax.__version__} kernels={os.environ.get('FLASHNEXT_KERNELS', 'auto')}", flush=True)
    bw = copy_bandwidth(64 << 20 if SMOKE else 2 << 30)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    t0 = time.perf_counter()
    params, always, per_expert = build(cfg, jax.random.key(0))
    jax.block_until_ready(params)
    print(f"built params in {time.perf_counter() - t0:.1f} s: {always / 1e9:.2f} GB always read, "
          f"{per_expert / 1e6:.2f} MB per routed expert over all layers", flush=True)
    rows = []
    for bsz in (int(b) for b in args.batch.split(",")):
        # distinct experts per layer, at most (B = 1: the real model reads the same 10 of 512)
        experts_read = min(experts, cfg.num_experts_per_tok * bsz)
        step_bytes = always + experts_read * per_expert
        row = dict(batch=bsz, context=context, experts_kept=experts, weight_bytes_per_step=step_bytes,
                   floor_ms=step_bytes / bw * 1e3)
        try:
            t, compile_s, profile = run(cfg, params, bsz, context, 2 if SMOKE else args.steps, jax.random.key(bsz),
                                        hlo=not args.no_hlo)
            row.update(ms_per_step=t * 1e3, tokens_per_s=bsz / t, frac_of_floor=step_bytes / bw / t,
                       compile_s=compile_s, **(profile or {}))
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:400]
        print(row, flush=True)
        rows.append(row)
    save_result("decode_step.json", rows, args.out, copy_bw_bytes_per_s=bw, smoke=SMOKE)
    print(f"\n{'B':>3} {'ms/step':>8} {'tok/s':>8} {'GB/step':>8} {'floor ms':>9} {'frac':>5} {'compile s':>9}")
    for r in rows:
        print(f"{r['batch']:3d} {r.get('ms_per_step', float('nan')):8.2f} {r.get('tokens_per_s', float('nan')):8.1f} "
              f"{r['weight_bytes_per_step'] / 1e9:8.2f} {r['floor_ms']:9.3f} {r.get('frac_of_floor', float('nan')):5.2f} "
              f"{r.get('compile_s', float('nan')):9.1f}")


if __name__ == "__main__":
    main()
