"""The precise prefix index against a real vLLM decoder's KV events.

The pair's decoder (see ``conftest.py``) publishes with ``--kv-events-config``
(ZMQ PUB on an ipc socket, a replay ROUTER on loopback, topic ``kv-events``),
block size 32 and ``PYTHONHASHSEED=0``; its KV cache holds 24 blocks. The index
hashes prompts itself, the way vLLM does, and must agree with what the decoder
reports: a prompt served before the subscriber started comes back through the
replay socket, and prompts that fill the cache evict it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import anyio
import httpx
import pytest

from pd_orchestrator.fleet.kv_events import EventSource, KvEventSubscriber, StreamState
from pd_orchestrator.prefix.hashing import VllmBlockHasher
from pd_orchestrator.prefix.index import PreciseIndex

pytestmark = [pytest.mark.timeout(300), pytest.mark.anyio]

BLOCK = 32
MODEL = "tiny"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def prompt(seed: str, num_tokens: int) -> list[int]:
    rng = random.Random(f"kv-events-{seed}")
    return [rng.randrange(10, 4000) for _ in range(num_tokens)]


async def complete(client: httpx.AsyncClient, url: str, tokens: list[int]) -> None:
    body = {"model": MODEL, "prompt": tokens, "max_tokens": 2}
    response = await client.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 200, response.text


async def until(condition: Callable[[], bool], seconds: float = 60.0) -> None:
    with anyio.fail_after(seconds):
        while True:
            if condition():
                return
            await anyio.sleep(0.05)


async def test_the_precise_index_follows_a_real_vllm(
    vllm_pair: Any, vllm_kv_events: dict[str, str]
) -> None:
    decoder = vllm_pair.decoder
    index = PreciseIndex(VllmBlockHasher(BLOCK, "sha256", "0"))
    source = EventSource("decoder", vllm_kv_events["publisher"], vllm_kv_events["replay"])
    subscriber = KvEventSubscriber(index, [source], topic=vllm_kv_events["topic"])
    first = prompt("first", 200)  # 6 full blocks
    keys = index.keys(first)
    assert keys is not None and len(keys) == 6

    def held() -> int:
        return index.match(keys, ["decoder"])["decoder"]

    async with httpx.AsyncClient(timeout=60.0) as client:
        await complete(client, decoder.url, first)  # before anyone subscribed
        async with anyio.create_task_group() as tg:
            await tg.start(subscriber.run)
            await until(lambda: held() == 6)  # rebuilt from the replay buffer
            stats = subscriber.stats()["decoder"]
            assert stats.state is StreamState.LIVE and stats.replayed >= 1
            for n in range(3):  # 3 x 12 blocks through a 24-block cache
                await complete(client, decoder.url, prompt(f"filler-{n}", 400))
            await until(lambda: held() < 6)  # evicted, as the decoder reported
            stats = subscriber.stats()["decoder"]
            assert stats.decode_errors == 0 and index.stats().ignored_events == 0
            assert 0 < index.stats().keys <= 24
            tg.cancel_scope.cancel()
