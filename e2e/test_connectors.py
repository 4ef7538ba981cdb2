"""Every KV connector's whole flow through the gateway, on the simulator target.

For each connector: a simulated prefiller and decoder speaking it, the gateway in
front with the pools naming it (the simulators' side channels all listen on their
HTTP ports). A cold prompt goes P/D and its tokens equal a single instance's; the
same prompt then is admitted by the decoder (``decode``); requests the decoder
preempts are handed back through the same connector and still end token for token
equal to the reference. On the ``vllm`` and ``live`` targets these tests skip: the
real pairs there run the connector they were started with (``test_gateway_pd.py``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import yaml
from targets import HEALTH, wait_ready

from pd_orchestrator.children import Child, python_command, start_child, stop_child

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(
        os.environ.get("PDO_E2E_TARGET", "sim") != "sim", reason="simulator target only"
    ),
]
MODEL = "sim-model"
OUTPUT = 150
PROMPTS = [
    f"conversation {i}: " + "the history so far is long and detailed. " * 5 for i in range(4)
]

# (connector spec, whether the gateway's config names the prefiller's engine id: without
# it nixl-push learns it from the first prefill answer and mooncake looks it up)
CONNECTORS = [
    ("nixl", True),
    ("nixl-push", False),
    ("mooncake", False),
    ("moriio", True),
    ("offloading", True),
    ("lmcache", True),
    ("example", True),
    ("multi:nixl,example", True),
]
# With a shared store the decoder itself reloads a preempted request's blocks from the
# store when it resumes it: nothing is handed back (decode-first at its most natural).
SHARED_STORE = {"lmcache", "example", "multi:nixl,example"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _sim(stack: ExitStack, name: str, *args: str) -> Child:
    argv = python_command("sim", "--host", "127.0.0.1", "--port", "0", *args)
    child = start_child(name, argv, timeout=60)
    stack.callback(stop_child, child)
    return child


def _kv(sim: Child, engine: str, named: bool) -> dict[str, Any]:
    port = sim.port
    kv: dict[str, Any] = {"host": "127.0.0.1", "nixl_port": port, "bootstrap_port": port}
    kv |= {"handshake_port": port, "notify_port": port, "p2p_port": port}
    return kv | ({"engine_id": engine} if named else {})


class Stack:
    def __init__(
        self, spec: str, gateway: Child, decoder: Child, prefiller: Child, reference: Child
    ):
        self.spec = spec
        self.gateway, self.decoder, self.prefiller = gateway, decoder, prefiller
        self.reference = reference


@pytest.fixture(params=CONNECTORS, ids=[spec for spec, _ in CONNECTORS])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stack]:
    spec, named = request.param
    shared = ("--kv-connector", spec, "--kv-shared-dir", str(tmp_path), "--model", MODEL)
    shared += ("--lmcache-chunk-size", "16")
    with ExitStack() as stack:
        # 64 blocks of 16 tokens: four 220-token prompts and 150 outputs each do not fit
        decoder = _sim(
            stack, "decoder", "--profile", "h200-llama3-8b", "--time-scale", "0.3",
            "--num-kv-blocks", "64", "--max-num-seqs", "8", "--engine-id", "decode", *shared,
        )  # fmt: skip
        prefiller = _sim(
            stack, "prefill", "--profile", "instant", "--engine-id", "prefill", *shared
        )
        reference = _sim(stack, "reference", "--profile", "instant", "--model", MODEL)
        config = {
            "connector": spec,
            "pools": [
                {"name": "decode", "role": "decode", "model": MODEL, "endpoints": [
                    {"name": "decode-0", "url": decoder.url, "kv": _kv(decoder, "decode", True)}]},
                {"name": "prefill", "role": "prefill", "model": MODEL, "endpoints": [
                    {"name": "prefill-0", "url": prefiller.url,
                     "kv": _kv(prefiller, "prefill", named)}]},
            ],
            "threshold": {"policy": {"type": "static", "value": 0.6}},
            "health": HEALTH,
        }  # fmt: skip
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        gateway = start_child(
            "gateway", python_command("serve", "--config", str(path), "--port", "0"), timeout=60
        )
        stack.callback(stop_child, gateway)
        wait_ready(gateway.url)
        yield Stack(spec, gateway, decoder, prefiller, reference)


async def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.post(url + "/v1/completions", json=body)


def _ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"])


async def _streamed_ids(url: str, body: dict[str, Any]) -> tuple[httpx.Headers, list[int]]:
    ids: list[int] = []
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream("POST", url + "/v1/completions", json=body | {"stream": True}) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                assert "error" not in chunk, chunk
                for choice in chunk.get("choices") or []:
                    ids += choice.get("token_ids") or []
        return response.headers, ids


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_cold_pd_warm_decode_and_hand_back_through_the_connector(stack: Stack) -> None:
    gateway = stack.gateway.url
    prompt = f"{uuid.uuid4().hex} " + "a document to prefill remotely. " * 12
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    expected = _ids(await _post(stack.reference.url, body))

    cold = await _post(gateway, body)
    assert cold.headers["x-pd-decision"] == "pd" and _ids(cold) == expected
    headers, streamed = await _streamed_ids(gateway, body)
    assert headers["x-pd-decision"] == "decode" and streamed == expected

    async with httpx.AsyncClient(timeout=10) as client:
        decoder_metrics = (await client.get(stack.decoder.url + "/metrics")).text
    assert _metric(decoder_metrics, "vllm:external_prefix_cache_hits_total") > 0

    # hand-backs: the decoder holds the prompts, then preempts under four at once
    bodies = [
        {"model": MODEL, "prompt": p, "max_tokens": OUTPUT, "ignore_eos": True,
         "return_token_ids": True}
        for p in PROMPTS
    ]  # fmt: skip
    for warm in bodies:
        assert (await _post(gateway, warm | {"max_tokens": 1})).status_code == 200
    answers: list[list[int]] = [[] for _ in bodies]

    async def one(i: int) -> None:
        answers[i] = (await _streamed_ids(gateway, bodies[i]))[1]

    with anyio.fail_after(240):
        async with anyio.create_task_group() as tg:
            for i in range(len(bodies)):
                tg.start_soon(one, i)
    for answer, sent in zip(answers, bodies, strict=True):
        assert answer == _ids(await _post(stack.reference.url, sent))
    async with httpx.AsyncClient(timeout=10) as client:
        gateway_metrics = (await client.get(gateway + "/metrics")).text
        decoder_metrics = (await client.get(stack.decoder.url + "/metrics")).text
    assert _metric(decoder_metrics, "vllm:num_preemptions_total") >= 1
    if stack.spec not in SHARED_STORE:
        assert _metric(gateway_metrics, "pd_orchestrator_handbacks_total") >= 1
