"""``n`` > 1: each choice is its own generation, one answer for the client.

A request that asks for ``n`` choices runs ``n`` flows of the same plan, each with
``n: 1`` (and, when the request has a ``seed``, seed + the choice's index, so that
sampled choices differ as vLLM's do). Choice 0 runs first, up to its first decisive
chunk: by then its decoder holds the prompt (admitted, or handed the KV over), so the
other choices, started only then on that decoder alone (:meth:`Flow.follow`, in
either mode: ask-all asks no one else), find it cached instead of each prefilling it. Every
choice relays, hands back and recovers on its own (a hand-back continues the choice
that was handed back). The client sees one id, each choice under its ``index``, one
usage figure (the prompt once, every choice's completion tokens), one ``[DONE]``.
A choice that fails fails the request: after the response started, with one SSE
error event. At most ``concurrency`` choices run at once (``limits.
max_concurrent_choices``); the others wait for one to end, so a request holds a
bounded number of upstream connections whatever its ``n``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import anyio
import orjson

from pd_orchestrator.flows.chunks import identity_fields
from pd_orchestrator.flows.flow import Flow, Outcome
from pd_orchestrator.flows.render import StreamRenderer, WholeRenderer, renderer_for
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.flows.sink import ClientSink
from pd_orchestrator.openai.responses import Usage
from pd_orchestrator.openai.sse import DONE, encode_event

__all__ = ["choice_request", "run_choices"]

Json = dict[str, Any]


def choice_request(request: ClientRequest, index: int) -> ClientRequest:
    """The request of choice ``index``: ``n`` 1, ``seed`` shifted by the index."""
    body = dict(request.body)
    body["n"] = 1
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        body["seed"] = seed + index
    view = request.view.model_copy(update={"n": 1})
    return ClientRequest(
        request.kind, request.path, body, view, f"{request.request_id}-c{index}",
        request.arrival, request.kv_source, request.prompt_ids,
    )  # fmt: skip


class _First:
    """Holds the other choices back until choice 0 began its answer."""

    def __init__(self, renderer: StreamRenderer | WholeRenderer) -> None:
        self.renderer = renderer
        self.began = anyio.Event()
        self.timing = renderer.timing

    async def begin(self, headers: Mapping[str, str]) -> None:
        await self.renderer.begin(headers)
        self.began.set()

    def emit(self, *args: Any) -> None:
        self.renderer.emit(*args)

    async def flush(self) -> None:
        await self.renderer.flush()

    async def end(self, headers: Mapping[str, str]) -> None:
        await self.renderer.end(headers)


async def run_choices(
    flows: Sequence[Flow],
    request: ClientRequest,
    sink: ClientSink,
    clock: Callable[[], float],
    concurrency: int,
) -> Outcome:
    """Serve ``flows`` (choice *i* is ``flows[i]``) into ``sink``, at most
    ``concurrency`` at once; choice 0's outcome (its hand-backs summed with the
    others')."""
    renderers = [
        renderer_for(flow.request, flow.transcript, sink, clock, index=i, final=False)
        for i, flow in enumerate(flows)
    ]
    done = await _run_all(flows, renderers, anyio.CapacityLimiter(concurrency))
    handbacks = sum(o.handbacks for o in done)
    usage = _usage(flows)
    if request.stream:
        sink.end(_stream_end(flows, request, usage))
    else:
        answers = [r.answer for r in renderers if isinstance(r, WholeRenderer)]
        headers = {**flows[0].headers(), "x-pd-handbacks": str(handbacks)}
        sink.answer(200, headers, orjson.dumps(_merged(answers, usage)))
    return replace(done[0], handbacks=handbacks)


async def _run_all(
    flows: Sequence[Flow],
    renderers: Sequence[StreamRenderer | WholeRenderer],
    slots: anyio.CapacityLimiter,
) -> list[Outcome]:
    """Run every choice, choice 0 first (the others start once it began, with its id),
    each holding one of ``slots``; the first failure cancels the others and is raised."""
    first = _First(renderers[0])
    outcomes: list[Outcome | None] = [None] * len(flows)
    failures: list[BaseException] = []

    async def choice(index: int) -> None:
        flow = flows[index]
        try:
            if index == 0:
                async with slots:
                    outcomes[0] = await flow.run(first)
                return
            await first.began.wait()  # choice 0 holds its slot by now
            async with slots:
                flow.follow(flows[0])  # on the decoder that holds the prompt now
                flow.transcript.identity = flows[0].transcript.identity  # one id for all
                outcomes[index] = await flow.run(renderers[index])
        except Exception as exc:
            failures.append(exc)
            tg.cancel_scope.cancel()  # one choice failed: the request did

    async with anyio.create_task_group() as tg:
        for index in range(len(flows)):
            tg.start_soon(choice, index)
    if failures:
        raise failures[0]
    return [outcome for outcome in outcomes if outcome is not None]


def _usage(flows: Sequence[Flow]) -> Usage:
    first = flows[0].transcript.usage()
    completion = sum(flow.transcript.usage().completion_tokens for flow in flows)
    return Usage(first.prompt_tokens, completion, first.cached_tokens)


def _stream_end(flows: Sequence[Flow], request: ClientRequest, usage: Usage) -> bytes:
    identity = flows[0].transcript.identity
    if not request.include_usage or identity is None:
        return DONE
    fields = identity_fields(identity, request.kind)
    return encode_event({**fields, "choices": [], "usage": usage.as_dict()}) + DONE


def _merged(answers: Sequence[Json | None], usage: Usage) -> Json:
    whole = [answer for answer in answers if answer is not None]
    merged = whole[0]
    choices = []
    for index, answer in enumerate(whole):
        choice = answer["choices"][0]
        choice["index"] = index
        choices.append(choice)
    merged["choices"] = choices
    merged["usage"] = usage.as_dict()
    return merged
