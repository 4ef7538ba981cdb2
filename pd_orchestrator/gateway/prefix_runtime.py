"""The gateway's handle on prefix-aware routing: state, I/O and request fields.

A :class:`PrefixRuntime` is built from the ``prefix:`` block and the fleet's
endpoints. It owns the precise index (when configured) and its KV-event
subscriber, and offers what the request path needs::

    runtime = PrefixRuntime(config.prefix, endpoints)
    profiles = build_profiles(config.routing, runtime.registry())
    async with anyio.create_task_group() as tg:      # the gateway's lifespan
        await tg.start(runtime.run)                  # subscribes to KV events
        ...
    # per request, before routing:
    fields = runtime.view_fields(parsed_request)
    fields = await runtime.tokenized(fields, body, chat=is_chat, legs=legs,
                                     endpoint=any_healthy_endpoint_of_the_model)
    request = fields.apply(RoutingRequest(role=Role.DECODE, now=now, ...))
    result = profiles.decode.run(request, candidates)
    # once the request is sent (decode-first: the chosen decoder; ask-all: the
    # decoder that admitted it):
    runtime.observe(profiles.decode, request, served_by)
    # the planner's CachedPrefix, for a threshold policy that reads it:
    runtime.cached_tokens(request, decoder)      # None without the precise index
    runtime.blocks(request)                      # the keys a leg holds pending

Built with the fleet's :class:`~pd_orchestrator.prefix.pending.PendingBlocks` (the
block keys of the prompts in flight on each endpoint, before their first answer),
:meth:`PrefixRuntime.cached_tokens` counts those too: in a burst of prompts that
share a prefix, the ones queued behind the first find it cached when the server
reaches them, though no KV event has said so yet.

:meth:`PrefixRuntime.view_fields` is pure: the prompt text (a completion's
string prompt, or the chat messages rendered by the simulator's prefix-stable
template), token ids when the prompt is given as ids, the LoRA adapter (the
requested model, when it is a configured adapter) and the ``cache_salt``.
:meth:`PrefixRuntime.tokenized` adds token ids through an endpoint's
``/tokenize`` (vLLM and the simulator have it) when ``prefix.precise.tokenize``
is on and the request has none; failures and timeouts leave the fields as they
were (the precise scorer then scores 0 and the other scorers decide).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

import anyio
from anyio.abc import TaskStatus

from pd_orchestrator.config.prefix import EventsConfig, PreciseConfig, PrefixConfig
from pd_orchestrator.flows.legs import Legs
from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.records import record
from pd_orchestrator.openai.protocol import (
    ChatCompletionRequest,
    OpenAIRequest,
    RequestError,
    parse_for,
    render_chat,
)
from pd_orchestrator.openai.tokenize import token_ids, tokenize_body
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.prefix.hashing import VllmBlockHasher
from pd_orchestrator.prefix.index import IndexStats, PreciseIndex
from pd_orchestrator.prefix.pending import PendingBlocks
from pd_orchestrator.routing.engine import Profile
from pd_orchestrator.routing.registry import Registry
from pd_orchestrator.routing.types import PrefixFields, RoutingRequest
from pd_orchestrator.upstream.client import Phase
from pd_orchestrator.upstream.errors import UpstreamError

if TYPE_CHECKING:  # pyzmq is an optional dependency ("events"), imported when used
    from pd_orchestrator.fleet.kv_events import EventSource, KvEventSubscriber

__all__ = ["PrefixReport", "PrefixRuntime", "event_sources"]

logger = logging.getLogger("pd_orchestrator.prefix")


@runtime_checkable
class _Sized(Protocol):
    def memory_bytes(self) -> int: ...


@record
class PrefixReport:
    """Memory per stateful plugin (``profile/name`` -> bytes), the precise index's
    counters and each KV-event stream's state (endpoint -> state)."""

    plugin_memory: Mapping[str, int]
    index: IndexStats | None
    streams: Mapping[str, str]


def _endpoint_host(endpoint: Endpoint) -> str:
    return urlsplit(endpoint.url).hostname or ""


def event_sources(events: EventsConfig, endpoints: Iterable[Endpoint]) -> list[EventSource]:
    """The KV-event source of each endpoint: its own entry, else the templates."""
    from pd_orchestrator.fleet.kv_events import EventSource

    sources = []
    for endpoint in endpoints:
        explicit = events.endpoints.get(endpoint.name)
        publisher = explicit.publisher if explicit is not None else events.publisher
        replay = explicit.replay if explicit is not None else events.replay
        if publisher is None:
            continue
        values = {"host": _endpoint_host(endpoint), "name": endpoint.name}
        sources.append(
            EventSource(
                endpoint.name,
                publisher.format(**values),
                None if replay is None else replay.format(**values),
            )
        )
    return sources


def _token_ids(prompt: Any) -> tuple[int, ...] | None:
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return tuple(prompt)
    return None


class PrefixRuntime:
    """Prefix-routing state and I/O; see the module docstring."""

    def __init__(
        self,
        config: PrefixConfig,
        endpoints: Sequence[Endpoint],
        pending: PendingBlocks[int] | None = None,
    ) -> None:
        self.config = config
        self.index = self._index(config.precise, config.lora_adapters)
        self.subscriber = self._subscriber(config.precise, endpoints)
        self.pending = pending

    @staticmethod
    def _index(precise: PreciseConfig | None, adapters: Mapping[str, str]) -> PreciseIndex | None:
        if precise is None:
            return None
        hasher = VllmBlockHasher(precise.block_size, precise.hash_algo, precise.hash_seed)
        return PreciseIndex(
            hasher,
            capacity_per_endpoint=precise.capacity_per_endpoint,
            media=precise.media,
            lora_paths=adapters,
            max_request_blocks=precise.max_request_blocks,
        )

    def _subscriber(
        self, precise: PreciseConfig | None, endpoints: Sequence[Endpoint]
    ) -> KvEventSubscriber | None:
        if precise is None or self.index is None:
            return None
        sources = event_sources(precise.events, endpoints)
        if not sources:
            return None
        from pd_orchestrator.fleet.kv_events import KvEventSubscriber

        events = precise.events
        return KvEventSubscriber(
            self.index,
            sources,
            topic=events.topic,
            heartbeat=events.heartbeat,
            replay_timeout=events.replay_timeout,
        )

    def cached_tokens(self, request: RoutingRequest, decoder: Endpoint) -> int | None:
        """Leading prompt tokens ``decoder`` holds by the precise index, or by the
        prompts in flight there (:attr:`pending`), the more (whole blocks, at most the
        prompt; the planner's :class:`~pd_orchestrator.planner.plan.CachedPrefix`);
        None without the index, the prompt's token ids or its adapter's path."""
        if self.index is None or not request.token_ids:
            return None
        return self.index.cached_tokens(
            request.token_ids, decoder.name, request.lora, request.cache_salt, self.pending
        )

    def blocks(self, request: RoutingRequest) -> Sequence[int]:
        """The block keys of the prompt (empty without the index, the prompt's token
        ids or its adapter's path; shared, not to be changed)."""
        index = self.index
        if index is None or self.pending is None or not request.token_ids:
            return ()
        keys = index.keys(request.token_ids, request.lora, request.cache_salt)
        return () if keys is None else keys

    def registry(self) -> Registry:
        """The built-in plugin registry, ``precise-prefix`` bound to this index."""
        return builtin_registry(self.index)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Follow the KV events until cancelled (returns at once when there are none)."""
        if self.subscriber is None:
            task_status.started()
            return
        await self.subscriber.run(task_status=task_status)

    # -- per request -----------------------------------------------------------------
    def view_fields(self, view: OpenAIRequest) -> PrefixFields:
        """The prefix fields of a parsed request (the gateway parses each body once)."""
        model = view.model
        salt = (view.model_extra or {}).get("cache_salt")
        if isinstance(view, ChatCompletionRequest):
            text: str | None = render_chat(view.messages, view.add_generation_prompt)
            token_ids = None
        elif isinstance(view.prompt, str):
            text, token_ids = view.prompt, None
        else:
            text, token_ids = None, _token_ids(view.prompt)
        return PrefixFields(
            prompt=text,
            token_ids=token_ids,
            lora=model if model in self.config.lora_adapters else None,
            cache_salt=salt if isinstance(salt, str) and salt else None,
        )

    def request_fields(self, body: Mapping[str, Any], *, chat: bool) -> PrefixFields:
        """The prefix fields of a completions (``chat=False``) or chat request body;
        none for a body that does not parse (see :meth:`view_fields`)."""
        try:
            view = parse_for("chat" if chat else "completion", dict(body))
        except RequestError:
            return PrefixFields()
        return self.view_fields(view)

    def needs_tokens(self, fields: PrefixFields) -> bool:
        """Whether :meth:`tokenized` would ask a decoder for ``fields``' token ids."""
        precise = self.config.precise
        return precise is not None and precise.tokenize and fields.token_ids is None

    async def tokenized(
        self,
        fields: PrefixFields,
        body: Mapping[str, Any],
        *,
        chat: bool,
        legs: Legs,
        endpoint: Endpoint,
    ) -> PrefixFields:
        """``fields`` with token ids from ``endpoint``'s ``/tokenize`` when configured
        (``prefix.precise.tokenize``) and missing; unchanged on any failure. The call is
        one of the request's legs (in-flight count, health, metrics, span)."""
        precise = self.config.precise
        if precise is None or not self.needs_tokens(fields):
            return fields
        request = tokenize_body(body, chat=chat)
        if request is None:
            return fields
        with anyio.move_on_after(precise.tokenize_timeout):
            try:
                answer = await legs.post(endpoint, "/tokenize", request, Phase.TOKENIZE)
            except UpstreamError as exc:
                logger.debug("tokenize on %s failed: %s", endpoint.name, exc)
                return fields
            tokens = token_ids(answer)
            return fields if tokens is None else replace(fields, token_ids=tuple(tokens))
        logger.debug("tokenize on %s timed out", endpoint.name)
        return fields

    @staticmethod
    def observe(profile: Profile, request: RoutingRequest, served_by: Endpoint) -> None:
        """Report that ``request`` (routed by ``profile``) was served by ``served_by``."""
        profile.observe(request, served_by)

    # -- reporting -------------------------------------------------------------------
    def report(self, profiles: Iterable[Profile]) -> PrefixReport:
        """Memory of every stateful plugin of ``profiles``, index and stream state."""
        memory: dict[str, int] = {}
        for profile in profiles:
            for scorer in profile.scorers:
                if isinstance(scorer.plugin, _Sized):
                    memory[f"{profile.name}/{scorer.name}"] = scorer.plugin.memory_bytes()
        streams = (
            {name: s.state.value for name, s in self.subscriber.stats().items()}
            if self.subscriber is not None
            else {}
        )
        index = self.index.stats() if self.index is not None else None
        return PrefixReport(memory, index, streams)
