"""The server's request bodies (pydantic), with vLLM's and OpenAI's field names.

A field is either honoured or rejected: OpenAI fields this server does not implement are listed in
UNSUPPORTED_FIELDS and answered with a 400 naming them, and fields no API knows are a 400 as well (a typo must not
turn into a silently ignored option). Features that land later remove their name from UNSUPPORTED_FIELDS and add
the field to the request model.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flashnext_jax.sampling import SamplingParams

from .structured import constraint_of

# OpenAI / vLLM request fields that are known but not implemented here: a request that sets one (to anything but
# null) gets a 400 naming it. response_format / structured_outputs (both endpoints) and chat tools / tool_choice /
# parallel_tool_calls are honoured (serving/structured.py, serving/chat_features.py); OpenAI's legacy functions /
# function_call and vLLM's deprecated guided_* spellings are not.
UNSUPPORTED_FIELDS = frozenset({
    "echo", "suffix",  # echo: completions only
    "functions", "function_call",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "modalities", "audio", "prediction", "web_search_options", "reasoning_effort", "store", "metadata",
    "service_tier", "logprobs_mode", "prompt_logprobs", "return_tokens_as_token_ids", "use_beam_search",
    "length_penalty", "add_special_tokens", "priority",
})
# accepted and deliberately without effect on the output (request metadata)
NO_EFFECT_FIELDS = frozenset({"user"})


class _Strict(BaseModel):
    """Extra fields are collected and rejected by name (see UNSUPPORTED_FIELDS); the OpenAPI schema says none are
    allowed."""
    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})

    @model_validator(mode="after")
    def _reject_extra(self):
        for name, value in (self.model_extra or {}).items():
            if name in NO_EFFECT_FIELDS or (name in UNSUPPORTED_FIELDS and value is None):
                continue
            if name in UNSUPPORTED_FIELDS:
                raise ValueError(f"the field {name!r} is not supported by this server")
            raise ValueError(f"unknown field {name!r}")
        return self


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: token id (a JSON key, so a string) -> bias
    response_format: dict[str, Any] | None = None  # OpenAI's output constraint (serving/structured.py)
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    # vLLM's SamplingParams fields: min_tokens (EOS / stop_token_ids banned and stop strings unchecked before this
    # many tokens), allowed_token_ids (only these), bad_words (never these words: flashnext_jax/token_bans.py),
    # the output text's special tokens, and the prompt cut to its last truncate_prompt_tokens (-1: max_model_len)
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, value):
        if value is not None and value < 1 and value != -1:
            raise ValueError("must be an int >= 1, or -1 (the model's max length)")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, max_tokens: int, defaults: dict[str, Any]) -> SamplingParams:
        """The request's sampling fields into SamplingParams (which validates them); fields the request leaves
        out take `defaults` (the model's generation config, vLLM's --generation-config) or SamplingParams'."""
        # (truncate_prompt_tokens: the server cuts the prompt itself, before its context-length check)
        names = {f.name for f in dataclasses.fields(SamplingParams)} & set(type(self).model_fields) - {
            "logprobs", "logit_bias", "structured_outputs", "truncate_prompt_tokens"}
        given = {k: v for k, v in self.model_dump(include=names).items() if v is not None}
        fields = {k: v for k, v in defaults.items() if k in names} | given
        return SamplingParams(**fields | {"max_tokens": max_tokens, "logprobs": self.num_logprobs(),
                                          "logit_bias": self.token_bias(),
                                          "structured_outputs": constraint_of(self.response_format,
                                                                              self.structured_outputs),
                                          **self.extra_params()})

    def token_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {list(self.logit_bias)[:5]}") from None

    def extra_params(self) -> dict:
        """Further SamplingParams fields this API sets."""
        return {}

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: how many top logprobs per token, None for none."""
        return None


class CompletionRequest(_Sampling):
    # one prompt (text or token ids) or a batch of them (texts or token-id lists): one choice per prompt
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # the completions API: n top logprobs per token (0: the chosen token's only)
    best_of: int | None = None
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt tokens' logprobs too)

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported (only best_of equal to n)")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        batch = p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
        if not batch or any(len(x) == 0 for x in batch):
            raise ValueError("prompt must not be empty")
        return batch

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def extra_params(self) -> dict:
        return {"prompt_logprobs": self.logprobs} if self.echo and self.logprobs is not None else {}


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str  # data:image/...;base64,... (http(s) only from --allowed-media-domains: flashnext_jax/media.py)
    detail: Literal["auto"] | None = None  # OpenAI's "low" / "high" would ask for another resolution: refused

    @field_validator("detail", mode="before")
    @classmethod
    def _detail_is_auto(cls, value):
        if value not in (None, "auto"):
            raise ValueError(f"detail {value!r} is not supported (only 'auto'): images are read at the size the "
                             "model's image processor chooses")
        return value


class ImagePart(_Strict):
    """OpenAI's image content part; the server decodes it (flashnext_jax/media.py) and the chat template renders
    its placeholder."""
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_present(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant message with tool_calls may "
                             "have content: null)")
        return self

    def openai(self) -> dict:
        """The message as an OpenAI-style dict, role developer as system (as vLLM does), content null as ''
        (templates concatenate it); content parts stay parts (media.chat_inputs joins text-only lists and loads
        the images)."""
        content = self.content
        if isinstance(content, list):
            content = [p.model_dump(exclude_none=True) for p in content]
        msg = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        for k in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, k) is not None:
                msg[k] = getattr(self, k)
        return msg


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False  # the chat API: the chosen tokens' logprobs, plus top_logprobs most likely each
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}, for the chat template
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's: the image processor's resize bounds, this request
    tools: list[dict[str, Any]] | None = None  # serving/chat_features.py (needs --tool-call-parser)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered with the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    mm_processor_kwargs: dict[str, Any] | None = None  # as the chat request's, so that the counts agree

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
