"""Image input at the real size (issue 21): the vision tower's time for one 1024x1024 image, and the TTFT of an
image chat through the real engine.

The release's tower (depth 27, 1152 wide, 16 heads, 16x16 patches of 2 frames, 2x2 merge, out 2560:
../shared/docs/model-spec.md) with random bf16 weights, preprocessing with the release's processor values (mean =
std = 0.5, bicubic, 1/255, 65,536 .. 16,777,216 pixels). A 1024x1024 image is 64x64 = 4,096 patches and 1,024 pad
tokens. Reported:
- the tower alone (`request_images.bucketed_embeddings`, the engine's path: host -> device -> rows on the host),
  median of `--repeats` runs after one compile, and the host preprocessing (resize, normalise, patchify);
- an image chat (vision start, 1,024 pads, vision end, `--text` random text tokens) through `LLM` over the real
  config with random INT4-Mixed weights and all 512 experts (`decode_step.build`, as bench/long_context.py):
  TTFT of a first request (it compiles the tower and the image step), of a second one with another image, and of
  a text prompt of the same length (the text step) for comparison.

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 bench/vision.py        # one H200
  VISION_BENCH_SMOKE=1 JAX_PLATFORMS=cpu PYTHONPATH=. python3 bench/vision.py --out /tmp/v.json   # CPU check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from bench import decode_step
from bench.engine_step import RandomPleRunner
from bench.results_io import save_result
from flashnext_jax import api
from flashnext_jax.config import from_hf_config
from flashnext_jax.llm import LLM
from flashnext_jax.request_images import bucketed_embeddings
from flashnext_jax.sampling import SamplingParams
from flashnext_jax.vision import VisionConfig, vision_config
from flashnext_jax.vision_preprocess import preprocess_images, processor_config

SMOKE = bool(os.environ.get("VISION_BENCH_SMOKE"))
HERE = os.path.dirname(os.path.abspath(__file__))
# model-spec.md section 1 (the release's config.json); the token ids of the qwen4_exp wrapper
REAL_VISION = dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, patch_size=16,
                   temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=2560, num_position_embeddings=2304,
                   in_channels=3)
REAL_TOKENS = dict(image_token_id=248056, vision_start=248053, vision_end=248054)
REAL_PREPROCESSOR = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3, resample=3, rescale_factor=1 / 255,
                         size=dict(shortest_edge=65536, longest_edge=16777216))
_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **kw: _COMPILES.append(secs) if event == "/jax/core/compile/backend_compile_duration" else None)


def random_tower_params(cfg: VisionConfig, key, dtype) -> dict:
    """Random weights in vision.load_vision_params' layout (the checkpoint's `model.visual.*` tree, the patch
    embedding's Conv3d flattened to [hidden, C*T*P*P])."""
    keys = iter(jax.random.split(key, 8 * cfg.depth + 8))

    def dense(n_out, n_in):
        w = jax.random.normal(next(keys), (n_out, n_in), jnp.float32) * n_in**-0.5
        return {"weight": w.astype(dtype), "bias": jnp.zeros((n_out,), dtype)}

    def norm(n):
        return {"weight": jnp.ones((n,), dtype), "bias": jnp.zeros((n,), dtype)}

    h, merged = cfg.hidden_size, cfg.hidden_size * cfg.spatial_merge_size**2
    patch = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    blocks = [{"norm1": norm(h), "norm2": norm(h),
               "attn": {"qkv": dense(3 * h, h), "proj": dense(h, h)},
               "mlp": {"linear_fc1": dense(cfg.intermediate_size, h), "linear_fc2": dense(h, cfg.intermediate_size)}}
              for _ in range(cfg.depth)]
    return {"patch_embed": {"proj": dense(h, patch)},
            "pos_embed": {"weight": (jax.random.normal(next(keys), (cfg.num_position_embeddings, h)) * 0.02
                                     ).astype(dtype)},
            "blocks": blocks,
            "merger": {"norm": norm(h), "linear_fc1": dense(merged, merged),
                       "linear_fc2": dense(cfg.out_hidden_size, merged)}}


def random_image(side: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), np.uint8))


def timed(fn, repeats: int) -> tuple[float, float]:
    """(first call s, median of `repeats` later calls s)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def ttft(lm, prompt) -> dict:
    """One greedy request stepped to its first token: TTFT and the XLA compiles inside it."""
    n0, t0 = len(_COMPILES), time.perf_counter()
    req = lm._add(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    first = None
    while not req.finished:
        lm.engine.step()
        if first is None and req.output:
            first = time.perf_counter() - t0
    return dict(ttft_s=first, compiles=len(_COMPILES) - n0, compile_s=sum(_COMPILES[n0:]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", type=int, default=1024, help="the square image's side in pixels")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--text", type=int, default=64, help="random text tokens after the image")
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--tower-only", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)
    if SMOKE:  # the demo model's config: same code, tiny sizes
        demo = json.load(open(os.path.join(HERE, "..", "flashnext_jax", "demo_model", "config.json")))
        vision_hf, text_hf = demo["vision_config"], decode_step.DEMO_CONFIG
        tokens = dict(image_token_id=demo["image_token_id"], vision_start=demo["vision_start_token_id"],
                      vision_end=demo["vision_end_token_id"])
        preprocessor = json.load(open(os.path.join(HERE, "..", "flashnext_jax", "demo_model",
                                                   "preprocessor_config.json")))
        args.side, args.repeats, args.text = 64, 2, 8
    else:
        vision_hf, text_hf, tokens, preprocessor = REAL_VISION, decode_step.REAL_CONFIG, REAL_TOKENS, REAL_PREPROCESSOR
    dtype = jnp.bfloat16
    vcfg = vision_config({"vision_config": vision_hf})
    processor = processor_config(preprocessor, vision_hf)
    print(f"{jax.devices()[0].device_kind} jax {jax.__version__} tower {vcfg.depth}x{vcfg.hidden_size}", flush=True)
    tower = api.VisionTower(vcfg, random_tower_params(vcfg, jax.random.key(1), dtype), tokens["image_token_id"],
                            (11, 11, 10), processor)
    result: dict = {"side": args.side}

    def save(summary=None):
        return save_result("vision.json", [result], args.out, summary=summary, smoke=SMOKE,
                           vision_config=dataclasses.asdict(vcfg))

    images = [random_image(args.side, seed) for seed in range(3)]
    pre_first, pre_s = timed(lambda: preprocess_images(images[:1], processor), args.repeats)
    pixel_values, grid = preprocess_images(images[:1], processor)
    n0 = len(_COMPILES)
    tower_first, tower_s = timed(lambda: bucketed_embeddings(tower, pixel_values, grid), args.repeats)
    result.update(patches=int(pixel_values.shape[0]), image_tokens=int(pixel_values.shape[0]) // 4,
                  grid_thw=grid.tolist(), preprocess_ms=pre_s * 1e3, tower_ms=tower_s * 1e3,
                  tower_first_call_s=tower_first, tower_compile_s=sum(_COMPILES[n0:]))
    print({k: v for k, v in result.items()}, flush=True)
    save()

    if not args.tower_only:
        with open(text_hf) as f:
            cfg = from_hf_config(json.load(f))
        cfg = dataclasses.replace(cfg, num_experts=min(args.experts, cfg.num_experts))
        t0 = time.perf_counter()
        params, _, _ = decode_step.build(cfg, jax.random.key(0))
        jax.block_until_ready(params)
        result["build_s"] = time.perf_counter() - t0
        model = api.Model(cfg, params, table=None, dtype=dtype, vision=tower)
        rng = np.random.default_rng(0)
        text_hi = 150 if SMOKE else 1000  # plain text ids, below every special token

        def chat(image):
            text = rng.integers(0, text_hi, args.text).tolist()
            ids = [tokens["vision_start"], tokens["image_token_id"], tokens["vision_end"], *text]
            ids, pictures = model.image_prompt(ids, [image])
            return {"prompt_token_ids": ids, "images": pictures}

        first_chat = chat(images[1])
        n_tokens = len(first_chat["prompt_token_ids"])
        max_len = n_tokens + 64
        lm = LLM(RandomPleRunner(model, 0), max_num_seqs=1, max_num_batched_tokens=8192 if not SMOKE else 64,
                 page_size=64 if not SMOKE else 16, max_model_len=max_len, num_pages=-(-max_len // 16) + 8,
                 precompile=False)
        result.update(prompt_tokens=n_tokens, experts=cfg.num_experts, image_chat_first=ttft(lm, first_chat))
        print(result, flush=True)
        result["image_chat_second"] = ttft(lm, chat(images[2]))
        print(result, flush=True)
        save()
        text_prompt = rng.integers(0, text_hi, n_tokens).tolist()
        result["text_first"] = ttft(lm, text_prompt)
        result["text_second"] = ttft(lm, rng.integers(0, text_hi, n_tokens).tolist())
        print(result, flush=True)

    summary = dict(tower_ms_1024=result["tower_ms"], preprocess_ms_1024=result["preprocess_ms"],
                   image_chat_ttft_s=result.get("image_chat_second", {}).get("ttft_s"),
                   text_same_length_ttft_s=result.get("text_second", {}).get("ttft_s"),
                   image_chat_tokens=result.get("prompt_tokens"), device=jax.devices()[0].device_kind,
                   jax_version=jax.__version__, date=time.strftime("%Y-%m-%d", time.gmtime()))
    print(f"wrote {save(summary)}")
    print(f"{'what':<34} {'value':>10}")
    for k, v in summary.items():
        print(f"{k:<34} {v if not isinstance(v, float) else round(v, 4):>10}")


if __name__ == "__main__":
    main()
