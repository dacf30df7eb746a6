"""Offline, vLLM-style API over the engine, plus the async streaming interface the server uses.

    llm = LLM("toy" | checkpoint_dir, max_num_seqs=4, enable_prefix_caching=True,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    outs = llm.generate(["w3 w4 w5", [1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=16))
    async for out in llm.stream("w3 w4", SamplingParams(max_tokens=8)): print(out.delta_text)

Image prompts (a checkpoint with a vision tower) are dicts, as vLLM's: {"prompt": templated text or
"prompt_token_ids": ids with one <|image_pad|> per image, "multi_modal_data": {"image": [PIL images]}}, or the
pair the one-shot API makes, {"prompt_token_ids": ids, "images": ImageInput} (`api.Model.image_prompt`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

from pallas_kernels import fixed_order

from .engine import Engine, EngineConfig
from .model_runner import ModelRunner
from .media import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, MediaLimits, chat_inputs, image_limit
from .sampling import SamplingParams, TokenLogprob, truncate_prompt
from .scheduler import Request
from .structured_output import GrammarCompiler
from .tokenizer import IncrementalDetokenizer, Tokenizer, toy_tokenizer


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: dict
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry when SamplingParams.logprobs is set
    delta_logprobs: list[TokenLogprob] | None = None
    # one per prompt token when SamplingParams.prompt_logprobs is set: None for the first, then each token's
    # logprob given the tokens before it and the prompt_logprobs most likely at that position
    prompt_logprobs: list[TokenLogprob | None] | None = None


def _load(model: Any, dtype: str, k: int, tokenizer, device: str | None = None, max_images: int | None = None
          ) -> tuple[ModelRunner, Tokenizer | None]:
    """-> (the runner, the tokenizer). `max_images`: image slots per request of a RealRunner built here (None:
    RealRunner's default)."""
    from .toy_model import ToyConfig, ToyRunner

    if isinstance(model, ToyConfig) or model == "toy":
        cfg = model if isinstance(model, ToyConfig) else ToyConfig()
        return ToyRunner(cfg, k), tokenizer or toy_tokenizer(cfg.vocab_size, cfg.eos_token_id)
    if hasattr(model, "store_spec") and hasattr(model, "step"):  # a ModelRunner instance
        return model, tokenizer
    from . import api
    from .runner import RealRunner

    def dir_tokenizer(path) -> Tokenizer | None:
        if tokenizer is not None or path is None or not (Path(path) / "tokenizer.json").is_file():
            return tokenizer
        return Tokenizer.from_dir(Path(path))

    images = {} if max_images is None else {"max_images_per_prompt": max_images}
    if isinstance(model, api.Model):  # an already loaded real model
        return RealRunner(model, k, **images), dir_tokenizer(model.path)
    path = Path(model) if model is not None else api.DEMO_MODEL  # None -> the embedded demo model
    if not path.is_dir():
        raise FileNotFoundError(f"{str(path)!r} is neither 'toy' nor a checkpoint directory")
    tok = dir_tokenizer(path)
    if (path / "toy_config.json").is_file():  # a toy checkpoint directory (tests, server smoke tests)
        cfg = ToyConfig(**json.loads((path / "toy_config.json").read_text()))
        return ToyRunner(cfg, k), tok or toy_tokenizer(cfg.vocab_size, cfg.eos_token_id)
    loaded = api.load(path, dtype=dtype, device=device)
    runner = RealRunner(loaded, k, **images) if isinstance(loaded, api.Model) else loaded
    if not (hasattr(runner, "store_spec") and hasattr(runner, "step") and hasattr(runner, "host_prepare")):
        raise NotImplementedError(f"{type(loaded).__name__} does not implement the engine's ModelRunner protocol "
                                  "yet (store_spec / host_prepare / step; see docs/engine-design.md)")
    return runner, tok


class StopStrings:
    """A request's stop-string check (Request.stop_checker): called with the output ids after each new token, it
    feeds the request's detokenizer and looks for a stop string in the new text (and the few characters before it
    that a stop string could start in). vLLM's min_tokens rule: the text of the first min_tokens tokens is never
    searched (`floor`: its length; a stop string may only end after it)."""

    def __init__(self, detok: IncrementalDetokenizer, stops: Sequence[str], min_tokens: int = 0):
        self.detok, self.stops, self.min_tokens = detok, tuple(stops), min_tokens
        self.floor = 0

    def __call__(self, output_ids: Sequence[int]) -> bool:
        before = max(len(self.detok.text), self.floor)
        self.detok.update(output_ids)
        if len(output_ids) <= self.min_tokens:
            self.floor = len(self.detok.text)
            return False
        return any(self.detok.text.find(s, max(0, before - len(s) + 1)) >= 0 for s in self.stops)


class LLM:
    def __init__(self, model: Any = None, *, max_num_seqs: int = 8, max_num_batched_tokens: int = 8192,
                 max_model_len: int | None = None, enable_prefix_caching: bool = False, block_size: int = 16,
                 page_size: int | None = None, speculative_config: dict | None = None, dtype: str = "bfloat16",
                 tokenizer: Tokenizer | None = None, num_snapshots: int = 64, pipeline_delay: int | None = None,
                 gpu_memory_utilization: float = 0.9, precompile: bool = False,
                 precompile_sampling: Sequence[SamplingParams] = (),
                 pipeline_parallel_size: int = 1, pp_layer_partition: Sequence[int] | None = None,
                 limit_mm_per_prompt: dict | None = None, allowed_media_domains: Sequence[str] | None = None,
                 max_image_pixels: int | None = None, max_image_bytes: int | None = None,
                 mm_processor_kwargs: dict | None = None, **engine_kwargs):
        """model: a checkpoint directory, a loaded `api.Model`, a ModelRunner, "toy" (the exact toy oracle of the
        tests), or None: the embedded demo model (flashnext_jax/demo_model/).

        vLLM's defaults for long prompts: chunks of up to max_num_batched_tokens = 8192 tokens, max_model_len =
        the model's max_position_embeddings, a KV page pool sized from the device memory left after the weights
        (gpu_memory_utilization; page_pool.py). precompile: compile the decode and prefill step shapes now, with
        a progress bar (Engine.precompile), prefill chunks cut to a few buckets (EngineConfig.prefill_buckets,
        "auto" unless given) so that no request compiles a step, then run one throwaway request (Engine.warm_up:
        the store's ops and first launches); precompile_sampling: sampling parameters expected in traffic, whose
        samplers are compiled too. pipeline_parallel_size /
        pp_layer_partition: pipeline stages, each on its own device (docs/pipeline.md). Image input (a checkpoint
        with a vision tower, docs/vision.md), as vLLM's: limit_mm_per_prompt={"image": N} images per prompt at most
        (default: RealRunner's 8 image slots), allowed_media_domains: hosts http(s) image URLs may be fetched from
        (default: none, data: URLs only); max_image_pixels: of one image as decoded (default: Pillow's
        decompression-bomb threshold, 89,478,485); max_image_bytes: of one image as encoded, a data: URL's payload
        or an http(s) download, refused before it is decoded or downloaded whole (default: OpenAI's 20 MiB per
        image); mm_processor_kwargs: the image processor's resize bounds instead of preprocessor_config.json's,
        {"min_pixels": .., "max_pixels": ..} (or transformers' "size"), as vLLM's (an image's tokens grow with its
        pixels). engine_kwargs: further EngineConfig fields, e.g.
        qsa_kv_offload=True: the QSA K/V pages in pinned host memory (docs/long-context.md)."""
        k = 0
        if speculative_config:
            method = speculative_config.get("method", "mtp")
            if method != "mtp":
                raise ValueError(f"speculative_config.method={method!r}: only 'mtp' is supported")
            k = int(speculative_config.get("num_speculative_tokens", 1))
            if k < 1:
                raise ValueError("speculative_config.num_speculative_tokens must be >= 1")
        pipelined = pipeline_parallel_size != 1 or pp_layer_partition is not None
        # a pipeline's weights stay on the host until each stage's share goes to the stage's own devices
        max_images = image_limit(limit_mm_per_prompt)
        self.runner, self.tokenizer = _load(model, dtype, k, tokenizer, "host" if pipelined else None, max_images)
        if pipelined:  # stages (pipeline.py, docs/pipeline.md)
            from .pipeline import make_pipeline

            if engine_kwargs.get("batch_invariant") is None:  # the stages are traced in the engine's mode
                engine_kwargs["batch_invariant"] = fixed_order.default_mode()
            self.runner = make_pipeline(self.runner, pipeline_parallel_size, pp_layer_partition,
                                        batch_invariant=engine_kwargs["batch_invariant"])
            # up to one micro-batch per stage in flight: commits trail launches by stages - 1 steps
            pipeline_delay = self.runner.num_stages - 1 if pipeline_delay is None else pipeline_delay
            engine_kwargs.setdefault("max_rows_per_step", -(-max_num_seqs // self.runner.num_stages))
        if precompile:  # every prompt's chunks on a few precompiled shapes (EngineConfig.prefill_buckets)
            engine_kwargs.setdefault("prefill_buckets", "auto")
        cfg = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           max_model_len=max_model_len, num_speculative_tokens=k,
                           enable_prefix_caching=enable_prefix_caching, block_size=block_size,
                           page_size=page_size or block_size, num_snapshots=num_snapshots,
                           pipeline_delay=pipeline_delay or 0, gpu_memory_utilization=gpu_memory_utilization,
                           **engine_kwargs)
        self.media = self._media_limits(max_images, allowed_media_domains, max_image_pixels, max_image_bytes)
        self.processor = None  # None: the checkpoint's preprocessor_config.json
        if mm_processor_kwargs is not None:  # its resize bounds replaced for every request
            self.processor = self.processor_for(mm_processor_kwargs)
        grammars = None if self.tokenizer is None else GrammarCompiler(self.tokenizer, self.runner.vocab_size)
        self.engine = Engine(self.runner, cfg, grammar_compiler=grammars)
        self.runner = self.engine.runner  # qsa_kv_offload=True: the runner with its K/V in host memory
        if precompile:
            self.engine.precompile(sampling_params=precompile_sampling)
            self.engine.warm_up()  # the store's ops and the programs' first launches, before the first request
        self._ids = itertools.count()
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._prompts: dict[str, str | None] = {}
        self._emitted: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop_task: asyncio.Task | None = None

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def _media_limits(self, max_images: int | None, domains: Sequence[str] | None,
                      max_pixels: int | None, max_bytes: int | None) -> MediaLimits:
        slots = getattr(self.runner, "max_images", 0)  # a RealRunner's image slots (0: no vision tower)
        refusal = None
        if not hasattr(self.runner, "encode_images"):  # the toy model, pipeline stages (docs/vision.md)
            refusal = f"this engine takes no images ({type(self.runner).__name__} has no vision path)"
        elif not slots:
            refusal = "this model takes no images (the checkpoint has no vision tower)"
        elif max_images is not None and max_images > slots:  # a runner passed in, built with fewer slots
            raise ValueError(f"limit_mm_per_prompt image={max_images}: the runner has {slots} image slots per "
                             "request (RealRunner(max_images_per_prompt=))")
        return MediaLimits(max_images=slots if max_images is None else max_images, refusal=refusal,
                           max_pixels=max_pixels or DEFAULT_MAX_IMAGE_PIXELS,
                           max_image_bytes=max_bytes or DEFAULT_MAX_IMAGE_BYTES,
                           allowed_domains=frozenset(d.lower() for d in domains or ()))

    def _checkpoint_processor(self):
        """The checkpoint's image processor config (preprocessor_config.json); a ValueError without one."""
        tower = getattr(getattr(self.runner, "model", None), "vision", None)
        if self.media.refusal is not None or tower is None or tower.processor is None:
            raise ValueError("mm_processor_kwargs: this model takes no images")
        return tower.processor

    # ---- requests
    def image_prompt(self, token_ids: Sequence[int], images: Sequence,
                     mm_processor_kwargs: dict | None = None) -> tuple[list[int], Any]:
        """A templated prompt's ids with one <|image_pad|> per image + PIL images -> (the ids with each image's pads
        expanded, the preprocessed images: what `generate({"prompt_token_ids": ..., "images": ...})` takes), after
        the image count and pixel limits (`self.media`). mm_processor_kwargs: this prompt's resize bounds over the
        engine's (vLLM's per-request field)."""
        self.media.check_count(len(images))
        for i, image in enumerate(images):
            self.media.check_size(image, f"image {i}")
        processor = self.processor_for(mm_processor_kwargs)
        return self.runner.model.image_prompt([int(t) for t in token_ids], images, processor)

    def processor_for(self, mm_processor_kwargs: dict | None):
        """The image processor config of a request with these mm_processor_kwargs (None: the engine's); a
        ValueError names what is wrong, also for a model that takes no images."""
        if mm_processor_kwargs is None:
            return self.processor
        from .vision_preprocess import with_processor_kwargs

        return with_processor_kwargs(self.processor or self._checkpoint_processor(), mm_processor_kwargs)

    def _image_prompt(self, prompt: dict):
        """A dict prompt -> (text or ids, its api.ImageInput or None)."""
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data", "images"}
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError("a dict prompt has 'prompt' or 'prompt_token_ids', and 'multi_modal_data' or 'images'; "
                             f"got keys {sorted(prompt)}")
        text = prompt.get("prompt", prompt.get("prompt_token_ids"))
        mm = prompt.get("multi_modal_data")
        if mm is None:
            return text, prompt.get("images")
        if "images" in prompt or set(mm) - {"image"}:
            raise ValueError(f"multi_modal_data takes 'image' only (and not with 'images'); got {sorted(mm)}")
        pictures = mm.get("image", [])
        pictures = list(pictures) if isinstance(pictures, (list, tuple)) else [pictures]
        self.media.check_count(len(pictures))
        if not pictures:
            return text, None
        if isinstance(text, str) and self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer (none found in the checkpoint directory)")
        ids = self.tokenizer.encode(text) if isinstance(text, str) else [int(t) for t in text]
        ids, images = self.image_prompt(ids, pictures)  # expands each <|image_pad|> to the image's pad tokens
        return (text if isinstance(text, str) else None, ids), images

    def _add(self, prompt, params: SamplingParams, request_id: str | None = None) -> Request:
        rid = request_id or f"req-{next(self._ids)}"
        images = None
        if isinstance(prompt, dict):
            prompt, images = self._image_prompt(prompt)
        if isinstance(prompt, tuple):  # (text, expanded ids)
            text, ids = prompt
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (none found in the checkpoint directory)")
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            ids, text = [int(t) for t in prompt], None
        if params.truncate_prompt_tokens is not None:
            if images is not None:
                raise ValueError("truncate_prompt_tokens is not supported with images (it would cut their pads)")
            ids = truncate_prompt(ids, params.truncate_prompt_tokens, self.engine.cfg.max_model_len)
        checker = None
        if self.tokenizer is not None:
            params = params.with_bad_words_tokenized(self.tokenizer.encode)
            detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                           params.spaces_between_special_tokens)
            self._detok[rid] = detok
            if params.stop:
                checker = StopStrings(detok, params.stop, params.min_tokens)
        self._prompts[rid] = text
        self._emitted[rid] = (0, 0)
        try:
            if images is not None:  # the tower, without the engine's lock: steps in flight go on meanwhile
                images = self.engine.encode_images(rid, ids, images)
            with self._lock:
                return self.engine.add_request(rid, ids, params, stop_checker=checker, images=images)
        except ValueError:  # refused (a bad grammar, ...): keep nothing of it
            self._forget(rid)
            raise

    def _forget(self, rid: str) -> None:
        """Drop everything kept for a request whose caller has its last output (here and in the engine)."""
        for table in (self._detok, self._prompts, self._emitted):
            table.pop(rid, None)
        with self._lock:
            self.engine.free_request(rid)

    def _output(self, req: Request) -> RequestOutput:
        rid = req.request_id
        text = ""
        detok = self._detok.get(rid)
        if detok is not None:
            p = req.params
            if req.finished:  # all of it, any held-back partial character flushed; a stop token's text left out
                ids = req.output[:-1] if self._stopped_by_token(req) else req.output  # (as vLLM)
                text = detok.decode(ids)
            else:
                detok.update(req.output)
                text = detok.text
            checker = req.stop_checker
            for s in p.stop:  # cut at the stop string the checker found (never in the first min_tokens' text)
                i = text.find(s, max(0, getattr(checker, "floor", 0) - len(s) + 1))
                if i >= 0:
                    text = text[: i + (len(s) if p.include_stop_str_in_output else 0)]
        n_tok, n_txt = self._emitted[rid]
        self._emitted[rid] = (len(req.output), len(text))
        m = dict(req.metrics)
        m.update(num_prompt_tokens=len(req.prompt), num_generated_tokens=len(req.output),
                 acceptance_rate=(m["num_accepted"] / m["num_drafts"]) if m["num_drafts"] else None,
                 mean_accepted_tokens_per_step=(len(req.output) / max(1, m["num_steps"])))
        if "first_token_time" in m:
            m["time_to_first_token"] = m["first_token_time"] - m["arrival_time"]
        wants_logprobs = req.params.logprobs is not None
        return RequestOutput(rid, self._prompts.get(rid), list(req.prompt), text, list(req.output), req.finished,
                             req.finish_reason, m, text[n_txt:], list(req.output[n_tok:]), req.error,
                             list(req.logprobs) if wants_logprobs else None,
                             list(req.logprobs[n_tok:]) if wants_logprobs else None,
                             None if req.prompt_logprobs is None else list(req.prompt_logprobs))

    def _stopped_by_token(self, req: Request) -> bool:
        """Whether a finished request ended on EOS or one of its stop_token_ids (and its text leaves it out)."""
        p = req.params
        if req.finish_reason != "stop" or not req.output or p.include_stop_str_in_output:
            return False
        t = req.output[-1]
        return t in p.stop_token_ids or (t == self.runner.eos_token_id and not p.ignore_eos)

    # ---- offline
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        single = isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and isinstance(prompts[0], int))
        if single:
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        reqs = [self._add(p, sp) for p, sp in zip(prompts, params)]
        from tqdm import tqdm

        with tqdm(total=len(reqs), desc="generating", unit=" requests", disable=not use_tqdm) as bar:
            while any(not r.finished for r in reqs):
                with self._lock:
                    self.engine.step()
                bar.update(sum(r.finished for r in reqs) - bar.n)
        outputs = [self._output(r) for r in reqs]
        for r in reqs:
            self._forget(r.request_id)
        return outputs

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = False,
             **template_kwargs) -> list[RequestOutput]:
        """One conversation (a list of OpenAI-style messages) or several -> one output each, as vLLM's LLM.chat.
        Content may be a string or a list of parts: text, images as `{"type": "image_url", "image_url": {"url":
        "data:image/png;base64,..."}}` or `{"type": "image_pil", "image_pil": PIL.Image}` (media.chat_inputs,
        under `self.media`'s limits). template_kwargs: extra chat template variables."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (none found in the checkpoint directory)")
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conv in convs:
            shown, images = chat_inputs(conv, self.media)
            text = self.tokenizer.apply_chat_template(shown, add_generation_prompt=True, **template_kwargs)
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}} if images else text)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ---- async streaming (server)
    async def stream(self, prompt, params: SamplingParams | None = None,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput (cumulative text/token_ids plus deltas) each time the request gets tokens.
        A consumer that stops iterating aborts the request.

        The request is added on a worker thread: tokenizing a long prompt and running the vision tower over its
        images would otherwise hold the event loop (every other stream's tokens, new connections) for their
        time. Its queue is registered first, so the steps that run meanwhile cannot finish it unseen."""
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._streams:
            raise ValueError(f"duplicate request id {rid!r}")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = q
        add = asyncio.get_running_loop().run_in_executor(None, self._add, prompt, params or SamplingParams(), rid)
        try:
            req = await asyncio.shield(add)
        except asyncio.CancelledError:  # the caller left while the request was being added: drop it once it is
            self._streams.pop(rid, None)
            add.add_done_callback(lambda done: done.exception() is None and self._drop(done.result()))
            raise
        except BaseException:
            self._streams.pop(rid, None)
            raise
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self._streams.pop(req.request_id, None)
            self._drop(req)

    def _drop(self, req: Request) -> None:
        """A request whose caller is gone: aborted if unfinished, and forgotten."""
        if not req.finished:
            with self._lock:
                self.engine.abort(req.request_id)
        self._forget(req.request_id)

    async def _run(self):
        loop = asyncio.get_running_loop()

        def step():
            with self._lock:
                return self.engine.step()

        while self._streams and self.engine.has_unfinished():
            try:
                updated = await loop.run_in_executor(None, step)
            except BaseException as e:  # engine fault: every stream sees it
                for rid, q in list(self._streams.items()):
                    req = self.engine.requests.get(rid)
                    q.put_nowait(self._output(req) if req is not None and req.finished else e)
                return
            for req in updated:
                q = self._streams.get(req.request_id)
                if q is not None and (req.finished or len(req.output) > self._emitted[req.request_id][0]):
                    q.put_nowait(self._output(req))
            await asyncio.sleep(0)

    def usage(self) -> dict:
        return self.engine.usage()
