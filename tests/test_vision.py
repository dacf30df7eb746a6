"""Vision input (issue 21) against transformers (tests/fixtures/reference_vision.*, `tools/make_fixtures.py --vision`):
the image processor bit for bit, the vision tower and image chats on the demo model to 1e-4, greedy text equal; and
the byte cap on one image's encoded bytes (data: URLs, and downloads from a loopback HTTP server)."""

from __future__ import annotations

import base64
import dataclasses
import http.server
import io
import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flashnext_jax import media
from flashnext_jax.api import DEMO_MODEL
from flashnext_jax.media import MediaError, MediaLimits, load_image_url
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


# --- the byte cap on one image's encoded bytes (flashnext_jax/media.py, --max-image-bytes) ---


def png_bytes(name: str, pad: int = 0) -> bytes:
    """The fixture image as PNG, `pad` zero bytes after its end (decoders stop at IEND): any byte count."""
    buf = io.BytesIO()
    image(name).save(buf, format="PNG")
    return buf.getvalue() + b"\0" * pad


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize("pad", [0, 1, 2])  # the payload's three paddings: "", "=", "=="
def test_a_data_url_at_the_byte_cap_decodes_and_one_byte_over_is_refused_before_decoding(monkeypatch, pad):
    data = png_bytes("tiny", pad)
    url = data_url(data)
    decoded = load_image_url(url, MediaLimits(max_images=1, max_image_bytes=len(data)))
    np.testing.assert_array_equal(np.asarray(decoded), REF["image/tiny"])

    def no_decoding(*args, **kwargs):
        raise AssertionError("an oversized data: URL reached base64.b64decode")

    monkeypatch.setattr(media.base64, "b64decode", no_decoding)
    with pytest.raises(MediaError) as e:
        load_image_url(url, MediaLimits(max_images=1, max_image_bytes=len(data) - 1), "messages[0].content[0]")
    assert str(e.value) == (f"messages[0].content[0]: the data: URL's image is {len(data)} bytes, more than the "
                            f"{len(data) - 1} allowed for one image (--max-image-bytes)")


def test_the_default_byte_cap_is_openais_20_mib():
    assert MediaLimits(max_images=1).max_image_bytes == 20 * 1024 * 1024


UNSIZED_ZEROS = 16 * 1024 * 1024


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    """/png: the tiny PNG with its Content-Length; /unsized: the tiny PNG and UNSIZED_ZEROS zeros after it (still a
    decodable image) without a Content-Length (HTTP/1.0: the body ends when the connection does); /huge: a
    Content-Length of a terabyte, and no body until the test is over (a client that reads the body would wait for
    it, then time out)."""
    done = threading.Event()

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        try:
            if self.path == "/png":
                self.send_header("Content-Length", str(len(png_bytes("tiny"))))
                self.end_headers()
                self.wfile.write(png_bytes("tiny"))
            elif self.path == "/unsized":
                self.end_headers()
                self.wfile.write(png_bytes("tiny"))
                for _ in range(UNSIZED_ZEROS // 65536):
                    self.wfile.write(b"\0" * 65536)
            elif self.path == "/huge":
                self.send_header("Content-Length", str(10 ** 12))
                self.end_headers()
                self.wfile.flush()
                self.done.wait(30)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped reading: what the cap is for

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    _ImageHandler.done.set()
    server.shutdown()
    server.server_close()


def _fetch_limits(max_image_bytes: int) -> MediaLimits:
    return MediaLimits(max_images=1, allowed_domains=frozenset({"127.0.0.1"}), max_image_bytes=max_image_bytes,
                       fetch_timeout_s=2.0)


def test_an_allowed_download_within_the_byte_cap_decodes(image_server):
    limits = _fetch_limits(len(png_bytes("tiny")))
    np.testing.assert_array_equal(np.asarray(load_image_url(image_server + "/png", limits)), REF["image/tiny"])


def test_a_download_without_content_length_is_stopped_once_past_the_byte_cap(image_server):
    with pytest.raises(MediaError) as e:
        load_image_url(image_server + "/unsized", _fetch_limits(1000))
    got = re.fullmatch(r"image_url: the image's download was stopped at (\d+) bytes, more than the 1000 allowed "
                       r"for one image \(--max-image-bytes\)", str(e.value))
    assert got and int(got[1]) < UNSIZED_ZEROS // 4  # stopped soon after the cap, not at the body's end


def test_a_content_length_over_the_byte_cap_is_refused_without_reading_the_body(image_server):
    """/huge sends no body: reading it would time out (a different message) instead of this refusal."""
    start = time.monotonic()
    with pytest.raises(MediaError, match=r"the image's Content-Length is 1000000000000 bytes, more than the 1000 "
                                         r"allowed for one image \(--max-image-bytes\)"):
        load_image_url(image_server + "/huge", _fetch_limits(1000))
    assert time.monotonic() - start < 1.5  # under the fetch timeout: no read of the body was waited on
