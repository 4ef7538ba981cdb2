"""Typed views of OpenAI-compatible requests (completions and chat completions).

The models validate the fields the simulator and the gateway act on and keep every
other field as an extra (``model_extra``), the way vLLM accepts and ignores unknown
fields. :func:`parse_request` turns a JSON body into a model or a
:class:`RequestError` whose message names the offending field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pd_orchestrator.vllm_plugin.policy import parse_count, parse_flag

__all__ = [
    "MAX_CHOICES",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "OpenAIRequest",
    "RequestError",
    "StreamOptions",
    "decode_json_object",
    "message_text",
    "parse_for",
    "parse_request",
    "render_chat",
]


class RequestError(ValueError):
    """A request body that does not validate; ``param`` names the field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class StreamOptions(_Model):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


Threshold = Annotated[float, Field(ge=0.0, le=1.0)]
MAX_CHOICES = 16
"""The most choices (``n``) one request may ask for."""


class _CommonRequest(_Model):
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    cache_hit_threshold: Threshold | None = None
    cache_hit_admission_only: bool | None = None
    """The threshold applies at admission only (a preempted request is recomputed,
    never handed back); true or false (0, 1, "true", "false" as vLLM's plugin takes)."""

    cache_hit_resume_tokens: int | None = None
    """Output tokens at the prompt's end (a continuation's): the grammar of a structured
    output is advanced over them first; an integer >= 0 as vLLM's plugin takes."""

    @field_validator("cache_hit_admission_only", mode="before")
    @classmethod
    def _flag(cls, value: Any) -> Any:
        return parse_flag(value, "cache_hit_admission_only")  # as the plugin reads it

    @field_validator("cache_hit_resume_tokens", mode="before")
    @classmethod
    def _count(cls, value: Any) -> Any:
        return parse_count(value, "cache_hit_resume_tokens")  # as the plugin reads it

    @field_validator("n")
    @classmethod
    def _choices_in_range(cls, value: int) -> int:
        if not 1 <= value <= MAX_CHOICES:
            raise ValueError(f"n must be between 1 and {MAX_CHOICES}")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def output_limit(self) -> int | None:
        """The client's output token limit, if it set one."""
        return self.max_tokens


class CompletionRequest(_CommonRequest):
    """``POST /v1/completions``; ``prompt`` is text or a list of token ids."""

    prompt: str | list[int]


class _TextPart(_Model):
    type: str
    text: str | None = None


class ChatMessage(_Model):
    role: str
    content: str | list[_TextPart] | None = None


class ChatCompletionRequest(_CommonRequest):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    add_generation_prompt: bool = True

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


OpenAIRequest = CompletionRequest | ChatCompletionRequest
_R = TypeVar("_R", CompletionRequest, ChatCompletionRequest)


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object; raise :class:`RequestError`
    (the one decoder of client bodies: the gateway's and the simulator's)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def parse_for(kind: Literal["completion", "chat"], body: dict[str, Any]) -> OpenAIRequest:
    """Validate ``body`` as a completions or a chat request; raise :class:`RequestError`."""
    if kind == "completion":
        return parse_request(CompletionRequest, body)
    return parse_request(ChatCompletionRequest, body)


def parse_request(model_cls: type[_R], body: Any) -> _R:
    """Validate ``body`` (decoded JSON) as ``model_cls``; raise :class:`RequestError`."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(part) for part in first["loc"])
        param = str(first["loc"][0]) if first["loc"] else None
        raise RequestError(f"{loc}: {first['msg']}", param=param) from None


def message_text(message: ChatMessage) -> str:
    """The text of a chat message (text parts joined; other parts ignored)."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text or "" for part in content if part.type == "text")


def render_chat(messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
    """The simulator's chat template, documented and deterministic::

        <|{role}|>\\n{content}<|end|>\\n      for each message, in order
        <|assistant|>\\n                      when add_generation_prompt

    Rendering is prefix-stable: the prompt of turn n+1 starts with the prompt of
    turn n followed by the assistant's answer, so a conversation's next turn hits
    the prefix cache through the previous answer.
    """
    parts = [f"<|{m.role}|>\n{message_text(m)}<|end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)
