"""OpenAI-compatible HTTP server over `flashnext_jax.LLM` (FastAPI), with vLLM's extra endpoints:
/v1/completions, /v1/chat/completions (both with `stream`), /v1/models[/{id}], /health, /version, /tokenize,
/detokenize, /metrics.

Every error is an OpenAI-style error object: bad input a 400 that touches no engine state, an unknown route a
404, a missing API key a 401. An engine fault is returned to every in-flight request (HTTP 500, or an error event
in a stream), turns /health to 503 and, when `exit_on_fault` is set (the CLI sets it), exits the process non-zero
right after: a fault never turns into a silent hang.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from flashnext_jax.media import chat_inputs
from flashnext_jax.sampling import truncate_prompt

from . import protocol
from .chat_features import prepare_chat
from .generation import Fault, Generation, error_body
from .metrics import ServerMetrics
from .reasoning import REASONING_PARSERS
from .tool_parsers import TOOL_PARSERS

log = logging.getLogger("flashnext_jax.serving")


def package_version() -> str:
    try:
        return version("flashnext-jax")
    except PackageNotFoundError:
        return "0.1.0+local"


class _Server:
    """What the routes share: the engine, the model's names and limits, the fault state."""

    def __init__(self, llm, model_name: str, exit_on_fault: bool, generation_defaults: dict[str, Any]):
        self.llm, self.model_name, self.exit_on_fault = llm, model_name, exit_on_fault
        self.tokenizer = llm.get_tokenizer()
        self.max_model_len = llm.engine.cfg.max_model_len
        self.vocab_size = llm.runner.vocab_size
        self.defaults = generation_defaults
        self.metrics = ServerMetrics(llm, model_name)
        self.fault_message: str | None = None

    def fault(self, message: str) -> None:
        if self.fault_message is None:
            log.error("engine fault: %s", message)
            self.fault_message = message
            if self.exit_on_fault:  # after the responses in flight got their error
                threading.Timer(0.5, lambda: os._exit(1)).start()

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ValueError(f"model {name!r} is not served here (this server serves {self.model_name!r})")

    def needs_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send token ids")
        return self.tokenizer

    def encode(self, prompt: str | list[int]) -> list[int]:
        ids = self.needs_tokenizer().encode(prompt) if isinstance(prompt, str) else list(prompt)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        return ids

    def truncate(self, ids: list[int], body: protocol._Sampling) -> list[int]:
        """The request's truncate_prompt_tokens applied to a prompt's ids (before vLLM's context rule)."""
        return truncate_prompt(ids, body.truncate_prompt_tokens, self.max_model_len)

    def chat_inputs(self, messages: list[protocol.ChatMessage]) -> tuple[list[dict], list]:
        """The messages as the chat template reads them, and their images decoded under the engine's limits (count,
        pixels, URL schemes and domains: flashnext_jax/media.py). Blocking (decoding, an allowed fetch): the routes
        run it on a worker thread."""
        return chat_inputs([m.openai() for m in messages], self.llm.media)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict | None = None) -> str:
        tokenizer = self.needs_tokenizer()
        try:
            return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 **(kwargs or {}))
        except (jinja2.TemplateError, TypeError) as e:
            raise ValueError(f"the chat template failed on these messages: {e}") from None

    def image_prompt(self, ids: list[int], images: list, processor_kwargs: dict | None = None) -> list[int] | dict:
        """A rendered prompt's ids and its decoded images -> what the engine takes: the ids alone without images,
        else the ids with each image's pads expanded and the preprocessed images (`LLM.image_prompt`, with the
        request's mm_processor_kwargs over the server's)."""
        if not images:
            self.llm.processor_for(processor_kwargs)  # checked all the same: a bad field is a 400, not ignored
            return ids
        ids, processed = self.llm.image_prompt(ids, images, processor_kwargs)
        return {"prompt_token_ids": ids, "images": processed}

    def max_tokens(self, num_prompt: int, requested: int | None) -> int:
        """vLLM's context check: the prompt plus the completion must fit max_model_len; unset: what is left."""
        m = self.max_model_len
        if num_prompt >= m:
            raise ValueError(f"This model's maximum context length (max_model_len) is {m} tokens. However, your "
                             f"request has {num_prompt} input tokens. Please reduce the length of the input.")
        if requested is None:
            return min(m - num_prompt, self.defaults.get("max_tokens", m))
        if requested >= 1 and num_prompt + requested > m:
            raise ValueError(f"This model's maximum context length (max_model_len) is {m} tokens. However, you "
                             f"requested {num_prompt + requested} tokens ({num_prompt} in the prompt, {requested} "
                             "in the completion). Please reduce the length of the prompt or completion.")
        return requested

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "flashnext-jax",
                "root": self.model_name, "parent": None, "max_model_len": self.max_model_len}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        # the deepest error: of a union (content: a string or a list of parts) it names the branch that got furthest
        # rather than the first one tried; union branch labels ("list[...]") are left out of the location
        first = max(exc.errors(), key=lambda e: len(e.get("loc", ())), default={})
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body" and "[" not in str(x))
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return JSONResponse(error_body(f"{where}: {msg}" if where else msg), status_code=400)

    @app.exception_handler(ValueError)
    async def _bad_value(_: Request, exc: ValueError):
        return JSONResponse(error_body(str(exc)), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on "
                   f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(error_body(message, kind, exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Fault)
    async def _engine_fault(_: Request, exc: Fault):
        return JSONResponse(error_body(str(exc), "internal_error", 500), status_code=500)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unexpected error in a request")
        return JSONResponse(error_body(f"internal error: {exc!r}", "internal_error", 500), status_code=500)


def _install_api_key(app: FastAPI, api_key: str | None) -> None:
    """vLLM's --api-key: every /v1 route wants `Authorization: Bearer <key>`."""
    if not api_key:
        return

    @app.middleware("http")
    async def _check_key(request: Request, call_next):
        if request.url.path.startswith("/v1") and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse(error_body("Incorrect or missing API key (Authorization: Bearer <key>)",
                                           "invalid_request_error", 401), status_code=401)
        return await call_next(request)


def create_app(llm, model_name: str, *, exit_on_fault: bool = False, api_key: str | None = None,
               generation_defaults: dict[str, Any] | None = None, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None) -> FastAPI:
    """`generation_defaults`: sampling defaults for fields a request leaves out (SamplingParams names, plus
    max_tokens as the default cap), from the model's generation_config.json (vLLM's --generation-config).
    `tool_call_parser` ("hermes" / "qwen3_xml"): the format chat `tools` calls are parsed from (None: requests
    with tools are a 400); `reasoning_parser` ("qwen3"): return the think block as `reasoning_content`."""
    if tool_call_parser not in (None, *TOOL_PARSERS):
        raise ValueError(f"tool_call_parser {tool_call_parser!r}: not one of {sorted(TOOL_PARSERS)}")
    if reasoning_parser not in (None, *REASONING_PARSERS):
        raise ValueError(f"reasoning_parser {reasoning_parser!r}: not one of {sorted(REASONING_PARSERS)}")
    app = FastAPI(title="flashnext-jax", version=package_version())
    server = _Server(llm, model_name, exit_on_fault, dict(generation_defaults or {}))
    app.state.server = server
    _install_error_handlers(app)
    _install_api_key(app, api_key)

    @app.get("/health")
    async def health():
        if server.fault_message is not None:
            return JSONResponse(error_body(f"engine fault: {server.fault_message}", "internal_error", 503),
                                status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version_():
        return {"version": package_version()}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            return JSONResponse(error_body(f"The model {model_id!r} does not exist", "not_found_error", 404),
                                status_code=404)
        return server.model_card()

    @app.post("/tokenize")
    async def tokenize(body: protocol.TokenizeRequest):
        server.check_model(body.model)
        tokenizer = server.needs_tokenizer()
        text, images = body.prompt, []
        if body.messages is not None:
            messages, images = await asyncio.to_thread(server.chat_inputs, body.messages)
            text = server.render_chat(messages, body.add_generation_prompt)
        ids = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        if images:  # the count the engine sees: each image's pads expanded
            ids = (await asyncio.to_thread(server.image_prompt, ids, images,
                                           body.mm_processor_kwargs))["prompt_token_ids"]
        strs = [tokenizer.tok.id_to_token(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: protocol.DetokenizeRequest):
        server.check_model(body.model)
        return {"prompt": server.needs_tokenizer().decode(server.encode(body.tokens))}

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest):
        server.check_model(body.model)
        raw = body.prompts()
        prompts = [server.truncate(server.encode(p), body) for p in raw]
        texts = None
        if body.echo:  # a truncated prompt echoes what is left of it
            texts = [p if isinstance(p, str) and body.truncate_prompt_tokens is None
                     else server.needs_tokenizer().decode(ids) for p, ids in zip(raw, prompts)]
        return await Generation(server, body, prompts, chat=False, prompt_texts=texts).respond()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: protocol.ChatRequest):
        server.check_model(body.model)
        messages, images = await asyncio.to_thread(server.chat_inputs, body.messages)
        text, shaper, forced = prepare_chat(
            body, lambda kwargs: server.render_chat(messages, body.add_generation_prompt, kwargs),
            tool_call_parser, reasoning_parser)
        if images and body.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens is not supported with images (it would cut their pads)")
        prompt = await asyncio.to_thread(server.image_prompt, server.truncate(server.encode(text), body), images,
                                         body.mm_processor_kwargs)  # resizes, patches
        return await Generation(server, body, [prompt], chat=True, shaper=shaper, forced_grammar=forced).respond()

    return app

