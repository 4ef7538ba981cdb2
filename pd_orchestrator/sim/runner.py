"""Drives an :class:`~pd_orchestrator.sim.engine.Engine` in real time.

One task runs the step loop: step the engine, sleep the step's duration times the
time scale (``0`` removes every delay), deliver the outputs to each request's
memory stream. Steps are paced against an absolute schedule so the loop's own
overhead does not add up; when the loop falls behind by more than ``max_lag``
seconds it resynchronises instead of racing to catch up. With no work the loop
sleeps until a request arrives or a KV lease expires. After every step the cache
events the engine recorded go to ``on_events`` (a KV-event publisher). A consumer
may :meth:`~EngineRunner.claim` blocks a producer will hold: the claim waits until
the producer's request finishes (legs that run together).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pd_orchestrator.sim.blocks import CacheEvent
from pd_orchestrator.sim.engine import (
    Engine,
    EngineRequest,
    HeldTransfer,
    RequestOutput,
    StepResult,
)

__all__ = ["EngineRunner"]


class EngineRunner:
    """Real-time driver of one engine; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        time_scale: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        max_lag: float = 0.05,
        on_events: Callable[[list[CacheEvent]], None] | None = None,
    ) -> None:
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.engine = engine
        self.time_scale = time_scale
        self.clock = clock
        self.max_lag = max_lag
        self.on_events = on_events
        self._streams: dict[str, MemoryObjectSendStream[RequestOutput]] = {}
        self._wake = anyio.Event()
        self._held_events: dict[str, anyio.Event] = {}

    def submit(self, request: EngineRequest) -> MemoryObjectReceiveStream[RequestOutput]:
        """Queue ``request``; its outputs arrive on the returned stream, closed when done.

        Raises ``ValueError`` (from the engine) if the request cannot be accepted.
        """
        self.engine.add_request(request)
        send, receive = anyio.create_memory_object_stream[RequestOutput](math.inf)
        self._streams[request.request_id] = send
        self._wake.set()
        return receive

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone); a no-op for finished or unknown ids."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.close()
        if self.engine.abort(request_id):
            self._wake.set()

    def release(self, request_id: str) -> HeldTransfer | None:
        """Hand over the KV blocks held for ``request_id`` (a consumer pulled them)."""
        held = self.engine.release(request_id)
        if held is not None:
            self._wake.set()
        return held

    async def claim(self, key: str, patience: float) -> HeldTransfer | None:
        """Release the blocks held under ``key``, waiting up to ``patience`` seconds
        for a producer still running to hold them; None if none came."""
        with anyio.move_on_after(patience):
            while True:
                held = self.release(key)
                if held is not None:
                    return held
                event = self._held_events.setdefault(key, anyio.Event())
                await event.wait()
        waiting = self._held_events.get(key)
        if waiting is not None and not waiting.is_set():
            del self._held_events[key]  # nobody holds it: do not keep the waiter's event
        return None

    def flush_events(self) -> None:
        """Hand the cache events the engine recorded since the last flush to ``on_events``."""
        pool = self.engine.pool
        if pool.events and self.on_events is not None:
            events, pool.events = pool.events, []
            self.on_events(events)

    def scaled(self, seconds: float) -> float:
        """Real seconds for ``seconds`` of simulated time."""
        return seconds * self.time_scale

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The step loop; runs until cancelled."""
        task_status.started()
        target: float | None = None
        while True:
            if not self.engine.has_work():
                self.engine.expire_leases(self.clock())
                await self._idle()
                target = None
                continue
            now = self.clock()
            result = self.engine.step(now)
            self.flush_events()
            target = await self._pace(result, now, target)
            self._deliver(result)
            if not result.progressed:
                await self._idle()
                target = None

    async def _pace(self, result: StepResult, now: float, target: float | None) -> float | None:
        """Sleep until the step that began at ``now`` ends on the schedule: at the end of
        the previous step (``target``) plus this one's duration, so the time the loop
        spent since then is taken out of this step, not added to it; from ``now`` when
        there is no previous step or the loop is more than ``max_lag`` behind it. The
        new schedule (None: unchanged, a step of no duration)."""
        delay = self.scaled(result.duration)
        if delay <= 0:
            await anyio.lowlevel.checkpoint()
            return target
        start = now if target is None or now - target > self.max_lag else target
        target = start + delay
        await anyio.sleep(max(0.0, target - self.clock()))
        return target

    async def _idle(self) -> None:
        self._wake = anyio.Event()
        deadline = self.engine.next_deadline()
        timeout = math.inf if deadline is None else max(0.0, deadline - self.clock())
        with anyio.move_on_after(timeout):
            await self._wake.wait()

    def _deliver(self, result: StepResult) -> None:
        for output in result.outputs:
            if output.transfer is not None:
                for key in output.transfer.keys:
                    event = self._held_events.pop(key, None)
                    if event is not None:
                        event.set()
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            try:
                stream.send_nowait(output)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self.abort(output.request_id)
                continue
            if output.finished:
                del self._streams[output.request_id]
                stream.close()
