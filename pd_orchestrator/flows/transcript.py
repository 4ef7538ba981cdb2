"""What the client has been told so far, across every leg (pure).

A request may be served by several legs: the decoder's attempt, a decode leg after
a prefill, continuations after hand-backs. The transcript records the original
prompt, every generated token, the text, the finish and the usage figures, and
builds the merged usage and the whole answer from them. Text is kept only when a
whole answer will be built (``keep_text``); a stream's text goes straight out. When
the client asked logprobs, a whole answer's are merged in its shape, and where the
next completions offset starts is kept (:mod:`~pd_orchestrator.flows.logprobs`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from pd_orchestrator.flows.chunks import ChunkView, Identity
from pd_orchestrator.flows.logprobs import (
    LogprobsRecord,
    continuation_logprobs,
    for_client,
    next_offset,
)
from pd_orchestrator.flows.request import ClientRequest, NamedTool
from pd_orchestrator.openai.responses import Kind, Usage, cached_count, completion_body

__all__ = ["Transcript", "tool_call_id"]

Json = dict[str, Any]


@dataclass
class Transcript:
    """Everything generated for one client request."""

    request: ClientRequest
    identity: Identity | None = None
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int = 0
    handbacks: int = 0
    template: Json | None = None
    keep_text: bool = True
    limit: int | None = field(init=False)
    """The client's output token limit (None: none), read once: it is asked per chunk."""
    top: int | None = field(init=False)
    """Alternatives per token the client asked logprobs with (None: no logprobs)."""
    offset: int = 0
    """The completions ``text_offset`` of the next token the client gets logprobs for
    (vLLM counts each token's string: the last offset plus its token's length); a
    continuation's offsets start there."""
    logprobs: LogprobsRecord | None = field(init=False)
    """A whole answer's logprobs, leg after leg (None: not asked)."""

    tool: NamedTool | None = field(init=False)
    """The function a named tool choice forces: the answer's text is its arguments."""

    def __post_init__(self) -> None:
        request = self.request
        self.limit = request.max_tokens
        self.tool = request.named_tool
        self.top = continuation_logprobs(request.body, request.kind)
        self.logprobs = None if self.top is None else LogprobsRecord(request.kind)

    @property
    def remaining(self) -> int | None:
        """Tokens the client still allows (None: no limit)."""
        limit = self.limit
        return None if limit is None else limit - len(self.generated)

    def continuation_prompt(self) -> list[int]:
        """Original prompt ids then every generated id: what a continuation resubmits."""
        if self.prompt_ids is None:
            raise ValueError("the decoder did not return the prompt's token ids")
        return [*self.prompt_ids, *self.generated]

    def adopt_identity(self, raw: Json) -> Identity:
        """Take the client-visible id, time and model from the first answer seen (a
        chat client's id keeps vLLM's chat prefix when that answer is a completions
        one: the prompt went as token ids)."""
        if self.identity is None:
            response_id = str(raw.get("id") or f"pdo-{self.request.request_id}")
            if self.request.kind == "chat" and response_id.startswith("cmpl-"):
                response_id = f"chat{response_id}"
            self.identity = Identity(
                response_id=response_id,
                created=int(raw.get("created") or 0),
                model=str(raw.get("model") or self.request.model),
            )
        return self.identity

    def shape_logprobs(self, logprobs: Any, leg: Kind, start: int) -> Any:
        """A leg's ``logprobs`` in the client's shape (offsets from ``start``, where the
        leg began); the next offset moves past them."""
        shaped = for_client(logprobs, leg, self.request.kind, self.top or 0, start)
        self.offset = next_offset(shaped, self.offset)
        return shaped

    def absorb(self, view: ChunkView, *, original_prompt: bool) -> None:
        """Record a chunk's tokens, text and, for the original prompt's leg, its figures."""
        if view.prompt_token_ids is not None and self.prompt_ids is None and original_prompt:
            self.prompt_ids = list(view.prompt_token_ids)
        if view.token_ids is not None:
            self.generated.extend(view.token_ids)
        text = view.text or (view.arguments if self.tool is not None else "")
        if text and self.keep_text:
            self.text.append(text)
        if view.finish_reason is not None:
            self.finish_reason = view.finish_reason

    def absorb_usage(self, usage: Json | None, *, original_prompt: bool, leg_tokens: int) -> None:
        """Add one leg's usage: ``leg_tokens``, the tokens of it the client got, counted
        by their ids whether the leg finished or broke (each token once: a continuation
        generates only what comes after them); what ``usage`` reports only for a leg
        that returned no ids. Prompt figures once, from the original prompt's leg; the
        cached count stays None when ``usage`` has no ``prompt_tokens_details`` (a cold
        prompt or a server that does not report it: the gateway tells them apart)."""
        reported = usage.get("completion_tokens") if usage else None
        if not leg_tokens and isinstance(reported, int):
            leg_tokens = reported
        self.completion_tokens += leg_tokens
        if not original_prompt or usage is None or self.prompt_tokens is not None:
            return
        prompt = usage.get("prompt_tokens")
        self.prompt_tokens = prompt if isinstance(prompt, int) else None
        self.cached_tokens = cached_count(usage)  # None: not said

    def usage(self) -> Usage:
        """Merged usage: the original prompt, every leg's completion tokens once."""
        prompt = self.prompt_tokens
        if prompt is None:
            prompt = len(self.prompt_ids) if self.prompt_ids is not None else 0
        cached = min(self.cached_tokens or 0, prompt)
        return Usage(prompt, self.completion_tokens, cached or None)

    def blank_answer(self) -> Json:
        """An empty whole answer with the client's identity (for streamed legs)."""
        identity = self.identity
        if identity is None:
            raise ValueError("no chunk was recorded")
        return completion_body(
            kind=self.request.kind,
            response_id=identity.response_id,
            model=identity.model,
            text="",
            finish_reason=None,
            usage=Usage(0, 0),
            created=identity.created,
        )

    def whole_answer(self) -> Json:
        """The non-streamed answer: the template (the first same-API answer, which this
        takes over and changes) with merged contents."""
        if self.template is None:
            raise ValueError("no answer was recorded")
        answer = self.template
        identity = self.identity
        if identity is not None:
            answer["id"], answer["created"] = identity.response_id, identity.created
        choice = answer["choices"][0]
        text = "".join(self.text)
        if self.request.kind == "completion":
            choice["text"] = text
        elif self.tool is not None:
            _call(choice.setdefault("message", {"role": "assistant"}), self.tool, text)
        else:
            choice.setdefault("message", {"role": "assistant"})["content"] = text
        choice["finish_reason"] = self.finish_reason
        if self.logprobs is not None:
            choice["logprobs"] = self.logprobs.as_dict()
        self._ids(answer, choice)
        answer["usage"] = self.usage().as_dict()
        answer["kv_transfer_params"] = None
        return answer

    def _ids(self, answer: Json, choice: Json) -> None:
        if not self.request.want_token_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
            answer.pop("prompt_token_ids", None)
            return
        choice["token_ids"] = list(self.generated)
        if self.request.kind == "completion":
            choice["prompt_token_ids"] = self.prompt_ids
        else:
            answer["prompt_token_ids"] = self.prompt_ids


def tool_call_id() -> str:
    """A new tool call id, in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(message: Json, tool: NamedTool, arguments: str) -> None:
    """Make ``message`` the call of ``tool`` with ``arguments``, as vLLM answers a named
    tool choice (empty content; the call the first leg made keeps its id)."""
    calls = message.get("tool_calls")
    call = calls[0] if isinstance(calls, list) and calls and isinstance(calls[0], dict) else None
    if call is None:
        call = {"id": tool_call_id(), "type": "function", "function": {"name": tool.name}}
    function = call.get("function")
    call["function"] = {**(function if isinstance(function, dict) else {}), "name": tool.name,
                        "arguments": arguments}  # fmt: skip
    message["tool_calls"] = [call]
    message["content"] = message.get("content") or ""  # vLLM's: an empty string
