"""Image chats through the server as an OpenAI user sends them (issue 21): a real uvicorn on loopback, the official
`openai` client, the demo model in float32.

Oracle: transformers' greedy continuations of the two fixture chats and their logits
(tests/fixtures/reference_vision.*). The images are the fixture's pixels sent as PNG data: URLs, and PNG is
lossless, so the server decodes the very pixels transformers processed. The chosen tokens' logprobs are compared
too: the demo's random tower hardly moves greedy tokens, but other pixels move the logprobs (test_vision_engine.py).
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

import flashnext_jax as fj
from flashnext_jax.tokenizer import Tokenizer
from serving.app import create_app

from serving_harness import uvicorn_server

REF = np.load(Path(__file__).parent / "fixtures" / "reference_vision.npz")
META = json.loads((Path(__file__).parent / "fixtures" / "reference_vision.json").read_text())
# the shapes of tests/test_vision_engine.py: 32-token chunks (ending inside the images), one page-table width
SHAPES = dict(max_model_len=256, page_size=8, max_num_batched_tokens=32, prefill_buckets=(32,), min_batch_bucket=4,
              page_table_width="max", num_pages=160, min_pool_capacity=(4, 160, 64))
MAX_PIXELS = 128 * 128  # the fixture chats' images are at most 123 x 47; "large" (300 x 200) is over it
MAX_BYTES = 256 * 1024  # the fixture images' PNGs are at most 173,267 bytes ("large")


def png_url(pixels: np.ndarray, size: int | None = None) -> str:
    """A PNG data: URL; size: its decoded bytes, zeros after the PNG's end (decoders stop there) making them up."""
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    data = buf.getvalue()
    return "data:image/png;base64," + base64.b64encode(data + b"\0" * ((size or len(data)) - len(data))).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def openai_messages(chat: str) -> list[dict]:
    """The fixture's messages ({"type": "image", "image": name} parts) as OpenAI content parts."""
    return [{**m, "content": [image_part(png_url(REF[f"image/{p['image']}"])) if p["type"] == "image" else p
                              for p in m["content"]]} for m in META["chats"][chat]["messages"]]


@pytest.fixture(scope="module")
def base():
    llm = fj.LLM(None, dtype="float32", max_num_seqs=2, limit_mm_per_prompt={"image": 2},
                 max_image_pixels=MAX_PIXELS, max_image_bytes=MAX_BYTES, **SHAPES)
    with uvicorn_server(create_app(llm, "demo")) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def ask(client, messages, **kw):
    return client.chat.completions.create(model="demo", messages=messages, **{
        "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}} | kw)


def transformers_logprobs(chat: str) -> np.ndarray:
    logits = REF[f"chat/{chat}/generated_logits"].astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    return logp[np.arange(len(logp)), REF[f"chat/{chat}/generated"]]


def transformers_text(chat: str) -> str:
    return Tokenizer.from_dir(fj.DEMO_MODEL).decode(REF[f"chat/{chat}/generated"].tolist())


@pytest.mark.parametrize("chat", ["one_image", "two_images"])
def test_image_chat_equals_transformers(client, chat):
    out = ask(client, openai_messages(chat), logprobs=True)
    assert out.usage.prompt_tokens == META["chats"][chat]["n_tokens"]  # the processor's expanded pads
    assert out.usage.completion_tokens == 12 and out.choices[0].message.content == transformers_text(chat)
    got = np.array([t.logprob for t in out.choices[0].logprobs.content])
    np.testing.assert_allclose(got, transformers_logprobs(chat), rtol=1e-4, atol=1e-4)


def test_streamed_image_chat_equals_transformers(client):
    chunks = list(ask(client, openai_messages("one_image"), stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == transformers_text("one_image")
    assert chunks[-1].usage.prompt_tokens == META["chats"]["one_image"]["n_tokens"]


def test_mm_processor_kwargs_per_request_resize_its_images(client, base):
    """vLLM's per-request mm_processor_kwargs: this request's images resized within its bounds (fewer pixels,
    fewer image tokens, as usage and /tokenize count them); the next request without it gets the server's; a bad
    one is a 400 naming it, with or without images."""
    small = {"mm_processor_kwargs": {"min_pixels": 256, "max_pixels": 1024}}
    full = META["chats"]["two_images"]["n_tokens"]
    out = ask(client, openai_messages("two_images"), extra_body={"ignore_eos": True, **small})
    counted = httpx.post(base + "/tokenize", json={"messages": openai_messages("two_images"), **small}).json()
    assert out.usage.prompt_tokens == counted["count"] < full - 50 and out.usage.completion_tokens == 12
    assert ask(client, openai_messages("two_images")).usage.prompt_tokens == full
    for messages in (openai_messages("one_image"), [{"role": "user", "content": "hi"}]):
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, messages, extra_body={"mm_processor_kwargs": {"fps": 2}})
        assert "fps not supported" in e.value.body["message"]


def test_tokenize_counts_each_image_as_its_expanded_pads(base):
    r = httpx.post(base + "/tokenize", json={"messages": openai_messages("two_images")})
    assert r.status_code == 200 and r.json()["tokens"] == REF["chat/two_images/ids"].tolist()


CORRUPT = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n not really a png").decode()


@pytest.mark.parametrize("parts, needle", [
    ([image_part(CORRUPT)], "not a decodable image"),
    ([image_part("file:///etc/passwd")], "unsupported image URL scheme 'file'"),
    ([image_part("https://example.com/cat.png")], "not fetched by this server"),
    ([image_part("data:text/plain;base64,aGVsbG8=")], "not an image type"),
    ([image_part("data:image/png;base64,@@@")], "not valid base64"),
    ([image_part(CORRUPT)] * 3, "at most 2 image(s)"),  # counted before any is decoded
    ([image_part(png_url(REF["image/large"]))], "60000 pixels, more than the 16384"),
    ([{"type": "image_url", "image_url": {"url": png_url(REF["image/tiny"]), "detail": "high"}}], "detail 'high' is not supported"),
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "does not match any of the expected"),
])
def test_bad_images_are_400s_and_the_server_keeps_serving(client, parts, needle):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}])
    assert e.value.status_code == 400 and e.value.body["code"] == 400 and needle in e.value.body["message"]
    small = ask(client, [{"role": "user", "content": [image_part(png_url(REF["image/tiny"]))]}], max_tokens=1)
    assert small.usage.completion_tokens == 1


def test_an_image_at_the_byte_cap_is_taken_and_one_byte_over_is_a_400(client):
    at_cap = ask(client, [{"role": "user", "content": [image_part(png_url(REF["image/tiny"], MAX_BYTES))]}],
                 max_tokens=1)
    assert at_cap.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, [{"role": "user", "content": [image_part(png_url(REF["image/tiny"], MAX_BYTES + 1))]}])
    assert e.value.status_code == 400 and e.value.body["code"] == 400 and e.value.body["type"] == "invalid_request_error"
    assert e.value.body["message"] == (f"messages[0].content[0]: the data: URL's image is {MAX_BYTES + 1} bytes, "
                                       f"more than the {MAX_BYTES} allowed for one image (--max-image-bytes)")


def test_serve_flags_reach_the_engine(monkeypatch):
    """vLLM's flag names and formats: --limit-mm-per-prompt JSON, --allowed-media-domains a list."""
    import flashnext_jax.llm
    import serving.cli
    from flashnext_jax.cli import build_parser

    class Built(Exception):
        pass

    def fake_llm(model, **kw):
        raise Built(kw)

    monkeypatch.setattr(flashnext_jax.llm, "LLM", fake_llm)
    monkeypatch.setattr(serving.cli, "configure_compilation_cache", lambda option: None)
    args = build_parser().parse_args(["serve", "--limit-mm-per-prompt", '{"image": 3, "video": 0}',
                                      "--allowed-media-domains", "upload.wikimedia.org", "example.com",
                                      "--max-image-pixels", "1000000", "--max-image-bytes", "5000000",
                                      "--mm-processor-kwargs", '{"max_pixels": 50000}'])
    with pytest.raises(Built) as e:
        args.func(args)
    kw = e.value.args[0]
    assert kw["limit_mm_per_prompt"] == {"image": 3, "video": 0} and kw["max_image_pixels"] == 1000000
    assert kw["max_image_bytes"] == 5000000
    assert kw["allowed_media_domains"] == ["upload.wikimedia.org", "example.com"]
    assert kw["mm_processor_kwargs"] == {"max_pixels": 50000}


@pytest.mark.parametrize("flag, value, needle", [
    ("--mm-processor-kwargs", '{"fps": 2}', "fps not supported"),
    ("--max-image-bytes", "0", "argument --max-image-bytes: must be >= 1, got 0"),
    ("--max-image-bytes", "20MiB", "argument --max-image-bytes: must be an integer, got '20MiB'"),
])
def test_a_bad_media_flag_is_one_line_and_exit_2(capsys, flag, value, needle):
    from flashnext_jax.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", flag, value])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert e.value.code == 2 and len(errors) == 1 and needle in errors[0]
