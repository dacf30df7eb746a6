"""One completions / chat request through the engine: its prompts' streams merged, answered whole or as SSE.

A ValueError before the first output is bad input (400); any other failure, or an output finished with "error",
is an engine fault (500, or an error event in a stream) reported to the server (`_Server.fault`).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from . import protocol
from .chat_features import ChatShaper, grammar_after_thinking
from .logprobs import LogprobFormat
from .streaming import TextDeltas, merged


class Fault(Exception):
    """The engine failed: every in-flight request gets this."""


def error_body(message: str, kind: str = "invalid_request_error", code: int = 400) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


class Generation:
    def __init__(self, server, body: protocol._Sampling, prompts: list[list[int] | dict], *, chat: bool,
                 prompt_texts: list[str] | None = None, shaper: ChatShaper | None = None, forced_grammar=None):
        """`prompts`: token ids, or an image prompt's dict (`_Server.image_prompt`: expanded ids and images).
        `prompt_texts`: the prompts as text, for completions' echo. Chat (one prompt): `shaper` turns the
        output text into the message / deltas (tool calls, reasoning); `forced_grammar` is a forced tool call's
        constraint, in place of the request's."""
        self.server, self.body, self.prompts, self.chat = server, body, prompts, chat
        self.echo = getattr(body, "echo", False)
        self.prompt_texts = prompt_texts
        self.shaper = shaper or ChatShaper()
        requested = body.requested_max_tokens()
        lengths = [len(p["prompt_token_ids"]) if isinstance(p, dict) else len(p) for p in prompts]
        self.params = [self._constrained(body.sampling_params(server.max_tokens(n, requested), server.defaults),
                                         forced_grammar) for n in lengths]
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _constrained(self, params, forced_grammar):
        if forced_grammar is not None:
            params = dataclasses.replace(params, structured_outputs=forced_grammar)
        return grammar_after_thinking(params, self.shaper) if self.chat else params

    async def _outputs(self, prompt: list[int] | dict, params) -> AsyncIterator[Any]:
        started = False
        try:
            async for out in self.server.llm.stream(prompt, params):
                if out.finish_reason == "error":
                    raise RuntimeError(out.error or "request failed")
                started = True
                yield out
        except Exception as e:
            if isinstance(e, ValueError) and not started:
                raise
            self.server.fault(repr(e))
            raise Fault(f"engine fault: {e!r}") from None

    async def respond(self):
        streams = [self.server.metrics.track(self._outputs(p, sp)) for p, sp in zip(self.prompts, self.params)]
        outputs = merged(streams)
        try:
            first = await outputs.__anext__()  # ValueError -> 400, Fault -> 500, before the response starts
        except BaseException:
            await outputs.aclose()
            raise
        if self.body.stream:
            return StreamingResponse(self._stream(first, outputs), media_type="text/event-stream")
        last: dict[int, Any] = {first[0]: first[1]}
        async for i, out in outputs:
            last[i] = out
        choices = [self._choice(i, last[i]) for i in range(len(self.prompts))]
        return self._envelope(self.object, choices) | {"usage": self._usage(last.values())}

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.server.model_name,
                "choices": choices}

    @staticmethod
    def _usage(outs) -> dict:
        p, c = sum(len(o.prompt_token_ids) for o in outs), sum(len(o.token_ids) for o in outs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _choice(self, index: int, out) -> dict:
        fmt = LogprobFormat(self.server.tokenizer)
        if self.chat:
            message, finish_reason = self.shaper.message(out.text, out.finish_reason)
            return {"index": index, "message": message, "logprobs": fmt.chat(out.logprobs),
                    "finish_reason": finish_reason}
        if self.echo:  # the prompt first: text offsets run on from it
            text, lps = self._echoed(index, fmt, out, "", None)
            done = fmt.completion(out.logprobs)
            text, lps = text + out.text, done if lps is None else fmt.joined(lps, done)
        else:
            text, lps = out.text, fmt.completion(out.logprobs)
        return {"index": index, "text": text, "token_ids": out.token_ids, "logprobs": lps,
                "finish_reason": out.finish_reason}

    def _echoed(self, index: int, fmt: LogprobFormat, out, text: str, lps: dict | None):
        """echo: the prompt's text (and, with logprobs, its tokens' logprobs) before the completion's."""
        if lps is not None or out.logprobs is not None:
            lps = fmt.joined(fmt.prompt(out.prompt_token_ids, out.prompt_logprobs), lps)
        return self.prompt_texts[index] + text, lps

    async def _stream(self, first, outputs) -> AsyncIterator[str]:
        n = len(self.prompts)
        texts = [TextDeltas(sp.stop) for sp in self.params]
        fmts = [LogprobFormat(self.server.tokenizer) for _ in range(n)]
        sent_tokens, last, echoed = [0] * n, {}, [False] * n
        include_usage = self.body.stream_options is not None and self.body.stream_options.include_usage
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        extra = {"usage": None} if include_usage else {}

        def chunk(i: int, out) -> str | None:
            text = texts[i].delta(out.text, out.finished)
            ids, lps = out.token_ids[sent_tokens[i]:], (out.logprobs or [])[sent_tokens[i]:]
            if not (text or ids or out.finished):
                return None
            sent_tokens[i] = len(out.token_ids)
            last[i] = out
            lp = None if out.logprobs is None else lps
            finish = out.finish_reason if out.finished else None
            if self.chat:  # the shaper reads what the stop-string hold-back lets out so far
                deltas, finish = self.shaper.deltas(out.text[:texts[i].sent], out.finished, finish)
                delta = {k: v for d in deltas for k, v in d.items()} or {"content": ""}
                choice = {"index": i, "delta": delta, "logprobs": fmts[i].chat(lp), "finish_reason": finish}
            else:
                if self.echo and not echoed[i]:  # the first chunk carries the prompt
                    echoed[i] = True
                    prompt = LogprobFormat(self.server.tokenizer)
                    head_text, head_lps = self._echoed(i, prompt, out, "", None)
                    fmts[i].offset = prompt.offset
                    lps = fmts[i].completion(lp)
                    choice = {"index": i, "text": head_text + text, "token_ids": ids,
                              "logprobs": lps if head_lps is None else LogprobFormat.joined(head_lps, lps),
                              "finish_reason": finish}
                else:
                    choice = {"index": i, "text": text, "token_ids": ids, "logprobs": fmts[i].completion(lp),
                              "finish_reason": finish}
            return _sse(self._envelope(obj, [choice]) | extra)

        try:
            if self.chat:
                for i in range(n):
                    yield _sse(self._envelope(obj, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]) | extra)
            if (c := chunk(*first)) is not None:
                yield c
            async for i, out in outputs:
                if (c := chunk(i, out)) is not None:
                    yield c
        except Fault as e:
            yield _sse(error_body(str(e), "internal_error", 500))
            yield _sse("[DONE]")
            return
        finally:
            await outputs.aclose()
        if include_usage:
            yield _sse(self._envelope(obj, []) | {"usage": self._usage(last.values())})
        yield _sse("[DONE]")
