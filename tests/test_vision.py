"""Vision input (issue 21) against transformers (tests/fixtures/reference_vision.*, `tools/make_fixtures.py --vision`):
the image processor bit for bit, the vision tower and image chats on the demo model to 1e-4, greedy text equal."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flashnext_jax.api import DEMO_MODEL
from flashnext_jax.vision_preprocess import (PreprocessError, expand_image_tokens, load_processor_config,
                                             preprocess_images, smart_resize)

FIX = Path(__file__).parent / "fixtures"
REF = np.load(FIX / "reference_vision.npz")
META = json.loads((FIX / "reference_vision.json").read_text())
IMAGES = list(META["images"])
CHATS = list(META["chats"])


def image(name: str) -> Image.Image:
    return Image.fromarray(REF[f"image/{name}"])


def processor_config(name: str):
    cfg = load_processor_config(DEMO_MODEL)
    override = META["images"][name]["max_pixels_override"]
    return dataclasses.replace(cfg, max_pixels=override) if override else cfg


@pytest.mark.parametrize("name", IMAGES)
def test_preprocessing_is_bit_exact(name):
    pixel_values, grid = preprocess_images([image(name)], processor_config(name))
    want = REF[f"image/{name}/pixel_values"]
    assert pixel_values.dtype == want.dtype and pixel_values.shape == want.shape
    assert np.array_equal(pixel_values, want)
    assert np.array_equal(grid, REF[f"image/{name}/grid_thw"])


def test_fixture_images_cover_every_resize_branch():
    branch = {}
    for name in IMAGES:
        h, w = REF[f"image/{name}"].shape[:2]
        c = processor_config(name)
        plain = round(h / c.factor) * c.factor * round(w / c.factor) * c.factor
        branch[name] = "down" if plain > c.max_pixels else ("up" if plain < c.min_pixels else "round")
        rh, rw = smart_resize(h, w, c.factor, c.min_pixels, c.max_pixels)
        assert c.min_pixels <= rh * rw <= c.max_pixels and rh % c.factor == rw % c.factor == 0
    assert {"round", "up", "down"} <= set(branch.values()), branch
    assert META["images"]["rgba"]["mode"] == "RGBA" and META["images"]["wide"]["size_wh"][0] != \
        META["images"]["wide"]["size_wh"][1]


@pytest.mark.parametrize("chat", CHATS)
def test_pad_token_expansion_matches_the_processor(chat):
    from flashnext_jax.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(DEMO_MODEL)
    msgs = META["chats"][chat]["messages"]
    ids = tok.apply_chat_template(msgs, tokenize=True)
    assert ids == REF[f"chat/{chat}/unexpanded_ids"].tolist()
    cfg = load_processor_config(DEMO_MODEL)
    pixel_values, grid = preprocess_images([image(n) for n in META["chats"][chat]["images"]], cfg)
    assert np.array_equal(pixel_values, REF[f"chat/{chat}/pixel_values"])
    assert np.array_equal(grid, REF[f"chat/{chat}/grid_thw"])
    hf = json.loads((DEMO_MODEL / "config.json").read_text())
    expanded = expand_image_tokens(ids, grid, hf["image_token_id"], cfg.merge_size)
    assert expanded == REF[f"chat/{chat}/ids"].tolist()


def test_expansion_refuses_a_placeholder_count_that_differs_from_the_images():
    with pytest.raises(PreprocessError, match="2 image placeholders but 1 images"):
        expand_image_tokens([1, 186, 2, 186], np.array([[1, 4, 4]]), 186, 2)


def rel_err(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module")
def tower():
    import jax.numpy as jnp

    from flashnext_jax.vision import load_vision_params

    return load_vision_params(DEMO_MODEL, jnp.float32)


def test_vision_tower_matches_transformers_for_several_images_at_once(tower):
    from flashnext_jax.vision import image_embeddings

    cfg, params = tower
    names = [str(n) for n in REF["tower/images"]]
    pixel_values = np.concatenate([REF[f"image/{n}/pixel_values"] for n in names])
    grid = np.concatenate([REF[f"image/{n}/grid_thw"] for n in names])
    got = np.asarray(image_embeddings(params, cfg, pixel_values, grid))
    offset = 0
    for n in names:
        want = REF[f"tower/{n}/embeddings"]
        assert rel_err(got[offset: offset + len(want)], want) <= 1e-4, n
        offset += len(want)
    assert offset == len(got)


def test_vision_tower_of_one_image_alone_equals_its_rows_in_a_batch(tower):
    """Attention stays within each image: a batch's rows equal each image run alone."""
    from flashnext_jax.vision import image_embeddings

    cfg, params = tower
    alone = np.asarray(image_embeddings(params, cfg, REF["image/tiny/pixel_values"], REF["image/tiny/grid_thw"]))
    assert rel_err(alone, REF["tower/tiny/embeddings"]) <= 1e-4


@pytest.fixture(scope="module")
def model_fp32():
    from flashnext_jax.api import load

    return load(DEMO_MODEL, dtype="float32")


@pytest.mark.parametrize("chat", CHATS)
def test_mrope_positions_match_transformers_get_rope_index(chat):
    from flashnext_jax.mrope import prompt_positions

    hf = json.loads((DEMO_MODEL / "config.json").read_text())
    pos, delta = prompt_positions(REF[f"chat/{chat}/ids"], REF[f"chat/{chat}/grid_thw"], hf["image_token_id"],
                                  hf["vision_config"]["spatial_merge_size"])
    assert np.array_equal(pos, REF[f"chat/{chat}/positions"])
    assert delta == int(REF[f"chat/{chat}/rope_delta"]) and delta < 0


@pytest.mark.parametrize("chat", CHATS)
def test_image_chat_logits_match_transformers(model_fp32, chat):
    from flashnext_jax.api import ImageInput

    images = ImageInput(REF[f"chat/{chat}/pixel_values"], REF[f"chat/{chat}/grid_thw"])
    got = model_fp32.logits(REF[f"chat/{chat}/ids"].tolist(), images=images)
    assert rel_err(got, REF[f"chat/{chat}/logits"]) <= 1e-4


@pytest.mark.parametrize("chat", CHATS)
def test_image_chat_greedy_continuation_matches_transformers(model_fp32, chat):
    from flashnext_jax.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(DEMO_MODEL)
    msgs = META["chats"][chat]["messages"]
    ids, images = model_fp32.image_prompt(tok.apply_chat_template(msgs, tokenize=True),
                                          [image(n) for n in META["chats"][chat]["images"]])
    assert ids == REF[f"chat/{chat}/ids"].tolist()
    want = REF[f"chat/{chat}/generated"].tolist()
    assert model_fp32.generate(ids, max_new_tokens=len(want), images=images) == want


def test_image_input_errors_are_clear(model_fp32):
    from flashnext_jax.api import ImageInput, load

    chat = CHATS[0]
    images = ImageInput(REF[f"chat/{chat}/pixel_values"], REF[f"chat/{chat}/grid_thw"])
    text_only = [t for t in REF[f"chat/{chat}/ids"].tolist() if t != 186]
    with pytest.raises(ValueError, match="0 image pad tokens"):
        model_fp32.logits(text_only, images=images)
    text_model = load(FIX / "tiny_causal", dtype="float32")  # CausalLM layout: no vision tower
    assert text_model.vision is None
    with pytest.raises(ValueError, match="no vision tower"):
        text_model.generate([1, 2], 1, images=images)
