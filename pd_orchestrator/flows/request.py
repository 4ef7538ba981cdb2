"""The client's request as the flows see it: the raw body and a typed view of it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from connectors import PeerInfo
from pd_orchestrator.openai.protocol import ChatCompletionRequest, OpenAIRequest, message_text
from pd_orchestrator.openai.responses import Kind

__all__ = [
    "CHAT_ONLY_FIELDS",
    "TOKEN_ID_CHARS",
    "UNCONTINUABLE_FIELDS",
    "UNTOKENIZABLE_FIELDS",
    "ClientRequest",
]

TOKEN_ID_CHARS = 4
"""Characters a token-id prompt counts per token in :attr:`ClientRequest.prompt_chars`."""

CHAT_ONLY_FIELDS = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "documents",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "echo",
        "suffix",
        "mm_processor_kwargs",
        "reasoning_effort",
    }
)
"""Fields dropped when a request continues as a token prompt on ``/v1/completions``."""

UNCONTINUABLE_FIELDS = (
    "tools",
    "tool_choice",
    "functions",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
)
"""Fields a continuation cannot honour: a token prompt on ``/v1/completions`` loses a
constraint's state (tools, structured outputs) and the chat shape of logprobs. A
request that sets one (to anything but its neutral value) is never handed back."""

UNTOKENIZABLE_FIELDS = (
    "echo",
    "suffix",
    "truncate_prompt_tokens",
    "prompt_embeds",
    "reasoning_effort",
    "documents",
    "media_io_kwargs",
)
"""Fields that keep a request's prompt as the client sent it (never sent as token ids,
see :attr:`ClientRequest.tokenizable`): they change what the route does with the
prompt's text, or how a chat template renders it beyond what ``/tokenize`` reads."""

_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tool_choice": (None, "none"),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "prompt_logprobs": (None, 0),
    "echo": (None, False),
    "truncate_prompt_tokens": (None,),
}


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """One client request: API kind and path, the body as sent, and its typed view."""

    kind: Kind
    path: str
    body: dict[str, Any]
    view: OpenAIRequest
    request_id: str
    arrival: float
    kv_source: PeerInfo | None = None
    """An instance that holds the prompt's prefix, named by an upstream scheduler
    (llm-d's ``x-kv-cache-source-host-port``); connectors that pull from peers use it."""
    prompt_ids: tuple[int, ...] | None = None
    """The prompt's token ids when the gateway already has them (the precise prefix
    index asked a decoder's ``/tokenize``), as the prompt's API would compute them."""

    @property
    def stream(self) -> bool:
        return self.view.stream

    @property
    def continuable(self) -> bool:
        """Whether a continuation (prompt + generated tokens as a token prompt) would
        serve exactly what was asked (see :data:`UNCONTINUABLE_FIELDS`)."""
        return not any(_sets(self.body, UNCONTINUABLE_FIELDS))

    @property
    def tokenizable(self) -> bool:
        """Whether the prompt may go to decoders as token ids on ``/v1/completions``
        with the same answer (re-rendered in the client's API): a text prompt or
        text-only messages, a :attr:`continuable` request (what a token prompt drops
        is what a continuation drops), none of :data:`UNTOKENIZABLE_FIELDS` set."""
        view = self.view
        if isinstance(view, ChatCompletionRequest):
            for message in view.messages:
                content = message.content
                if isinstance(content, list) and any(p.type != "text" for p in content):
                    return False
        elif not isinstance(view.prompt, str):
            return False
        return not any(_sets(self.body, UNTOKENIZABLE_FIELDS)) and self.continuable

    @property
    def want_token_ids(self) -> bool:
        return self.view.return_token_ids

    @property
    def include_usage(self) -> bool:
        return self.view.include_usage

    @property
    def model(self) -> str:
        return self.view.model

    @property
    def max_tokens(self) -> int | None:
        return self.view.output_limit()

    @property
    def prompt_chars(self) -> int:
        """Characters of the prompt (a token estimate without a tokenizer)."""
        view = self.view
        if isinstance(view, ChatCompletionRequest):
            return sum(len(message_text(m)) + len(m.role) + 8 for m in view.messages)
        if isinstance(view.prompt, str):
            return len(view.prompt)
        return TOKEN_ID_CHARS * len(view.prompt)

    def affinity_key(self, limit: int = 4096) -> str:
        """The start of the prompt: up to and including the first user message for chat.

        Turns of one conversation share it, so routing by it keeps a conversation on
        the decoder that holds its prefix.
        """
        view = self.view
        if isinstance(view, ChatCompletionRequest):
            parts: list[str] = []
            for message in view.messages:
                parts.append(f"{message.role}:{message_text(message)}")
                if message.role == "user":
                    break
            return "\n".join(parts)[:limit]
        if isinstance(view.prompt, str):
            return view.prompt[:limit]
        return ",".join(map(str, view.prompt[: limit // 4]))


def _sets(body: dict[str, Any], names: tuple[str, ...]) -> Iterator[str]:
    """The fields of ``names`` that ``body`` sets to something other than their
    neutral value (None; ``_NEUTRAL``'s; a ``text`` response format)."""
    for name in names:
        if name in body and body[name] not in _NEUTRAL.get(name, (None,)):
            if not (name == "response_format" and _plain_text(body[name])):
                yield name


def _plain_text(response_format: Any) -> bool:
    return isinstance(response_format, dict) and response_format.get("type") == "text"
