"""Image prompts through the serving engine (issue 21): `LLM.generate` with images on the demo model in float32.

Oracles, never values of the code under test: the greedy continuations transformers wrote into
tests/fixtures/reference_vision.* (which `Model.generate(..., images=...)` equals, tests/test_vision.py) and
reference_tiny.* (a text prompt), and each request run alone. The demo model's random tower hardly moves its
greedy tokens (one_image's text answers the same with either image), so requests with other images are told apart
by their tokens' logprobs. Every engine here shares one runner and
one shape configuration (chunks of CHUNK tokens, one page-table width), so the model step compiles once per
kind (prefill / decode, with / without images, with / without MTP).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import flashnext_jax as fj
from flashnext_jax.api import DEMO_MODEL, ImageInput
from flashnext_jax.runner import RealRunner
from flashnext_jax.tokenizer import Tokenizer

REF = np.load(Path(__file__).parent / "fixtures" / "reference_vision.npz")
META = json.loads((Path(__file__).parent / "fixtures" / "reference_vision.json").read_text())
TEXT = np.load(Path(__file__).parent / "fixtures" / "reference_tiny.npz")  # "short": a text prompt
PAD = 186  # the demo model's <|image_pad|>
CHUNK = 32  # every image prompt's chunks end inside an image (checked in the first test)
GREEDY = fj.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
SHAPES = dict(max_model_len=256, page_size=8, max_num_batched_tokens=CHUNK, prefill_buckets=(CHUNK,),
              min_batch_bucket=4, page_table_width="max", num_pages=160, min_pool_capacity=(4, 160, 64))
_STATE: dict = {}


def model():
    if "model" not in _STATE:
        _STATE["model"] = fj.load(dtype="float32")
        _STATE["runners"] = {0: RealRunner(_STATE["model"], 0), 1: RealRunner(_STATE["model"], 1)}
        _STATE["tokenizer"] = Tokenizer.from_dir(DEMO_MODEL)
    return _STATE["model"]


def llm(k: int = 0, **kw) -> fj.LLM:
    """An engine of the shared shapes; k = 1: speculative decoding with the MTP head, one draft token."""
    model()
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    return fj.LLM(_STATE["runners"][k], tokenizer=_STATE["tokenizer"], max_num_seqs=3, speculative_config=spec,
                  **SHAPES, **kw)


def fixture_chat(chat: str) -> dict:
    """The fixture's expanded ids and preprocessed images: the pair `Model.image_prompt` makes."""
    return {"prompt_token_ids": REF[f"chat/{chat}/ids"].tolist(),
            "images": ImageInput(REF[f"chat/{chat}/pixel_values"], REF[f"chat/{chat}/grid_thw"])}


def other_image_chat() -> dict:
    """one_image's templated text with the fixture's square image instead of the wide one, as vLLM takes it."""
    return {"prompt": META["chats"]["one_image"]["text"],
            "multi_modal_data": {"image": [Image.fromarray(REF["image/square"])]}}


def solo(name: str, prompt, k: int = 0):
    """The prompt's RequestOutput run alone in an engine of the same shapes (cached per test session)."""
    key = ("solo", name, k)
    if key not in _STATE:
        _STATE[key] = llm(k).generate(prompt, GREEDY)[0]
    return _STATE[key]


def solo_mtp_drafts(chat: str):
    """A fixture chat run alone with MTP, and the drafts the head proposed: (tokens known, draft) per proposal."""
    key = ("drafts", chat)
    if key not in _STATE:
        lm, proposals = llm(1), []

        def hook(req, proposed):
            proposals.append((list(req.tokens), proposed[0]))
            return proposed
        lm.engine.draft_hook = hook
        _STATE[key] = lm.generate(fixture_chat(chat), GREEDY)[0], proposals
    return _STATE[key]


def logprobs(out) -> np.ndarray:
    return np.array([lp.logprob for lp in out.logprobs])


def same_run(out, want) -> bool:
    """Equal tokens and (float32, other batch shapes) equal logprobs."""
    return out.token_ids == want.token_ids and np.allclose(logprobs(out), logprobs(want), rtol=1e-4, atol=1e-5)


def other_image(out, want) -> bool:
    return not np.allclose(logprobs(out), logprobs(want), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("chat", ["one_image", "two_images"])
def test_engine_image_chat_equals_transformers_with_chunks_splitting_images(chat):
    ids = REF[f"chat/{chat}/ids"]
    pads = np.nonzero(ids == PAD)[0]
    assert any(pads[0] < c <= pads[-1] for c in range(CHUNK, len(ids), CHUNK))  # a chunk ends inside an image
    assert solo(chat, fixture_chat(chat)).token_ids == REF[f"chat/{chat}/generated"].tolist()


def test_spans_give_the_one_shot_position_table_at_every_index():
    import jax.numpy as jnp

    from flashnext_jax.mrope import SpanRope, image_spans, position_table, prompt_positions

    for chat in ("one_image", "two_images"):
        ids, grid = REF[f"chat/{chat}/ids"], REF[f"chat/{chat}/grid_thw"]
        table = position_table(*prompt_positions(ids, grid, PAD, 2), len(ids) + 20)
        spans = image_spans(ids, grid, PAD, 2, 8)
        got = SpanRope(jnp.asarray(spans)[None], (2, 1, 1)).at(jnp.arange(table.shape[1])[None])
        assert np.array_equal(np.asarray(got)[0].T, table), chat


def test_bucketed_tower_equals_the_unpadded_tower():
    from flashnext_jax.request_images import bucketed_embeddings, patch_bucket

    tower = model().vision
    pixel_values, grid = REF["chat/two_images/pixel_values"], REF["chat/two_images/grid_thw"]
    assert patch_bucket(len(pixel_values), 2) > len(pixel_values)  # the padding path runs
    want = np.asarray(model().image_embeddings(ImageInput(pixel_values, grid)))
    got = bucketed_embeddings(tower, pixel_values, grid)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_concurrent_image_and_text_requests_each_equal_their_solo_run():
    text = TEXT["short/ids"].tolist()
    outs = llm().generate([fixture_chat("one_image"), text, other_image_chat()], GREEDY)
    assert same_run(outs[0], solo("one_image", fixture_chat("one_image")))
    assert outs[0].token_ids == REF["chat/one_image/generated"].tolist()
    assert outs[1].token_ids == TEXT["short/generated"][: GREEDY.max_tokens].tolist()
    assert same_run(outs[2], solo("square", other_image_chat()))
    assert other_image(outs[2], outs[0])  # the same text with other pixels: another distribution


def test_a_slow_tower_stalls_neither_the_event_loop_nor_other_streams(monkeypatch):
    """LLM.stream adds a request on a worker thread and the tower runs without the engine's lock
    (Engine.encode_images): while an image request's tower runs (made to take 1.5 s here), a text stream already
    running keeps getting tokens and the event loop keeps turning. Both stalled for the tower's whole time when it
    ran inside add_request on the event loop, under the lock. The image request still equals its solo run, and
    images encoded for one prompt are refused with another."""
    import asyncio
    import time

    lm = llm()
    text = TEXT["short/ids"].tolist()
    long_text = fj.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    lm.generate(text, long_text)  # every step shape of the text stream and the tower compiled before the timing
    chat = fixture_chat("one_image")
    lm.engine.encode_images("warm-up", chat["prompt_token_ids"], chat["images"])
    real, tower = lm.runner.encode_images, []

    def slow(prompt, images):
        t0 = time.monotonic()
        time.sleep(1.5)
        out = real(prompt, images)
        tower.append((t0, time.monotonic()))
        return out
    monkeypatch.setattr(lm.runner, "encode_images", slow)

    async def run():
        ticks, text_times = [], []

        async def ticker():
            while not tower:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        async def text_stream():
            async for out in lm.stream(text, long_text):
                text_times.append((time.monotonic(), len(out.token_ids)))

        async def image_request():
            while not text_times:  # the text stream runs first
                await asyncio.sleep(0.01)
            return [o async for o in lm.stream(chat, GREEDY)][-1]

        tick = asyncio.create_task(ticker())
        _, image_out = await asyncio.gather(text_stream(), image_request())
        await tick
        return ticks, text_times, image_out

    ticks, text_times, image_out = asyncio.run(run())
    (t0, t1), = tower
    during = [n for t, n in text_times if t0 < t < t1]
    assert len(during) >= 2 and during[-1] - during[0] >= 10, during  # the steps went on
    gaps = np.diff([t for t in ticks if t0 - 0.1 < t < t1 + 0.1])
    assert len(gaps) and gaps.max() < 0.5, gaps.max()  # the loop turned
    assert same_run(image_out, solo("one_image", chat))

    encoded = lm.engine.encode_images("r", chat["prompt_token_ids"], chat["images"])
    with pytest.raises(ValueError, match="encoded for another prompt"):
        lm.engine.add_request("r", chat["prompt_token_ids"][:-1] + [0], GREEDY, images=encoded)


def test_mm_processor_kwargs_set_the_resize_bounds_as_preprocessor_config_does(tmp_path):
    """vLLM's mm_processor_kwargs: {"min_pixels": a, "max_pixels": b} (or transformers' "size") resize as a
    checkpoint whose preprocessor_config.json says shortest_edge a, longest_edge b (the config transformers'
    processor reads); fewer pixels, fewer image tokens; the request then runs. Other keys and bad values are
    refused."""
    import shutil

    from flashnext_jax.vision_preprocess import load_processor_config

    image = [Image.fromarray(REF["image/square"])]
    ids = REF["chat/one_image/ids"]
    one_pad = [int(t) for t in ids if t != PAD] + [PAD]  # the templated text with one <|image_pad|>
    base = llm()
    full_ids, _ = base.image_prompt(one_pad, image)
    lo, hi = 256, 1024  # the 64 x 64 image (64 image tokens) resized to 32 x 32: 16 tokens
    checkpoint = tmp_path / "small"
    shutil.copytree(DEMO_MODEL, checkpoint)
    config = json.loads((checkpoint / "preprocessor_config.json").read_text())
    config["size"] = {"shortest_edge": lo, "longest_edge": hi}
    (checkpoint / "preprocessor_config.json").write_text(json.dumps(config))
    want = load_processor_config(checkpoint)
    for kwargs in ({"min_pixels": lo, "max_pixels": hi}, {"size": {"shortest_edge": lo, "longest_edge": hi}}):
        lm = llm(mm_processor_kwargs=kwargs)
        assert lm.processor == want
        small_ids, small = lm.image_prompt(one_pad, image)
        assert small_ids.count(PAD) == 16 and full_ids.count(PAD) == 64
        _, from_config = base.runner.model.image_prompt(one_pad, image, want)
        np.testing.assert_array_equal(small.pixel_values, from_config.pixel_values)
    (out,) = lm.generate({"prompt_token_ids": small_ids, "images": small}, GREEDY)
    assert len(out.token_ids) == GREEDY.max_tokens
    for bad, needle in (({"fps": 2}, "fps not supported"), ({"max_pixels": 0}, "positive integer"),
                        ({"min_pixels": 10**6, "max_pixels": 10**5}, "min_pixels"),
                        ({"min_pixels": 1, "max_pixels": 4}, "one merged")):
        with pytest.raises(ValueError, match=needle):
            llm(mm_processor_kwargs=bad)
    with pytest.raises(ValueError, match="takes no images"):
        fj.LLM("toy", mm_processor_kwargs={"max_pixels": 10**5})


def test_an_image_seen_before_skips_the_tower_and_gives_the_same_run(monkeypatch):
    """The encoder cache (request_images.EncoderCache, by image content): a chat resent with its images runs the
    tower for none of them and gives the first run's tokens and logprobs bit for bit (the tower runs per image,
    so cached rows are the rows a fresh run computes); other pixels miss; past its byte budget the least recently
    used image goes."""
    from flashnext_jax import request_images
    from flashnext_jax.request_images import EncoderCache

    lm = llm()
    calls = []
    real = request_images.bucketed_embeddings

    def counted(tower, pixel_values, grid):
        calls.append(tuple(map(tuple, grid.tolist())))
        return real(tower, pixel_values, grid)
    monkeypatch.setattr(request_images, "bucketed_embeddings", counted)
    monkeypatch.setattr(lm.runner, "encoder_cache", EncoderCache(64 << 20))  # the runner is shared: a fresh one
    (first,) = lm.generate(fixture_chat("two_images"), GREEDY)
    assert len(calls) == 2  # one tower call per image
    (again,) = lm.generate(fixture_chat("two_images"), GREEDY)
    assert len(calls) == 2 and lm.runner.encoder_cache.stats["hits"] == 2
    assert again.token_ids == first.token_ids and np.array_equal(logprobs(again), logprobs(first))
    assert first.token_ids == REF["chat/two_images/generated"].tolist()
    (square,) = lm.generate(other_image_chat(), GREEDY)  # two_images' first image in another prompt: a hit
    assert len(calls) == 2 and same_run(square, solo("square", other_image_chat()))
    (wide,) = lm.generate(fixture_chat("one_image"), GREEDY)  # new pixels: a miss
    assert calls[2:] == [((1, 12, 30),)] and wide.token_ids == REF["chat/one_image/generated"].tolist()

    rows = [np.zeros((4, 8), np.float32) for _ in range(3)]  # 128 bytes each
    cache = EncoderCache(2 * 128)
    cache.put(b"a", rows[0]), cache.put(b"b", rows[1])
    assert cache.get(b"a") is rows[0]  # a is now the most recent
    cache.put(b"c", rows[2])
    assert cache.get(b"b") is None and cache.get(b"a") is rows[0] and cache.get(b"c") is rows[2]
    assert cache.nbytes == 256
    EncoderCache(0).put(b"a", rows[0])  # budget 0: nothing kept (a runner without a tower)


def test_prefix_cache_shares_an_image_prompt_only_with_the_same_image():
    lm = llm(enable_prefix_caching=True, block_size=16)
    first_pad = int(np.nonzero(REF["chat/one_image/ids"] == PAD)[0][0])
    (a,) = lm.generate(fixture_chat("one_image"), GREEDY)
    (again,) = lm.generate(fixture_chat("one_image"), GREEDY)
    (other,) = lm.generate(other_image_chat(), GREEDY)  # same text, other pixels
    assert a.metrics["num_cached_tokens"] == 0
    assert again.metrics["num_cached_tokens"] > first_pad  # blocks holding the image came from the cache
    assert a.token_ids == REF["chat/one_image/generated"].tolist() and same_run(again, a)
    assert other.metrics["num_cached_tokens"] <= first_pad  # no block holding pads of another image
    assert same_run(other, solo("square", other_image_chat())) and other_image(other, a)


@pytest.mark.parametrize("chat", ["one_image", "two_images"])
def test_image_chat_with_mtp_equals_transformers_and_the_run_without_mtp(chat):
    out, proposals = solo_mtp_drafts(chat)
    assert out.token_ids == REF[f"chat/{chat}/generated"].tolist()
    assert same_run(out, solo(chat, fixture_chat(chat)))
    assert out.metrics["num_drafts"] > 0 and proposals  # the MTP head drafted (accepted or not)


def test_mtp_drafts_of_an_image_chat_are_the_one_shot_mtp_argmax_at_3d_positions():
    """The engine's drafts equal the teacher-forced MTP head of Model.mtp_logits (dense cache, a position table
    instead of the slot's spans, pad tokens read as the tower's rows). With the MTP layer at text positions or
    reading the pads' token embeddings, drafts of this chat differ (checked by hand)."""
    m = model()
    images = fixture_chat("two_images")["images"]
    _, proposals = solo_mtp_drafts("two_images")
    for tokens, draft in proposals:
        ref = m.mtp_logits(tokens, images)[-1]
        assert ref[draft] >= ref.max() - 1e-4, (len(tokens), draft, int(ref.argmax()))


def test_image_and_text_requests_batched_under_mtp_each_equal_their_solo_run():
    text = TEXT["short/ids"].tolist()
    outs = llm(1).generate([fixture_chat("one_image"), text, other_image_chat()], GREEDY)
    assert same_run(outs[0], solo_mtp_drafts("one_image")[0])
    assert outs[0].token_ids == REF["chat/one_image/generated"].tolist()
    assert same_run(outs[1], solo("text", text, k=1))
    assert outs[1].token_ids == TEXT["short/generated"][: GREEDY.max_tokens].tolist()
    assert same_run(outs[2], solo("square", other_image_chat(), k=1)) and other_image(outs[2], outs[0])


def test_prompt_logprobs_of_an_image_chat_equal_transformers_log_softmax():
    """Every prompt position's logprob and top-2 from transformers' fp32 logits of the fixture chat, with the
    chunks splitting the image (the step's hidden states already hold the tower's rows and the 3-D positions)."""
    params = fj.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    (out,) = llm().generate(fixture_chat("one_image"), params)
    ids, logits = REF["chat/one_image/ids"], REF["chat/one_image/logits"].astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    ref = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))  # log_softmax
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        got, want = out.prompt_logprobs[pos], ref[pos - 1]
        assert got.token_id == ids[pos] and abs(got.logprob - want[ids[pos]]) < 1e-4, pos
        np.testing.assert_allclose([x for _, x in got.top], np.sort(want)[::-1][:2], atol=1e-4)


def test_image_requests_are_refused_clearly():
    lm = llm()
    chat = fixture_chat("one_image")
    with pytest.raises(ValueError, match="image pad tokens|image-token runs"):
        lm.generate({**chat, "prompt_token_ids": [t for t in chat["prompt_token_ids"] if t != PAD]}, GREEDY)
    with pytest.raises(ValueError, match="dict prompt"):
        lm.generate({"images": chat["images"]}, GREEDY)


def test_llm_chat_takes_openai_image_parts_and_pil_images():
    """LLM.chat reads the messages the server reads (media.chat_inputs): a data: URL of PNG bytes (lossless) and a
    PIL image give transformers' greedy tokens."""
    import base64
    import io

    buf = io.BytesIO()
    Image.fromarray(REF["image/square"]).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    parts = {"square": {"type": "image_url", "image_url": {"url": url}},
             "tiny": {"type": "image_pil", "image_pil": Image.fromarray(REF["image/tiny"])}}
    messages = [{**m, "content": [parts[p["image"]] if p["type"] == "image" else p for p in m["content"]]}
                for m in META["chats"]["two_images"]["messages"]]
    (out,) = llm().chat(messages, GREEDY)
    assert out.prompt_token_ids == REF["chat/two_images/ids"].tolist()
    assert out.token_ids == REF["chat/two_images/generated"].tolist()


def test_image_limits_are_checked_before_the_images_are_used():
    model()
    with pytest.raises(ValueError, match="image slots"):  # more than the runner was built for
        fj.LLM(_STATE["runners"][0], tokenizer=_STATE["tokenizer"], limit_mm_per_prompt={"image": 9}, **SHAPES)
    with pytest.raises(ValueError, match="images only"):
        fj.LLM(_STATE["runners"][0], tokenizer=_STATE["tokenizer"], limit_mm_per_prompt={"video": 1}, **SHAPES)
    lm = llm(limit_mm_per_prompt={"image": 1}, max_image_pixels=64 * 64)
    with pytest.raises(ValueError, match=r"at most 1 image\(s\)"):
        lm.generate({"prompt": META["chats"]["two_images"]["text"],
                     "multi_modal_data": {"image": [Image.fromarray(REF["image/square"])] * 2}}, GREEDY)
    with pytest.raises(ValueError, match="more than the 4096 allowed"):
        lm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": Image.fromarray(REF["image/large"])}]}])
