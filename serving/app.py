"""OpenAI-compatible HTTP server over `flashnext_jax.LLM` (FastAPI): /v1/completions, /v1/chat/completions
(both with `stream`), /v1/models, /health.

Bad input is an HTTP 400 with an OpenAI-style error object and touches no engine state. An engine fault is
returned to every in-flight request (HTTP 500, or an error event in a stream) and, when `exit_on_fault` is set
(the CLI sets it), the process exits non-zero right after: a fault never turns into a silent hang.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from flashnext_jax.sampling import SamplingParams

log = logging.getLogger("flashnext_jax.serving")


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = Field(default=None)
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The request's sampling fields, by name, into SamplingParams (which validates them)."""
        fields = {f.name for f in dataclasses.fields(SamplingParams)} & set(type(self).model_fields) - {"logprobs"}
        max_tokens = next((m for m in (self.max_completion_tokens, self.max_tokens) if m is not None),
                          default_max_tokens)
        return SamplingParams(**(self.model_dump(include=fields) | {"max_tokens": max_tokens,
                                                                   "logprobs": self.num_logprobs()}))

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: how many top logprobs per token, None for none."""
        return None


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = None  # the completions API: n top logprobs per token (0: the chosen token's only)

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False  # the chat API: the chosen tokens' logprobs, plus top_logprobs most likely each
    top_logprobs: int | None = None

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class LogprobFormat:
    """An output's TokenLogprobs as the OpenAI APIs write them, token strings from the model's tokenizer (token ids
    as strings without one). `offset` carries the completions API's text_offset across stream chunks."""

    def __init__(self, tokenizer):
        self.tokenizer, self.offset = tokenizer, 0

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def completion(self, lps) -> dict | None:
        if lps is None:
            return None
        tokens = [self.text(t.token_id) for t in lps]
        offsets = []
        for tok in tokens:
            offsets.append(self.offset)
            self.offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [t.logprob for t in lps],
                "top_logprobs": [{self.text(i): lp for i, lp in t.top} for t in lps], "text_offset": offsets}

    def chat(self, lps) -> dict | None:
        if lps is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            tok = self.text(token_id)
            return {"token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8"))}
        return {"content": [entry(t.token_id, t.logprob) | {"top_logprobs": [entry(i, lp) for i, lp in t.top]}
                            for t in lps]}


def error_body(message: str, kind: str = "invalid_request_error", code: int = 400) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class _Fault(Exception):
    """The engine failed: every in-flight request gets this."""


def create_app(llm, model_name: str, *, exit_on_fault: bool = False, default_max_tokens: int = 256) -> FastAPI:
    app = FastAPI(title="flashnext-jax", version="0.1")

    def fault(message: str) -> None:
        log.error("engine fault: %s", message)
        if exit_on_fault:  # after the responses in flight got their error
            threading.Timer(0.5, lambda: os._exit(1)).start()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return JSONResponse(error_body(f"{where}: {first.get('msg', 'invalid request')}"), status_code=400)

    @app.exception_handler(ValueError)
    async def _bad_value(_: Request, exc: ValueError):
        return JSONResponse(error_body(str(exc)), status_code=400)

    @app.exception_handler(_Fault)
    async def _engine_fault(_: Request, exc: _Fault):
        return JSONResponse(error_body(str(exc), "internal_error", 500), status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "flashnext-jax"}]}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ValueError(f"model {name!r} is not served here (this server serves {model_name!r})")

    async def outputs(prompt, params: SamplingParams) -> AsyncIterator[Any]:
        """The request's outputs; a ValueError before the first one is bad input (400), anything else a fault."""
        started = False
        try:
            async for out in llm.stream(prompt, params):
                started = True
                yield out
        except Exception as e:
            if isinstance(e, ValueError) and not started:
                raise
            fault(repr(e))
            raise _Fault(f"engine fault: {e!r}") from None

    async def run(prompt, body: _Sampling, *, chat: bool):
        check_model(body.model)
        params = body.sampling_params(default_max_tokens)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        gen = outputs(prompt, params)
        first = await gen.__anext__()  # raises ValueError -> 400 / _Fault -> 500 before the response starts
        if body.stream:
            return StreamingResponse(_sse(first, gen, rid, created, chat), media_type="text/event-stream")
        last = first
        async for out in gen:
            last = out
        if last.finish_reason == "error":
            fault(last.error or "request failed")
            raise _Fault(last.error or "engine fault")
        usage = {"prompt_tokens": len(last.prompt_token_ids), "completion_tokens": len(last.token_ids),
                 "total_tokens": len(last.prompt_token_ids) + len(last.token_ids)}
        fmt = LogprobFormat(llm.get_tokenizer())
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": last.text},
                      "logprobs": fmt.chat(last.logprobs), "finish_reason": last.finish_reason}
        else:
            choice = {"index": 0, "text": last.text, "token_ids": last.token_ids,
                      "logprobs": fmt.completion(last.logprobs), "finish_reason": last.finish_reason}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "choices": [choice], "usage": usage}

    async def _sse(first, gen, rid: str, created: int, chat: bool):
        fmt = LogprobFormat(llm.get_tokenizer())

        def chunk(out) -> str:
            if chat:
                choice = {"index": 0, "delta": {"content": out.delta_text}, "logprobs": fmt.chat(out.delta_logprobs),
                          "finish_reason": out.finish_reason if out.finished else None}
            else:
                choice = {"index": 0, "text": out.delta_text, "token_ids": out.delta_token_ids,
                          "logprobs": fmt.completion(out.delta_logprobs),
                          "finish_reason": out.finish_reason if out.finished else None}
            body = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                    "model": model_name, "choices": [choice]}
            return f"data: {json.dumps(body)}\n\n"

        if chat:
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
            yield f"data: {json.dumps(head)}\n\n"
        yield chunk(first)
        try:
            async for out in gen:
                if out.finish_reason == "error":
                    fault(out.error or "request failed")
                    yield f"data: {json.dumps(error_body(out.error or 'engine fault', 'internal_error', 500))}\n\n"
                    return
                yield chunk(out)
        except _Fault as e:
            yield f"data: {json.dumps(error_body(str(e), 'internal_error', 500))}\n\n"
            return
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        if isinstance(body.prompt, str) and not body.prompt or isinstance(body.prompt, list) and not body.prompt:
            raise ValueError("prompt must not be empty")
        return await run(body.prompt, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        tokenizer = llm.get_tokenizer()
        if tokenizer is None:
            raise ValueError("this model has no tokenizer/chat template: use /v1/completions with token ids")
        prompt = tokenizer.apply_chat_template([m.model_dump() for m in body.messages], add_generation_prompt=True)
        return await run(prompt, body, chat=True)

    return app
