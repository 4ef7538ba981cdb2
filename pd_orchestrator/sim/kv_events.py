"""KV-event publishing for the simulator, as vLLM's ZMQ publisher does it.

:func:`wire_events` (pure) turns the block pool's recorded cache events into the
events of :mod:`pd_orchestrator.prefix.events`: medium ``"GPU"``, KV-cache group 0,
block hashes as 64-bit ints (vLLM's default) or digest bytes.

:class:`KvEventPublisher` publishes one batch per engine step that produced events.
Like vLLM's ``ZmqEventPublisher`` it binds a PUB socket and sends
``[topic, seq (8 bytes, big-endian), payload]`` with ``seq`` counting from 0, keeps
the last ``buffer_steps`` payloads, and, with a replay endpoint, binds a ROUTER
socket that answers a start sequence number with every buffered batch from there
on followed by an end marker (see the codec's module docstring). Unlike vLLM, which
binds only wildcard endpoints (``tcp://*:5557``) and connects to the others, the
simulator always binds. :meth:`KvEventPublisher.publish` never blocks: batches wait
in a queue of ``max_queue`` batches and the excess is dropped and counted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskStatus

from pd_orchestrator.prefix.codec import END_SEQ, encode_batch, encode_seq
from pd_orchestrator.prefix.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
)
from pd_orchestrator.prefix.hashing import external_hash
from pd_orchestrator.sim import blocks

if TYPE_CHECKING:  # pyzmq (the "events" extra) is imported when the publisher runs
    import zmq.asyncio

__all__ = ["MEDIUM", "KvEventPublisher", "wire_events"]

MEDIUM = "GPU"


def _wire_hash(block_hash: bytes, int_hashes: bool) -> BlockHash:
    return external_hash(block_hash) if int_hashes else block_hash


def _wire_event(event: blocks.CacheEvent, int_hashes: bool) -> KvEvent:
    if isinstance(event, blocks.BlockStored):
        parent = event.parent_block_hash
        return BlockStored(
            block_hashes=tuple(_wire_hash(h, int_hashes) for h in event.block_hashes),
            parent_block_hash=None if parent is None else _wire_hash(parent, int_hashes),
            token_ids=tuple(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=MEDIUM,
            lora_name=event.lora_name,
            extra_keys=None if event.extra_keys is None else tuple(event.extra_keys),
            group_idx=0,
        )
    if isinstance(event, blocks.BlockRemoved):
        hashes = tuple(_wire_hash(h, int_hashes) for h in event.block_hashes)
        return BlockRemoved(block_hashes=hashes, medium=MEDIUM, group_idx=0)
    return AllBlocksCleared()


def wire_events(
    events: Sequence[blocks.CacheEvent], *, int_hashes: bool = True
) -> tuple[KvEvent, ...]:
    """The wire form of the pool's recorded ``events``, in order."""
    return tuple(_wire_event(event, int_hashes) for event in events)


class KvEventPublisher:
    """Publishes cache events on ZMQ; see the module docstring.

    ``publish`` is called from the engine loop; :meth:`run` owns the sockets and
    runs until cancelled.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        max_queue: int = 100_000,
        hwm: int = 100_000,
        int_hashes: bool = True,
        data_parallel_rank: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.int_hashes = int_hashes
        self.data_parallel_rank = data_parallel_rank
        self.clock = clock
        self.hwm = hwm
        self.dropped = 0
        self.next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._send, self._receive = anyio.create_memory_object_stream[EventBatch](max_queue)

    def publish(self, events: Sequence[blocks.CacheEvent]) -> None:
        """Queue one batch of ``events`` (nothing for none); drop it when the queue is full."""
        if not events:
            return
        batch = EventBatch(
            self.clock(), wire_events(events, int_hashes=self.int_hashes), self.data_parallel_rank
        )
        try:
            self._send.send_nowait(batch)
        except anyio.WouldBlock:
            self.dropped += 1

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Bind the sockets, report started, then publish and answer replays."""
        import zmq
        import zmq.asyncio

        context = zmq.asyncio.Context()
        try:
            pub = context.socket(zmq.PUB)
            pub.set_hwm(self.hwm)
            pub.bind(self.endpoint)
            replay = None
            if self.replay_endpoint is not None:
                replay = context.socket(zmq.ROUTER)
                replay.bind(self.replay_endpoint)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._send_loop, pub)
                if replay is not None:
                    tg.start_soon(self._replay_loop, replay)
                task_status.started()
        finally:
            context.destroy(linger=0)

    async def _send_loop(self, pub: zmq.asyncio.Socket) -> None:
        async with self._receive:
            async for batch in self._receive:
                seq = self.next_seq
                self.next_seq += 1
                payload = encode_batch(batch)
                self._buffer.append((seq, payload))
                await pub.send_multipart([self.topic, encode_seq(seq), payload])

    async def _replay_loop(self, replay: zmq.asyncio.Socket) -> None:
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await replay.send_multipart([client, b"", self.topic, encode_seq(seq), payload])
            await replay.send_multipart([client, b"", b"", END_SEQ, b""])
