"""The prefix runtime: config, request fields, tokenization, KV-event wiring, reports."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import anyio
import pytest
from pydantic import ValidationError

from pd_orchestrator.bench.fleet import preset_fleet
from pd_orchestrator.bench.live import _gateway_config
from pd_orchestrator.config.loader import parse_config
from pd_orchestrator.config.prefix import PrefixConfig
from pd_orchestrator.config.settings import TimeoutConfig, UpstreamConfig
from pd_orchestrator.fleet.kv_events import EventSource
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.flows.legs import Legs
from pd_orchestrator.gateway.prefix_runtime import PrefixRuntime, event_sources
from pd_orchestrator.gateway.state import build_state
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.routing import RoutingConfig, RoutingRequest, build_profiles
from pd_orchestrator.routing.types import PrefixFields
from pd_orchestrator.telemetry.metrics import GatewayMetrics
from pd_orchestrator.upstream.client import Phase, Upstream
from pd_orchestrator.upstream.mock import MockResponse, MockTransport
from pd_orchestrator.upstream.transport import Request
from tests.conftest import SimFactory

SALTED = {"model": "m", "prompt": "hello", "cache_salt": "tenant-7"}
CHAT = {"model": "sql", "messages": [{"role": "user", "content": "hi"}]}


def endpoint(name: str, url: str = "http://10.0.0.5:8000") -> Endpoint:
    return Endpoint(name, url, Role.DECODE, "h200", "sim-model")


def runtime(**config: Any) -> PrefixRuntime:
    return PrefixRuntime(PrefixConfig.model_validate(config), [endpoint("d0")])


@pytest.mark.parametrize(
    ("body", "chat", "expected"),
    [
        (SALTED, False, PrefixFields(prompt="hello", cache_salt="tenant-7")),
        ({"model": "m", "prompt": [1, 2, 3]}, False, PrefixFields(token_ids=(1, 2, 3))),
        ({"model": "m", "prompt": ["a", "b"]}, False, PrefixFields()),
        ({"model": "m", "prompt": "x", "cache_salt": 5}, False, PrefixFields(prompt="x")),
        (CHAT, True, PrefixFields(prompt="<|user|>\nhi<|end|>\n<|assistant|>\n", lora="sql")),
        ({"model": "m", "messages": "nope"}, True, PrefixFields()),
    ],
    ids=["text-and-salt", "token-prompt", "batch-prompt", "bad-salt", "chat-lora", "bad-chat"],
)
def test_request_fields(body: dict[str, Any], chat: bool, expected: PrefixFields) -> None:
    fields = runtime(lora_adapters={"sql": "/adapters/sql"}).request_fields(body, chat=chat)
    assert fields == expected


def test_fields_apply_to_a_routing_request() -> None:
    request = PrefixFields(prompt="p", token_ids=(1,), lora="a").apply(
        RoutingRequest(Role.DECODE, 0.0, model="m")
    )
    assert (request.prompt, request.token_ids, request.lora, request.model) == ("p", (1,), "a", "m")


def test_event_sources_from_templates_and_overrides() -> None:
    config = PrefixConfig.model_validate(
        {
            "precise": {
                "events": {
                    "publisher": "tcp://{host}:5557",
                    "replay": "tcp://{host}:5558",
                    "endpoints": {"d1": {"publisher": "ipc:///run/{name}.sock"}},
                }
            }
        }
    )
    assert config.precise is not None
    sources = event_sources(config.precise.events, [endpoint("d0"), endpoint("d1")])
    assert sources == [
        EventSource("d0", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558"),
        EventSource("d1", "ipc:///run/d1.sock", None),
    ]
    no_template = PrefixConfig.model_validate({"precise": {"events": {"publisher": None}}})
    assert no_template.precise is not None
    assert event_sources(no_template.precise.events, [endpoint("d0")]) == []


@pytest.mark.parametrize(
    "config",
    [
        {"precise": {"block_size": 0}},
        {"precise": {"hash_algo": "md5"}},
        {"precise": {"events": {"publisher": "http://x:1"}}},
        {"precise": {"events": {"publisher": "tcp://{port}:1"}}},
        {"precise": {"unknown": 1}},
        {"lora": {}},
    ],
    ids=["block-size", "hash-algo", "not-zmq", "bad-placeholder", "unknown-key", "top-level-key"],
)
def test_invalid_config_is_rejected(config: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        PrefixConfig.model_validate(config)


@asynccontextmanager
async def upstream(handler: Any) -> AsyncIterator[Upstream]:
    transport = None if handler is None else MockTransport(handler)
    client = Upstream(UpstreamConfig(), TimeoutConfig(), transport)
    try:
        yield client
    finally:
        await client.aclose()


async def tokenize_answer(request: Request) -> MockResponse:
    return MockResponse(200, json={"tokens": [5, 6, 7], "count": 3})


async def failing(request: Request) -> MockResponse:
    return MockResponse(500, json={"object": "error", "message": "boom"})


def legs_of(client: Upstream, *endpoints: Endpoint) -> Legs:
    """The legs of one request, as the gateway builds them before planning."""
    return Legs(client, FleetState(endpoints), GatewayMetrics(), "rid-tokenize", anyio.current_time)


async def slow(request: Request) -> MockResponse:
    await anyio.sleep(5)
    return MockResponse(200, json={"tokens": [1]})


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("handler", "tokenize", "expected"),
    [
        (tokenize_answer, True, (5, 6, 7)),
        (tokenize_answer, False, None),
        (failing, True, None),
        (slow, True, None),
    ],
    ids=["tokenized", "option-off", "server-error", "timeout"],
)
async def test_tokenized(handler: Any, tokenize: bool, expected: tuple[int, ...] | None) -> None:
    prefix = runtime(precise={"tokenize": tokenize, "tokenize_timeout": 0.2})
    fields = prefix.request_fields(SALTED, chat=False)
    decoder = endpoint("d0")
    async with upstream(handler) as client:
        legs = legs_of(client, decoder)
        with anyio.fail_after(3):
            done = await prefix.tokenized(fields, SALTED, chat=False, legs=legs, endpoint=decoder)
    assert done.token_ids == expected
    assert done.prompt == "hello"
    assert legs.sent == (1 if tokenize else 0)  # one of the request's legs
    assert legs.fleet.snapshot()[0].in_flight == 0


@pytest.mark.anyio
async def test_run_returns_at_once_without_event_sources() -> None:
    prefix = runtime()
    with anyio.fail_after(1):
        async with anyio.create_task_group() as tg:
            await tg.start(prefix.run)
    assert prefix.index is None and prefix.subscriber is None
    request = RoutingRequest(Role.DECODE, 0.0, token_ids=(1, 2, 3))
    assert prefix.cached_tokens(request, endpoint("d0")) is None  # no index: unknown


def test_the_cached_count_adds_the_prompts_in_flight_on_the_endpoint() -> None:
    """A prompt sent to d0 and not yet answered: a later prompt sharing its first two
    blocks counts them as held on d0 (no KV event has said so yet), none on d1; once
    the first is answered, none."""
    fleet = FleetState([endpoint("d0"), endpoint("d1")])
    config = PrefixConfig.model_validate({"precise": {"events": {"publisher": None}}})
    prefix = PrefixRuntime(config, [endpoint("d0"), endpoint("d1")], fleet.pending)
    first = RoutingRequest(Role.DECODE, 0.0, token_ids=tuple(range(40)))
    later = RoutingRequest(Role.DECODE, 0.0, token_ids=(*range(32), *range(100, 120)))
    keys = prefix.blocks(first)
    assert len(keys) == 2  # two whole blocks of 16
    assert prefix.cached_tokens(later, endpoint("d0")) == 0
    fleet.enter("d0", 40, keys)
    assert prefix.cached_tokens(later, endpoint("d0")) == 32
    assert prefix.cached_tokens(later, endpoint("d1")) == 0
    assert (
        prefix.cached_tokens(replace(later, token_ids=(1, *later.token_ids)), endpoint("d0")) == 0
    )
    fleet.answered("d0", 40, keys)
    assert prefix.cached_tokens(later, endpoint("d0")) == 0
    without = PrefixRuntime(config, [endpoint("d0")])  # no pending table: nothing to hold
    assert without.blocks(first) == ()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


DECODE = Phase.DECODE
ROUTING = {
    "decode": {
        "scorers": [
            {"type": "precise-prefix", "weight": 3},
            {"type": "kv-usage", "weight": 2},
            {"type": "approximate-prefix"},
        ]
    }
}


@pytest.mark.anyio
async def test_precise_routing_end_to_end(sim_factory: SimFactory) -> None:
    """Two simulators publishing KV events: after one served a prompt, the runtime's
    index (fed by the subscriber) sends its follow-up there, tokenized by /tokenize."""
    sims, sources = [], {}
    for name in ("d0", "d1"):
        pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        args = ("--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay)
        sims.append(sim_factory("--profile", "instant", *args, name=name))
        sources[name] = {"publisher": pub, "replay": replay}
    endpoints = [endpoint(f"d{i}", child.url) for i, child in enumerate(sims)]
    config = {"precise": {"tokenize": True, "events": {"publisher": None, "endpoints": sources}}}
    prefix = PrefixRuntime(PrefixConfig.model_validate(config), endpoints)
    profiles = build_profiles(RoutingConfig.model_validate(ROUTING), prefix.registry())
    prompt = "The contract of the northern warehouse says, in clause four, that " * 8
    follow_up = {"model": "sim-model", "prompt": prompt + "and who insures it?"}
    candidates = [Candidate(e) for e in endpoints]
    async with upstream(None) as client, anyio.create_task_group() as tg:
        await tg.start(prefix.run)
        fields = await prefix.tokenized(
            prefix.request_fields(follow_up, chat=False),
            follow_up,
            chat=False,
            legs=legs_of(client, *endpoints),
            endpoint=endpoints[0],
        )
        assert fields.token_ids is not None
        request = fields.apply(RoutingRequest(Role.DECODE, 0.0, model="sim-model"))
        with anyio.fail_after(20):
            for n in range(1000):  # until the subscriptions are up and the events in
                body = {"model": "sim-model", "prompt": f"{prompt}question {n}?", "max_tokens": 2}
                await client.post_json(endpoints[1], "/v1/completions", body, phase=DECODE)
                if profiles.decode.run(request, candidates).endpoints[0].name == "d1":
                    break
                await anyio.sleep(0.1)
        ranked = profiles.decode.run(request, candidates).ranked
        assert ranked[0].scores["precise-prefix"] > 0.8
        assert ranked[1].scores["precise-prefix"] == 0.0
        # what the planner tells a threshold policy: the prompt tokens each decoder holds
        held = prefix.cached_tokens(request, endpoints[1])
        assert held is not None and held > 0.8 * len(fields.token_ids)
        assert prefix.cached_tokens(request, endpoints[0]) == 0
        assert prefix.cached_tokens(replace(request, token_ids=None), endpoints[1]) is None
        prefix.observe(profiles.decode, request, endpoints[1])
        report = prefix.report([profiles.decode])
        assert report.index is not None and report.index.keys > 0
        assert report.streams == {"d0": "live", "d1": "live"}
        assert set(report.plugin_memory) == {"decode/precise-prefix", "decode/approximate-prefix"}
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_the_gateway_s_planner_reads_the_precise_index() -> None:
    """The live bench's gateway config (KV events of every simulator) builds a
    gateway whose planner asks the precise index what each decoder holds."""
    fleet = preset_fleet("tiny")
    urls = {i.name: f"http://127.0.0.1:{9000 + n}" for n, i in enumerate(fleet.instances)}
    events = {
        name: (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}") for name in urls
    }
    threshold = {"policy": {"type": "goodput"}, "honour_client": False}
    for published, indexed in ((events, True), ({}, False)):
        config = parse_config(_gateway_config(fleet, urls, threshold, published))
        async with upstream(None) as client:
            state = build_state(config, client, GatewayMetrics(), lambda: 0.0)
        assert state.planner.cache is state.prefix
        assert state.prefix.pending is state.fleet.pending
        assert (state.prefix.index is not None) is indexed
