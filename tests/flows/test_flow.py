"""The flow against a scripted upstream transport: the branches processes rarely reach.

No server runs here: every leg goes through :class:`MockTransport`, whose handler
answers each upstream request from a small script (per endpoint host), and the
client side is a sink that records what the client would receive.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import orjson
import pytest

from connectors import get_connector
from pd_orchestrator.config.routing import RoutingConfig
from pd_orchestrator.config.settings import HandbackConfig, TimeoutConfig, UpstreamConfig
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.flows import Flow, FlowSettings, Legs, Single, renderer_for
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.openai.protocol import parse_for
from pd_orchestrator.planner.plan import Plan, Planner, RequestFacts
from pd_orchestrator.policies.base import ThresholdContext, ThresholdDecision
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.policies.threshold import ThresholdResolver
from pd_orchestrator.routing import build_profiles
from pd_orchestrator.telemetry.metrics import GatewayMetrics
from pd_orchestrator.upstream.client import Upstream
from pd_orchestrator.upstream.errors import UpstreamProtocolError, UpstreamStatusError
from pd_orchestrator.upstream.transport import (
    ConnectFailed,
    ConnectionBroken,
    MockResponse,
    MockTransport,
    Request,
)

pytestmark = pytest.mark.anyio

PROMPT_IDS = [1, 2, 3, 4]
D0 = Endpoint("d0", "http://d0", Role.DECODE)
D1 = Endpoint("d1", "http://d1", Role.DECODE)
P0 = Endpoint("p0", "http://p0", Role.PREFILL)
FLEET = (D0, D1, P0)


class _Half:
    def decide(self, context: ThresholdContext) -> ThresholdDecision:
        return ThresholdDecision(0.5, "static", "fixed")

    def observe(self, observation: object) -> None:
        return None


def _sse(*chunks: Mapping[str, Any], done: bool = True) -> list[bytes]:
    events = [b"data: " + orjson.dumps(dict(c)) + b"\n\n" for c in chunks]
    return [*events, b"data: [DONE]\n\n"] if done else events


def _completion_chunk(
    ids: list[int], finish: str | None = None, *, first: bool = False, text: str | None = None
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "text": text if text is not None else "".join(f" t{i}" for i in ids),
        "token_ids": ids,
        "finish_reason": finish,
    }
    if first:
        choice["prompt_token_ids"] = PROMPT_IDS
    return {
        "id": "up",
        "object": "text_completion",
        "created": 7,
        "model": "m",
        "choices": [choice],
    }


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    return {"id": "up", "object": "text_completion", "created": 7, "model": "m", "choices": [],
            "usage": usage}  # fmt: skip


async def _pieces(pieces: list[bytes], error: Exception | None = None) -> AsyncIterator[bytes]:
    for piece in pieces:
        yield piece
        await anyio.lowlevel.checkpoint()
    if error is not None:
        raise error


@dataclass
class Script:
    """Answers by endpoint host: a list of handlers consumed in order per host."""

    steps: dict[str, list[Callable[[Request], MockResponse]]]
    seen: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def __call__(self, request: Request) -> MockResponse:
        host = request.origin.host
        self.seen.append((host, request.json()))
        steps = self.steps.get(host)
        if not steps:
            raise ConnectFailed("refused")
        return steps.pop(0)(request)

    def bodies(self, host: str) -> list[dict[str, Any]]:
        return [body for seen_host, body in self.seen if seen_host == host]


class Sink:
    """What the client receives."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: Mapping[str, str] = {}
        self.data = b""
        self.started = False

    async def start(self, status: int, headers: Mapping[str, str], media_type: str) -> None:
        self.status, self.headers, self.started = status, headers, True

    async def send(self, data: bytes) -> None:
        self.data += data

    def end(self, data: bytes) -> None:
        self.data += data

    def answer(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.status, self.headers, self.data = status, headers, body

    def events(self) -> list[dict[str, Any]]:
        raw = [e.removeprefix(b"data: ") for e in self.data.split(b"\n\n") if e]
        assert raw[-1] == b"[DONE]"
        return [orjson.loads(e) for e in raw[:-1]]


@dataclass
class Run:
    flow: Flow
    sink: Sink
    fleet: FleetState
    script: Script


def _request(kind: str, body: dict[str, Any]) -> ClientRequest:
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    view = parse_for(kind, body)  # type: ignore[arg-type]
    return ClientRequest(kind, path, body, view, "rid", 0.0)  # type: ignore[arg-type]


def _plan(
    decoders: tuple[Endpoint, ...] = (D0, D1), prefillers: tuple[Endpoint, ...] = (P0,)
) -> Plan:
    routing = RoutingConfig.model_validate(
        {
            "decode": {
                "scorers": [],
                "picker": {"type": "max-score", "params": {"ties": "rotate"}},
            },
            "prefill": {
                "scorers": [],
                "picker": {"type": "max-score", "params": {"ties": "rotate"}},
            },
        }
    )
    planner = Planner(build_profiles(routing, builtin_registry()), ThresholdResolver(_Half()))  # type: ignore[arg-type]
    candidates = [Candidate(e) for e in (*decoders, *prefillers)]
    return planner.plan(RequestFacts(model="m", prompt_chars=10), candidates, 0.0, 0)


async def _serve(
    script: Script,
    body: dict[str, Any],
    *,
    kind: str = "completion",
    handback: HandbackConfig | None = None,
    upstream: UpstreamConfig | None = None,
    plan: Plan | None = None,
    fleet: FleetState | None = None,
    metrics: GatewayMetrics | None = None,
) -> Run:
    fleet = fleet or FleetState(FLEET)
    metrics = metrics or GatewayMetrics()
    client = Upstream(UpstreamConfig(), TimeoutConfig(), MockTransport(script))
    request = _request(kind, body)
    settings = FlowSettings(
        handback or HandbackConfig(),
        upstream or UpstreamConfig(prefill_attempts=2, retry_backoff=0.0),
        {"nixl": get_connector("nixl")},
        metrics,
        anyio.current_time,
    )
    legs = Legs(client, fleet, metrics, "rid", anyio.current_time)
    flow = Flow(request, plan or _plan(), legs, Single(), settings)
    sink = Sink()
    with anyio.fail_after(5):
        await flow.run(renderer_for(request, flow.transcript, sink, anyio.current_time))
    return Run(flow, sink, fleet, script)


def _stream(*chunks: Mapping[str, Any], error: Exception | None = None, done: bool = True):  # type: ignore[no-untyped-def]
    def answer(request: Request) -> MockResponse:
        return MockResponse(200, chunks=_pieces(_sse(*chunks, done=done), error))

    return answer


def _whole(answer: Mapping[str, Any]) -> Callable[[Request], MockResponse]:
    return lambda request: MockResponse(200, json=dict(answer))


def _text(run: Run) -> tuple[str, list[int]]:
    text, ids = "", []
    for event in run.sink.events():
        for choice in event.get("choices") or []:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            ids += choice.get("token_ids") or []
    return text, ids


STREAM = {"model": "m", "prompt": "hello", "max_tokens": 4, "stream": True}


async def test_an_unreachable_decoder_is_skipped_and_counted_as_failed() -> None:
    script = Script({"d1": [_stream(_completion_chunk([5, 6], "length", first=True))]})
    run = await _serve(script, STREAM)  # d0 refuses connections
    assert run.flow.decoder == D1 and run.flow.decision == "decode"
    assert _text(run)[0] == " t5 t6"
    assert run.fleet._failures["d0"] == 1  # one failed check on the fleet's books


async def test_token_ids_are_stripped_unless_asked() -> None:
    script = Script({"d0": [_stream(_completion_chunk([5, 6], "length", first=True))]})
    run = await _serve(script, STREAM)
    assert _text(run)[1] == []
    script = Script({"d0": [_stream(_completion_chunk([5, 6], "length", first=True))]})
    run = await _serve(script, STREAM | {"return_token_ids": True})
    assert _text(run)[1] == [5, 6]
    assert run.sink.events()[0]["choices"][0]["prompt_token_ids"] == PROMPT_IDS


async def test_a_rejection_goes_through_the_prefiller_with_the_transfer_params() -> None:
    params = {"remote_block_ids": [9], "remote_engine_id": "p0", "remote_host": "p0"}
    prefill = {"id": "p", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
               "kv_transfer_params": params}  # fmt: skip
    script = Script(
        {
            "d0": [
                _stream(_completion_chunk([], "cache_threshold", first=True)),
                _stream(_completion_chunk([5, 6, 7, 8], "length", first=True), _usage(4, 4)),
            ],
            "p0": [_whole(prefill)],
        }
    )
    run = await _serve(script, STREAM)
    assert run.flow.decision == "pd" and run.flow.prefiller == P0
    attempt, decode = script.bodies("d0")
    assert attempt["cache_hit_threshold"] == 0.5 and attempt["return_token_ids"] is True
    assert decode["kv_transfer_params"] == params and decode["cache_hit_threshold"] == 0.0
    [prefill_body] = script.bodies("p0")
    assert prefill_body["max_tokens"] == 1 and prefill_body["stream"] is False
    assert prefill_body["kv_transfer_params"]["do_remote_decode"] is True
    assert _text(run)[0] == " t5 t6 t7 t8"


class _One:
    def decide(self, context: ThresholdContext) -> ThresholdDecision:
        return ThresholdDecision(1.0, "goodput", "drain")

    def observe(self, observation: object) -> None:
        return None


async def test_at_threshold_one_the_decoder_is_not_asked_the_request_goes_p_d() -> None:
    """No prompt meets threshold 1 (vLLM computes the last token whatever it holds):
    no decode attempt, the prefiller first, then the decode leg on the plan's decoder."""
    params = {"remote_block_ids": [9], "remote_engine_id": "p0", "remote_host": "p0"}
    prefill = {"id": "p", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
               "kv_transfer_params": params}  # fmt: skip
    script = Script(
        {
            "d0": [_stream(_completion_chunk([5, 6, 7, 8], "length", first=True), _usage(4, 4))],
            "p0": [_whole(prefill)],
        }
    )
    routing = RoutingConfig.model_validate(
        {"decode": {"scorers": [], "picker": {"type": "max-score", "params": {"ties": "rotate"}}}}
    )
    planner = Planner(build_profiles(routing, builtin_registry()), ThresholdResolver(_One()))  # type: ignore[arg-type]
    candidates = [Candidate(e) for e in FLEET]
    plan = planner.plan(RequestFacts(model="m", prompt_chars=10), candidates, 0.0, 0)
    assert plan.threshold.value == 1.0
    run = await _serve(script, STREAM, plan=plan)
    assert run.flow.decision == "pd" and run.flow.decoder == D0 and run.flow.prefiller == P0
    [decode] = script.bodies("d0")  # the decode leg only
    assert decode["kv_transfer_params"] == params and decode["cache_hit_threshold"] == 0.0
    assert _text(run)[0] == " t5 t6 t7 t8"
    assert run.flow.rejected == ()


async def test_a_prefill_that_finished_is_the_answer() -> None:
    finished = {
        "id": "p",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                     "finish_reason": "stop", "token_ids": [2]}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1},
    }  # fmt: skip
    choice = {"index": 0, "delta": {}, "finish_reason": "cache_threshold"}
    rejected = {"id": "up", "object": "chat.completion.chunk", "created": 7, "model": "m",
                "choices": [choice]}  # fmt: skip
    script = Script({"d0": [_stream(rejected)], "p0": [_whole(finished)]})
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    run = await _serve(script, chat, kind="chat")
    events = run.sink.events()
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"
    assert events[-1]["usage"]["completion_tokens"] == 1
    assert len(script.bodies("d0")) == 1  # no decode leg ran


async def test_a_hand_back_continues_as_a_token_prompt_with_fewer_tokens() -> None:
    handed_back = _completion_chunk([6], "cache_threshold")
    script = Script(
        {
            "d0": [
                _stream(_completion_chunk([5], first=True), handed_back, _usage(4, 2)),
                _stream(_completion_chunk([7, 8], "length"), _usage(6, 2)),
            ],
            "p0": [_whole({"id": "p", "choices": [{"index": 0, "text": "",
                                                   "finish_reason": "length"}],
                           "kv_transfer_params": {"remote_block_ids": [1]}})],
        }
    )  # fmt: skip
    run = await _serve(script, STREAM | {"stream_options": {"include_usage": True}})
    assert _text(run)[0] == " t5 t6 t7 t8"
    [prefill] = script.bodies("p0")
    assert prefill["prompt"] == [*PROMPT_IDS, 5, 6]
    continuation = script.bodies("d0")[1]
    assert continuation["prompt"] == [*PROMPT_IDS, 5, 6] and continuation["max_tokens"] == 2
    usage = run.sink.events()[-1]["usage"]
    assert usage["prompt_tokens"] == 4 and usage["completion_tokens"] == 4
    assert run.flow.transcript.handbacks == 1


async def test_a_hand_back_at_the_token_limit_ends_the_answer() -> None:
    handed_back = _completion_chunk([6, 7, 8], "cache_threshold")
    script = Script({"d0": [_stream(_completion_chunk([5], first=True), handed_back)]})
    run = await _serve(script, STREAM)
    text, _ = _text(run)
    assert text == " t5 t6 t7 t8"
    finishes = [e["choices"][0]["finish_reason"] for e in run.sink.events() if e["choices"]]
    assert finishes[-1] == "length" and "p0" not in {host for host, _ in script.seen}


async def test_a_stream_that_breaks_is_recovered_on_another_decoder() -> None:
    broken = _stream(
        _completion_chunk([5], first=True), done=False, error=ConnectionBroken("reset")
    )
    prefill = {"id": "p", "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
               "kv_transfer_params": {"remote_block_ids": [1]}}  # fmt: skip
    script = Script(
        {
            "d0": [broken],
            "d1": [_stream(_completion_chunk([6, 7, 8], "length"))],
            "p0": [_whole(prefill)],
        }
    )
    run = await _serve(script, STREAM)
    assert _text(run)[0] == " t5 t6 t7 t8"
    assert run.flow.decoder == D1 and not run.fleet.is_healthy("d0")
    assert script.bodies("d1")[0]["prompt"] == [*PROMPT_IDS, 5]


async def test_a_stream_without_a_finish_is_an_error_when_no_recovery_is_left() -> None:
    script = Script({"d0": [_stream(_completion_chunk([5], first=True))]})
    with pytest.raises(UpstreamProtocolError, match="without a finish reason"):
        await _serve(script, STREAM, handback=HandbackConfig(max_recoveries=0))


async def test_an_error_event_mid_stream_is_an_upstream_error() -> None:
    error = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
    script = Script({"d0": [_stream(_completion_chunk([5], first=True), error)]})
    with pytest.raises(UpstreamStatusError, match="boom"):
        await _serve(script, STREAM, handback=HandbackConfig(max_recoveries=0))


async def test_a_streamed_leg_is_in_flight_until_it_ends_or_is_cancelled() -> None:
    release = anyio.Event()
    seen: list[int] = []
    fleet_box: list[FleetState] = []

    async def slow() -> AsyncIterator[bytes]:
        yield _sse(_completion_chunk([5], first=True), done=False)[0]
        seen.append(fleet_box[0].status("d0").in_flight)
        await release.wait()
        yield _sse(_completion_chunk([6], "length"))[0]
        yield b"data: [DONE]\n\n"

    script = Script({"d0": [lambda request: MockResponse(200, chunks=slow())]})
    fleet = FleetState(FLEET)
    fleet_box.append(fleet)
    metrics = GatewayMetrics()
    upstream = Upstream(UpstreamConfig(), TimeoutConfig(), MockTransport(script))
    request = _request("completion", STREAM)
    settings = FlowSettings(
        HandbackConfig(), UpstreamConfig(), {"nixl": get_connector("nixl")}, metrics,
        anyio.current_time,
    )  # fmt: skip
    flow = Flow(request, _plan(), Legs(upstream, fleet, metrics, "r", anyio.current_time),
                Single(), settings)  # fmt: skip
    with anyio.move_on_after(0.5):  # the client leaves while the leg streams
        await flow.run(renderer_for(request, flow.transcript, Sink(), anyio.current_time))
    assert seen == [1] and fleet.status("d0").in_flight == 0


CONSTRAINED = [
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("chat", {"tool_choice": "required"}),
    ("chat", {"response_format": {"type": "json_object"}}),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}),
    ("chat", {"logprobs": True}),
    ("chat", {"logprobs": True, "top_logprobs": 3}),
    ("completion", {"logprobs": 2}),
    ("completion", {"guided_json": {"type": "object"}}),
]


@pytest.mark.parametrize(
    ("kind", "field"), CONSTRAINED, ids=[next(iter(f)) + f"-{k}" for k, f in CONSTRAINED]
)
async def test_a_request_a_continuation_cannot_honour_is_never_handed_back(
    kind: str, field: dict[str, Any]
) -> None:
    """Threshold 0 (the decoder neither rejects nor hands it back), fields untouched."""
    if kind == "chat":
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        answer = {"id": "up", "object": "chat.completion", "created": 7, "model": "m",
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                               "finish_reason": "length", "token_ids": [5]}]}  # fmt: skip
    else:
        body = {"model": "m", "prompt": "hello"}
        answer = {"id": "up", "object": "text_completion", "created": 7, "model": "m",
                  "choices": [{"index": 0, "text": "x", "finish_reason": "length",
                               "token_ids": [5]}]}  # fmt: skip
    body |= field | {"cache_hit_threshold": 0.9}  # not even the client's own threshold
    request = _request(kind, body)
    routing = RoutingConfig.model_validate({"decode": {"scorers": []}})
    planner = Planner(build_profiles(routing, builtin_registry()), ThresholdResolver(_Half()))  # type: ignore[arg-type]
    facts = RequestFacts(model="m", prompt_chars=5, continuable=request.continuable)
    plan = planner.plan(facts, [Candidate(e) for e in FLEET], 0.0, 0)
    assert not request.continuable and plan.threshold.value == 0.0
    script = Script({"d0": [_whole(answer)], "d1": [_whole(answer)]})
    run = await _serve(script, body, kind=kind, plan=plan)
    [sent] = [b for _, b in script.seen]
    assert sent["cache_hit_threshold"] == 0.0
    assert {k: sent[k] for k in field} == field
    assert run.flow.decision == "decode"


@pytest.mark.parametrize(
    "field",
    [{"tool_choice": "none"}, {"logprobs": False}, {"response_format": {"type": "text"}}, {}],
    ids=["tool-choice-none", "logprobs-false", "text-format", "nothing"],
)
def test_neutral_values_keep_a_request_continuable(field: dict[str, Any]) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | field
    assert _request("chat", body).continuable
