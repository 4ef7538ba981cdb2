"""KV-event streams: the simulator's publisher, the subscriber feeding the precise
index (stored, removed, all cleared), replay on start and on gaps, lost streams."""

from __future__ import annotations

import socket
from collections.abc import Callable

import anyio
import httpx
import pytest
import zmq
import zmq.asyncio

from pd_orchestrator.children import Child, stop_child
from pd_orchestrator.fleet.kv_events import EventSource, KvEventSubscriber, StreamState
from pd_orchestrator.prefix.codec import (
    END_SEQ,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)
from pd_orchestrator.prefix.hashing import VllmBlockHasher
from pd_orchestrator.prefix.index import PreciseIndex
from tests.conftest import SimFactory

pytestmark = pytest.mark.anyio

PROMPT = "Summarise the quarterly invoices of the northern region, line by line. " * 6


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def events_sim(sim_factory: SimFactory, *extra: str) -> tuple[Child, EventSource]:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    child = sim_factory(
        "--profile",
        "instant",
        "--num-kv-blocks",
        "64",
        "--kv-events-endpoint",
        pub,
        "--kv-events-replay-endpoint",
        replay,
        *extra,
    )
    return child, EventSource("d0", pub, replay)


async def complete(client: httpx.AsyncClient, child: Child, prompt: str) -> None:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2}
    response = await client.post(f"{child.url}/v1/completions", json=body)
    assert response.status_code == 200


async def prompt_keys(client: httpx.AsyncClient, child: Child, index: PreciseIndex) -> list[int]:
    response = await client.post(f"{child.url}/tokenize", json={"prompt": PROMPT})
    keys = index.keys(response.json()["tokens"])
    assert keys
    return keys


async def until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    with anyio.fail_after(seconds):
        while True:
            if condition():
                return
            await anyio.sleep(0.02)


def new_index() -> PreciseIndex:
    return PreciseIndex(VllmBlockHasher(16))


async def test_the_simulator_publishes_vllm_batches(sim_factory: SimFactory) -> None:
    child, source = events_sim(sim_factory, "--kv-events-topic", "kv")
    context = zmq.asyncio.Context()
    try:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(source.publisher)
        received: list[list[bytes]] = []
        async with httpx.AsyncClient() as client:
            with anyio.fail_after(15):
                for n in range(100):  # until the subscription has reached the publisher
                    await complete(client, child, f"{n} " + PROMPT)
                    if await sub.poll(200):
                        received.append(await sub.recv_multipart())
                    if len(received) == 2:
                        break
        (topic, first, payload), (_, second, _) = received
        assert topic == b"kv" and decode_seq(second) == decode_seq(first) + 1
        (stored,) = decode_batch(payload).events
        assert isinstance(stored, BlockStored) and stored.medium == "GPU"
        assert all(isinstance(h, int) for h in stored.block_hashes)
        assert stored.block_size == 16 and stored.parent_block_hash is None
        assert source.replay is not None
        dealer = context.socket(zmq.DEALER)
        dealer.connect(source.replay)
        await dealer.send_multipart([b"", encode_seq(0)])
        with anyio.fail_after(5):
            replayed = [await dealer.recv_multipart()]
            while replayed[-1][2] != END_SEQ:
                replayed.append(await dealer.recv_multipart())
        assert [decode_seq(frames[2]) for frames in replayed[:2]] == [0, 1]
        assert len(replayed) >= decode_seq(second) + 2  # every batch, then the end marker
    finally:
        context.destroy(linger=0)


async def test_the_index_follows_stored_removed_and_cleared(sim_factory: SimFactory) -> None:
    child, source = events_sim(sim_factory)
    index = new_index()
    subscriber = KvEventSubscriber(index, [source])
    async with httpx.AsyncClient() as client, anyio.create_task_group() as tg:
        await tg.start(subscriber.run)
        await until(lambda: subscriber.stats()["d0"].state is StreamState.LIVE)
        keys = await prompt_keys(client, child, index)
        await complete(client, child, PROMPT)
        await until(lambda: index.match(keys, ["d0"])["d0"] == len(keys))
        for n in range(8):  # 64 blocks: other prompts evict this one's blocks
            await complete(client, child, f"{n} other text to fill the cache. " * 12)
        await until(lambda: index.match(keys, ["d0"])["d0"] < len(keys))
        assert 0 < index.stats().keys <= 64
        response = await client.post(f"{child.url}/reset_prefix_cache")
        assert response.status_code == 200
        await until(lambda: index.stats().keys == 0)
        tg.cancel_scope.cancel()


async def test_a_late_subscriber_rebuilds_from_the_replay_buffer(
    sim_factory: SimFactory,
) -> None:
    child, source = events_sim(sim_factory)
    index = new_index()
    async with httpx.AsyncClient() as client:
        await complete(client, child, PROMPT)
        keys = await prompt_keys(client, child, index)
    subscriber = KvEventSubscriber(index, [source])
    async with anyio.create_task_group() as tg:
        await tg.start(subscriber.run)
        await until(lambda: index.match(keys, ["d0"])["d0"] == len(keys))
        assert subscriber.stats()["d0"].replayed >= 1
        tg.cancel_scope.cancel()


async def test_a_lost_stream_drops_the_endpoint(sim_factory: SimFactory) -> None:
    child, source = events_sim(sim_factory)
    index = new_index()
    subscriber = KvEventSubscriber(index, [source], heartbeat=0.2)
    async with httpx.AsyncClient() as client, anyio.create_task_group() as tg:
        await tg.start(subscriber.run)
        await complete(client, child, PROMPT)
        await until(lambda: index.stats().keys > 0)
        stop_child(child)
        await until(lambda: subscriber.stats()["d0"].state is StreamState.LOST)
        assert index.stats().keys == 0
        tg.cancel_scope.cancel()


class FakePublisher:
    """A PUB + ROUTER pair whose live stream can skip batches the buffer still has."""

    def __init__(self, context: zmq.asyncio.Context) -> None:
        self.pub = context.socket(zmq.PUB)
        self.router = context.socket(zmq.ROUTER)
        self.source = EventSource(
            "d0",
            f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}",
            f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}",
        )
        self.buffer: list[tuple[int, bytes]] = []

    async def publish(self, seq: int, batch: EventBatch, *, live: bool = True) -> None:
        payload = encode_batch(batch)
        self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart([b"", encode_seq(seq), payload])

    async def serve_replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            for seq, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([client, b"", b"", encode_seq(seq), payload])
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])


def stored(key: int) -> EventBatch:
    return EventBatch(1.0, (BlockStored((key,), None, tuple(range(16)), 16),))


async def test_gaps_are_filled_from_the_replay_buffer_or_rebuilt() -> None:
    context = zmq.asyncio.Context()
    try:
        fake = FakePublisher(context)
        index = new_index()
        subscriber = KvEventSubscriber(index, [fake.source])
        async with anyio.create_task_group() as tg:
            tg.start_soon(fake.serve_replays)
            await tg.start(subscriber.run)
            await until(lambda: subscriber.stats()["d0"].state is StreamState.LIVE)
            await anyio.sleep(0.3)  # the subscription reaches the publisher
            await fake.publish(0, stored(100))
            await fake.publish(1, stored(101), live=False)  # missed live, buffered
            await fake.publish(2, stored(102))
            await until(lambda: subscriber.stats()["d0"].next_seq == 3)
            assert index.table.holders(101) == {"d0"}
            assert subscriber.stats()["d0"].gaps == 1
            fake.buffer.clear()  # now a gap nobody can fill
            await fake.publish(7, EventBatch(2.0, (BlockRemoved((100,)),)))
            await until(lambda: subscriber.stats()["d0"].next_seq == 8)
            stats = subscriber.stats()["d0"]
            assert stats.gaps == 2 and stats.drops == 1
            assert index.stats().keys == 0  # dropped: it cannot vouch for 102 any more
            tg.cancel_scope.cancel()
    finally:
        context.destroy(linger=0)


def test_one_source_per_endpoint() -> None:
    sources = [EventSource("d0", "tcp://127.0.0.1:1"), EventSource("d0", "tcp://127.0.0.1:2")]
    with pytest.raises(ValueError, match="one KV-event source"):
        KvEventSubscriber(new_index(), sources)
