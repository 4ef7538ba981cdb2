"""A request learns of its client's going from its connection's
:class:`~pd_orchestrator.gateway.protocol.Disconnects` (no task waiting on
``receive``), or, on a server that offers none, from ``receive``."""

from __future__ import annotations

import asyncio

import anyio
import pytest
from starlette.types import Message

from pd_orchestrator.flows.sink import ClientSink
from pd_orchestrator.gateway.protocol import DISCONNECTS, Disconnects
from pd_orchestrator.gateway.response import DISCONNECTED, disconnects_of, respond

pytestmark = pytest.mark.anyio


def test_lost_calls_each_callback_once_and_later_ones_at_once() -> None:
    disconnects, called = Disconnects(), []
    first, second = (lambda: called.append("first")), (lambda: called.append("second"))
    disconnects.add(first)
    disconnects.add(second)
    disconnects.discard(second)
    disconnects.discard(second)  # forgetting twice is nothing
    disconnects.lost()
    disconnects.lost()
    assert called == ["first"]
    disconnects.add(second)  # the connection is already gone
    assert called == ["first", "second"]


def test_disconnects_of_reads_the_extension_only() -> None:
    disconnects = Disconnects()
    assert disconnects_of({"extensions": {DISCONNECTS: {"connection": disconnects}}}) is disconnects
    assert disconnects_of({"type": "http"}) is None
    assert disconnects_of({"extensions": None}) is None
    assert disconnects_of({"extensions": {DISCONNECTS: {"connection": object()}}}) is None


async def _never() -> Message:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _send(message: Message) -> None:
    return None


async def test_a_lost_connection_cancels_the_answer_without_receive() -> None:
    disconnects, started = Disconnects(), anyio.Event()

    async def serve(sink: ClientSink) -> str:
        started.set()
        await anyio.sleep(30)
        return "done"

    async def leave() -> None:
        await started.wait()
        disconnects.lost()

    async with anyio.create_task_group() as tg:
        tg.start_soon(leave)
        with anyio.fail_after(5):
            pending = await respond(_never, _send, serve, disconnects=disconnects)
    assert pending.status == DISCONNECTED and pending.result is None
    assert await pending.finish() == DISCONNECTED


async def test_an_answer_that_ended_forgets_its_callback() -> None:
    disconnects = Disconnects()

    async def serve(sink: ClientSink) -> str:
        return "done"

    pending = await respond(_never, _send, serve, disconnects=disconnects)
    disconnects.lost()  # after the answer: nothing to cancel, nothing recorded
    assert pending.result == "done" and pending.status != DISCONNECTED


async def test_without_the_extension_receive_tells_of_the_disconnect() -> None:
    started = anyio.Event()

    async def receive() -> Message:
        await started.wait()
        return {"type": "http.disconnect"}

    async def serve(sink: ClientSink) -> str:
        started.set()
        await anyio.sleep(30)
        return "done"

    with anyio.fail_after(5):
        pending = await respond(receive, _send, serve)
    assert pending.status == DISCONNECTED
