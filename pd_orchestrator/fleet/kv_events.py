"""KV-event subscriptions: one ZMQ stream per endpoint feeding the precise index.

For every :class:`EventSource` a task subscribes (SUB, connecting) to the
endpoint's publisher and applies each decoded batch to the
:class:`~pd_orchestrator.prefix.index.PreciseIndex` under the endpoint's name, in
sequence order:

* on (re)connection, when the source has a replay endpoint, it asks for every
  buffered batch from sequence 0 and applies them, so a restarted gateway rebuilds
  the index from what the publisher still buffers;
* a batch whose sequence number is below the next expected one is a duplicate and
  is skipped; one above it is a gap: the missing batches are asked from the replay
  endpoint; when that is impossible (no replay endpoint, or the replay lacks
  them) the endpoint is dropped from the index and rebuilt from the stream, so
  the index never claims blocks it cannot vouch for;
* when the connection drops (the publisher died or missed the ZMTP heartbeats)
  the endpoint is dropped from the index: its cache is unknown until it is back
  (messages still queued from before the drop are ignored).

Sockets come from one ``zmq.asyncio`` context per :meth:`KvEventSubscriber.run`
(asyncio backend of anyio). Each stream runs in one task that handles its
socket's monitor events and messages one at a time, so index updates of an
endpoint are strictly ordered.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import replace

import anyio
import zmq
import zmq.asyncio
from anyio.abc import TaskStatus
from zmq.utils.monitor import parse_monitor_message

from pd_orchestrator.model.records import record
from pd_orchestrator.prefix.codec import END_SEQ, EventDecodeError, decode_batch, decode_seq
from pd_orchestrator.prefix.index import PreciseIndex

__all__ = ["EventSource", "KvEventSubscriber", "StreamState", "StreamStats"]

logger = logging.getLogger("pd_orchestrator.prefix")


@record
class EventSource:
    """Where an endpoint publishes: its PUB endpoint and, optionally, its replay one."""

    endpoint: str
    publisher: str
    replay: str | None = None


class StreamState(enum.StrEnum):
    """``connecting``: no connection yet; ``live``: connected; ``lost``: the
    connection dropped (the endpoint is out of the index until it is back)."""

    CONNECTING = "connecting"
    LIVE = "live"
    LOST = "lost"


@record
class StreamStats:
    """Counters of one stream; ``next_seq`` is the next sequence number expected."""

    state: StreamState = StreamState.CONNECTING
    next_seq: int | None = None
    batches: int = 0
    replayed: int = 0
    replays: int = 0
    gaps: int = 0
    drops: int = 0
    decode_errors: int = 0


class _Stream:
    """One endpoint's subscription; see the module docstring."""

    def __init__(
        self,
        source: EventSource,
        index: PreciseIndex,
        topic: bytes,
        replay_timeout: float,
    ) -> None:
        self.source = source
        self.index = index
        self.topic = topic
        self.replay_timeout = replay_timeout
        self.stats = StreamStats()

    def _count(self, **changes: object) -> None:
        self.stats = replace(self.stats, **changes)  # type: ignore[arg-type]

    async def follow(self, context: zmq.asyncio.Context, heartbeat: float) -> None:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat * 1000))
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat * 3000))
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.source.publisher)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while True:
            ready = dict(await poller.poll())
            if monitor in ready:
                await self._on_monitor(context, await monitor.recv_multipart())
            if sub in ready:
                await self._on_message(context, await sub.recv_multipart())

    async def _on_monitor(self, context: zmq.asyncio.Context, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_CONNECTED:
            self._count(state=StreamState.LIVE, next_seq=None)
            logger.info("KV events of %s: connected", self.source.endpoint)
            if self.source.replay is not None:
                await self._replay(context, 0, None)
        elif event == zmq.EVENT_DISCONNECTED and self.stats.state is not StreamState.LOST:
            logger.warning("KV events of %s: connection lost", self.source.endpoint)
            self._drop()
            self._count(state=StreamState.LOST)

    async def _on_message(self, context: zmq.asyncio.Context, frames: list[bytes]) -> None:
        if self.stats.state is StreamState.LOST:
            return  # queued before the connection dropped: the endpoint stays out until back
        if len(frames) != 3:
            self._count(decode_errors=self.stats.decode_errors + 1)
            return
        try:
            seq = decode_seq(frames[1])
        except EventDecodeError:
            self._count(decode_errors=self.stats.decode_errors + 1)
            return
        expected = self.stats.next_seq
        if expected is not None and seq < expected:
            return  # already applied (a replay overlapped the live stream)
        if expected is not None and seq > expected:
            await self._fill_gap(context, expected, seq)
        elif expected is None and seq > 0 and self.source.replay is not None:
            await self._replay(context, 0, seq)
        self._apply(seq, frames[2])

    async def _fill_gap(self, context: zmq.asyncio.Context, expected: int, seq: int) -> None:
        self._count(gaps=self.stats.gaps + 1)
        if self.source.replay is not None:
            await self._replay(context, expected, seq)
        if self.stats.next_seq != seq:
            logger.warning(
                "KV events of %s: batches %d..%d lost; rebuilding its index entries",
                self.source.endpoint,
                expected,
                seq - 1,
            )
            self._drop()

    def _drop(self) -> None:
        self.index.drop(self.source.endpoint)
        self._count(drops=self.stats.drops + 1, next_seq=None)

    def _apply(self, seq: int, payload: bytes, *, replayed: bool = False) -> None:
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            logger.warning("KV events of %s: batch %d: %s", self.source.endpoint, seq, exc)
            self._count(decode_errors=self.stats.decode_errors + 1, next_seq=seq + 1)
            return
        self.index.apply(self.source.endpoint, batch)
        stats = self.stats
        self._count(
            next_seq=seq + 1,
            batches=stats.batches + 1,
            replayed=stats.replayed + replayed,
        )

    async def _replay(self, context: zmq.asyncio.Context, start: int, stop: int | None) -> None:
        """Apply the buffered batches ``start..stop-1`` (all from ``start`` with None)."""
        assert self.source.replay is not None
        self._count(replays=self.stats.replays + 1)
        dealer = context.socket(zmq.DEALER)
        try:
            dealer.connect(self.source.replay)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                with anyio.move_on_after(self.replay_timeout) as scope:
                    frames = await dealer.recv_multipart()
                if scope.cancelled_caught:
                    logger.warning("KV events of %s: replay timed out", self.source.endpoint)
                    return
                if len(frames) != 4 or frames[2] == END_SEQ:
                    return
                self._replayed(frames[2], frames[3], start, stop)
        finally:
            dealer.close(linger=0)

    def _replayed(self, seq_frame: bytes, payload: bytes, start: int, stop: int | None) -> None:
        seq = decode_seq(seq_frame)
        expected = self.stats.next_seq
        if seq < start or (stop is not None and seq >= stop):
            return
        if expected is not None and seq != expected:
            return  # a batch before the gap or a hole in the buffer: keep next_seq honest
        self._apply(seq, payload, replayed=True)


class KvEventSubscriber:
    """Subscriptions to every source's KV events; see the module docstring.

    ``topic`` is the subscription prefix (``""``: every topic); ``heartbeat`` the
    ZMTP heartbeat interval in seconds (a peer silent for three intervals counts as
    gone); ``replay_timeout`` how long to wait for each replayed batch.
    """

    def __init__(
        self,
        index: PreciseIndex,
        sources: Sequence[EventSource],
        *,
        topic: str = "",
        heartbeat: float = 1.0,
        replay_timeout: float = 2.0,
    ) -> None:
        names = [s.endpoint for s in sources]
        if len(set(names)) != len(names):
            raise ValueError("each endpoint may have one KV-event source")
        self.index = index
        self.heartbeat = heartbeat
        self._streams = {
            s.endpoint: _Stream(s, index, topic.encode(), replay_timeout) for s in sources
        }

    def stats(self) -> dict[str, StreamStats]:
        """The counters of each endpoint's stream."""
        return {name: stream.stats for name, stream in self._streams.items()}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Follow every stream until cancelled; reports started once all subscribed."""
        context = zmq.asyncio.Context()
        try:
            async with anyio.create_task_group() as tg:
                for stream in self._streams.values():
                    tg.start_soon(stream.follow, context, self.heartbeat)
                task_status.started()
        finally:
            context.destroy(linger=0)
