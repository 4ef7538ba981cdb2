"""The client's request as the flows see it: the raw body and a typed view of it."""

from __future__ import annotations

from typing import Any

from connectors import PeerInfo
from pd_orchestrator.model.records import record
from pd_orchestrator.openai.protocol import ChatCompletionRequest, OpenAIRequest, message_text
from pd_orchestrator.openai.responses import Kind

__all__ = [
    "CARRIED_FIELDS",
    "CHAT_ONLY_FIELDS",
    "TOKEN_ID_CHARS",
    "UNCONTINUABLE_FIELDS",
    "UNTOKENIZABLE_FIELDS",
    "ClientRequest",
    "NamedTool",
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
"""Fields dropped when a request continues as a token prompt on ``/v1/completions``
(``response_format`` and ``structured_outputs`` are fields of both APIs: kept)."""

CARRIED_FIELDS = ("response_format", "structured_outputs")
"""Constraints a continuation carries: both APIs take them, and a decoder whose plugin
honours ``cache_hit_resume_tokens`` advances their grammar over the tokens already
generated (a request that sets one is :attr:`ClientRequest.resumable`)."""

UNCONTINUABLE_FIELDS = (
    "tools",
    "tool_choice",
    "functions",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "prompt_logprobs",
)
"""Fields a continuation cannot honour: a token prompt on ``/v1/completions`` loses the
chat shape of tool calls parsed from free text (a named ``tool_choice`` excepted: see
:attr:`ClientRequest.named_tool`); its prompt logprobs would be the continuation's prompt's;
the ``guided_*`` fields are no longer read by vLLM 0.32/0.33 (so nothing can carry
them). A request that sets one (to anything but its neutral value) is never handed
back. (``logprobs`` and ``top_logprobs`` are continued: the continuation asks for
them and the gateway renders them in the client's shape.)"""

_CONSTRAINING = (*UNCONTINUABLE_FIELDS, *CARRIED_FIELDS)

UNTOKENIZABLE_FIELDS = (
    "echo",
    "suffix",
    "truncate_prompt_tokens",
    "prompt_embeds",
    "reasoning_effort",
    "documents",
    "media_io_kwargs",
    "logprobs",
    "top_logprobs",
)
"""Fields that keep a request's prompt as the client sent it (never sent as token ids,
see :attr:`ClientRequest.tokenizable`): they change what the route does with the
prompt's text, or how a chat template renders it beyond what ``/tokenize`` reads, or
(logprobs) what the original leg's answer carries beyond its text and tokens."""

_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tool_choice": (None, "none"),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "prompt_logprobs": (None, 0),
    "echo": (None, False),
    "truncate_prompt_tokens": (None,),
}


_NAMED_TOOL_FIELDS = frozenset({"tools", "tool_choice"})


@record
class NamedTool:
    """The function a named ``tool_choice`` forces and the JSON schema of its arguments."""

    name: str
    parameters: Any


@record
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
        serve exactly what was asked, on any decoder (sets nothing of
        :data:`UNCONTINUABLE_FIELDS` or :data:`CARRIED_FIELDS`)."""
        return not _sets(self.body, _CONSTRAINING)

    @property
    def resumable(self) -> bool:
        """Whether a continuation serves exactly what was asked where the plugin advances
        the grammar (``cache_hit_resume_tokens``): the request sets a field of
        :data:`CARRIED_FIELDS` or names the tool it must call (:attr:`named_tool`), and
        nothing else of :data:`UNCONTINUABLE_FIELDS`."""
        if self.continuable:  # most requests: no named tool, nothing carried
            return False
        if self.uncontinuable_field is not None:
            return False
        return self.named_tool is not None or bool(_sets(self.body, CARRIED_FIELDS))

    @property
    def uncontinuable_field(self) -> str | None:
        """The first field of :data:`UNCONTINUABLE_FIELDS` the request sets, or None
        (``tools`` and ``tool_choice`` of a :attr:`named_tool` are continued)."""
        named = self.named_tool is not None
        for name in _sets(self.body, UNCONTINUABLE_FIELDS):
            if not (named and name in _NAMED_TOOL_FIELDS):
                return name
        return None

    @property
    def named_tool(self) -> NamedTool | None:
        """The function a chat request's ``tool_choice`` names, when ``tools`` defines it:
        vLLM constrains the answer to the JSON of its ``parameters`` (an empty object
        schema when it has none) and returns the text as that call's arguments."""
        choice = self.body.get("tool_choice")
        if self.kind != "chat" or not isinstance(choice, dict) or choice.get("type") != "function":
            return None
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        tools = self.body.get("tools")
        if not isinstance(name, str) or not isinstance(tools, list):
            return None
        for tool in tools:
            defined = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(defined, dict) and defined.get("name") == name:
                parameters = defined.get("parameters")
                return NamedTool(name, parameters or {"type": "object", "properties": {}})
        return None

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
        return not _sets(self.body, UNTOKENIZABLE_FIELDS) and self.continuable

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


def _sets(body: dict[str, Any], names: tuple[str, ...]) -> tuple[str, ...]:
    """The fields of ``names`` that ``body`` sets to something other than their
    neutral value (None; ``_NEUTRAL``'s; a ``text`` response format), in the order of
    ``names``."""
    if body.keys().isdisjoint(names):  # most requests: none of them, found in C
        return ()
    return tuple([name for name in names if name in body and _setting(name, body[name])])


def _setting(name: str, value: Any) -> bool:
    """Whether ``value`` of the field ``name`` sets it (:func:`_sets`)."""
    if value in _NEUTRAL.get(name, (None,)):
        return False
    return not (name == "response_format" and _plain_text(value))


def _plain_text(response_format: Any) -> bool:
    return isinstance(response_format, dict) and response_format.get("type") == "text"
