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
from pd_orchestrator.flows.bodies import continuation_body
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.model.route import GoPD, Route, at, threshold_of
from pd_orchestrator.openai.protocol import parse_for
from pd_orchestrator.openai.responses import cached_count
from pd_orchestrator.planner.plan import Plan, Planner, RequestFacts, after_prefill
from pd_orchestrator.policies.base import Leaf, ThresholdContext
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.policies.threshold import ThresholdResolver
from pd_orchestrator.routing import build_profiles
from pd_orchestrator.telemetry.metrics import GatewayMetrics
from pd_orchestrator.upstream.client import Upstream
from pd_orchestrator.upstream.errors import UpstreamProtocolError, UpstreamStatusError
from pd_orchestrator.upstream.mock import MockResponse, MockTransport
from pd_orchestrator.upstream.transport import ConnectFailed, ConnectionBroken, Request

pytestmark = pytest.mark.anyio

PROMPT_IDS = [1, 2, 3, 4]
D0 = Endpoint("d0", "http://d0", Role.DECODE)
D1 = Endpoint("d1", "http://d1", Role.DECODE)
P0 = Endpoint("p0", "http://p0", Role.PREFILL)
FLEET = (D0, D1, P0)


class _Half(Leaf):
    name = "static"
    bounds = (0.5, 0.5)

    def decide(self, context: ThresholdContext) -> Route:
        return at(0.5, "static", "fixed")

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
        try:
            raise error
        finally:
            del error  # this frame, in the error's traceback, would hold it: a cycle


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
    decoders: tuple[Endpoint, ...] = (D0, D1),
    prefillers: tuple[Endpoint, ...] = (P0,),
    *,
    resumable: bool = False,
    resumes: bool = True,
) -> Plan:
    """A plan over ``decoders`` and ``prefillers``; ``resumable``: for a structured
    output (not continuable as a plain token prompt), on endpoints that honour
    admission-only thresholds and resume a grammar when ``resumes``."""
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
    candidates = [
        Candidate(e, admission_only=True, resumes=resumes) for e in (*decoders, *prefillers)
    ]
    facts = RequestFacts(model="m", prompt_chars=10, continuable=not resumable, resumable=resumable)
    return planner.plan(facts, candidates, 0.0, 0)


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


class _One(Leaf):
    name = "goodput"
    bounds = (0.0, 1.0)

    def __init__(self, decoder: str | None = None) -> None:
        self.decoder = decoder

    def decide(self, context: ThresholdContext) -> Route:
        return GoPD("goodput", "drain", self.decoder)

    def observe(self, observation: object) -> None:
        return None


@pytest.mark.parametrize(("named", "decoder"), [(None, D0), ("d1", D1)], ids=["chosen", "named"])
async def test_at_threshold_one_the_decoder_is_not_asked_the_request_goes_p_d(
    named: str | None, decoder: Endpoint
) -> None:
    """No prompt meets threshold 1 (vLLM computes the last token whatever it holds):
    no decode attempt, the prefiller first, then the decode leg on the plan's decoder
    -- or on the peer the policy names (a drained prompt needs no prefix of the
    decoder's own), and then nothing goes to the decoder the routing picked."""
    params = {"remote_block_ids": [9], "remote_engine_id": "p0", "remote_host": "p0"}
    prefill = {"id": "p", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
               "kv_transfer_params": params}  # fmt: skip
    script = Script(
        {
            decoder.name: [
                _stream(_completion_chunk([5, 6, 7, 8], "length", first=True), _usage(4, 4))
            ],
            "p0": [_whole(prefill)],
        }
    )
    routing = RoutingConfig.model_validate(
        {"decode": {"scorers": [], "picker": {"type": "max-score"}}}
    )
    planner = Planner(build_profiles(routing, builtin_registry()), ThresholdResolver(_One(named)))  # type: ignore[arg-type]
    candidates = [Candidate(e) for e in FLEET]
    plan = planner.plan(RequestFacts(model="m", prompt_chars=10), candidates, 0.0, 0)
    assert threshold_of(plan.route) == 1.0
    assert plan.ranking.pick is not None and plan.ranking.pick.candidate.endpoint == D0
    run = await _serve(script, STREAM, plan=plan)
    assert run.flow.decision == "pd" and run.flow.decoder == decoder and run.flow.prefiller == P0
    [decode] = script.bodies(decoder.name)  # the decode leg only
    assert decode["kv_transfer_params"] == params and decode["cache_hit_threshold"] == 0.0
    assert _text(run)[0] == " t5 t6 t7 t8"
    assert run.flow.rejected == ()
    if named is not None:
        assert script.bodies("d0") == []


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


def _handback_script(first: Any, continued: Any) -> Script:
    """``d0`` answers ``first`` (which hands the request back) then ``continued``; ``p0``
    prefills the continuation."""
    prefilled = {"id": "p", "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                 "kv_transfer_params": {"remote_block_ids": [1]}}  # fmt: skip
    return Script({"d0": [first, continued], "p0": [_whole(prefilled)]})


async def test_a_hand_back_continues_as_a_token_prompt_with_fewer_tokens() -> None:
    handed_back = _completion_chunk([6], "cache_threshold")
    script = _handback_script(
        _stream(_completion_chunk([5], first=True), handed_back, _usage(4, 2)),
        _stream(_completion_chunk([7, 8], "length"), _usage(6, 2)),
    )
    run = await _serve(script, STREAM | {"stream_options": {"include_usage": True}})
    assert _text(run)[0] == " t5 t6 t7 t8"
    [prefill] = script.bodies("p0")
    assert prefill["prompt"] == [*PROMPT_IDS, 5, 6]
    continuation = script.bodies("d0")[1]
    assert continuation["prompt"] == [*PROMPT_IDS, 5, 6] and continuation["max_tokens"] == 2
    usage = run.sink.events()[-1]["usage"]
    assert usage["prompt_tokens"] == 4 and usage["completion_tokens"] == 4
    assert run.flow.transcript.handbacks == 1


RESUMABLE = [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {}}}},
    {"structured_outputs": {"regex": "[0-9]+"}},
]


@pytest.mark.parametrize("field", RESUMABLE, ids=["json-object", "json-schema", "regex"])
async def test_a_structured_output_is_continued_with_its_constraint_and_resume_count(
    field: dict[str, Any],
) -> None:
    """Both legs of the continuation carry the constraint and how many of the prompt's
    last tokens are output the grammar must be advanced over."""
    handed_back = _completion_chunk([6], "cache_threshold")
    script = _handback_script(
        _stream(_completion_chunk([5], first=True), handed_back, _usage(4, 2)),
        _stream(_completion_chunk([7, 8], "length"), _usage(6, 2)),
    )
    body = STREAM | field
    request = _request("completion", body)
    assert request.resumable and not request.continuable
    run = await _serve(script, body, plan=_plan(resumable=True))
    assert _text(run)[0] == " t5 t6 t7 t8"
    attempt, continuation = script.bodies("d0")
    assert "cache_hit_resume_tokens" not in attempt
    [prefill] = script.bodies("p0")
    for sent in (prefill, continuation):
        assert sent["prompt"] == [*PROMPT_IDS, 5, 6]
        assert sent["cache_hit_resume_tokens"] == 2
        assert {k: sent[k] for k in field} == field
    assert run.flow.transcript.handbacks == 1


def test_a_chat_structured_output_continues_on_completions_with_its_format() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
            "response_format": {"type": "json_object"}, "tools": None}  # fmt: skip
    request = _request("chat", body)
    sent = continuation_body(request, [1, 2, 3, 7, 8], 2, 0.5)
    assert "messages" not in sent and sent["prompt"] == [1, 2, 3, 7, 8]
    assert sent["response_format"] == {"type": "json_object"}
    assert sent["cache_hit_resume_tokens"] == 2 and sent["max_tokens"] == 7
    plain = _request("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert "cache_hit_resume_tokens" not in continuation_body(plain, [1, 2, 3, 7], 1, 0.5)


def test_a_structured_output_is_not_handed_back_where_a_decoder_cannot_resume() -> None:
    """Admission-only, as any request a continuation cannot honour."""
    plan = _plan(resumable=True, resumes=False)
    assert not plan.continuable and plan.route.admission_only
    assert _plan(resumable=True).route.admission_only is False


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
    ("completion", {"prompt_logprobs": 1}),
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
    assert not request.continuable and threshold_of(plan.route) == 0.0
    script = Script({"d0": [_whole(answer)], "d1": [_whole(answer)]})
    run = await _serve(script, body, kind=kind, plan=plan)
    [sent] = [b for _, b in script.seen]
    assert sent["cache_hit_threshold"] == 0.0
    assert {k: sent[k] for k in field} == field
    assert run.flow.decision == "decode"


def _chat_chunk(ids: list[int], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
    delta = {"content": "".join(f" t{i}" for i in ids)}
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
              "token_ids": ids}  # fmt: skip
    return {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 7,
            "model": "m", "choices": [choice], "prompt_token_ids": PROMPT_IDS}  # fmt: skip


def _chat_entries(ids: list[int]) -> dict[str, Any]:
    return {"content": [{"token": f" t{i}", "logprob": -0.5, "bytes": list(f" t{i}".encode()),
                         "top_logprobs": [{"token": f" t{i}", "logprob": -0.5,
                                           "bytes": list(f" t{i}".encode())}]}
                        for i in ids]}  # fmt: skip


def _completion_logprobs(ids: list[int]) -> dict[str, Any]:
    """What vLLM's completions API returns for ``ids`` with ``logprobs: 1`` (the sampled
    token first, then the top one: here the same, so one entry)."""
    tokens = [f" t{i}" for i in ids]
    offsets = [3 * k for k in range(len(ids))]
    return {"tokens": tokens, "token_logprobs": [-0.5] * len(ids),
            "top_logprobs": [{t: -0.5, "x": -3.0} for t in tokens],
            "text_offset": offsets}  # fmt: skip


def _handed_back_logprobs(first: dict[str, Any], handed_back: dict[str, Any]) -> Script:
    """Token 5 then a hand-back with token 6 on d0; the continuation 7, 8 in completions
    shape, each with logprobs."""
    continued = _completion_chunk([7, 8], "length")
    continued["choices"][0]["logprobs"] = _completion_logprobs([7, 8])
    return _handback_script(
        _stream(first, handed_back, _usage(4, 2)), _stream(continued, _usage(6, 2))
    )


async def test_a_chat_stream_with_logprobs_is_continued_with_chat_shaped_logprobs() -> None:
    """The continuation asks ``logprobs: top_logprobs``; its completions logprobs reach
    the chat client as ``content`` entries, ``top_logprobs`` alternatives each."""
    first = _chat_chunk([5], logprobs=_chat_entries([5]))
    handed_back = _chat_chunk([6], "cache_threshold", logprobs=_chat_entries([6]))
    script = _handed_back_logprobs(first, handed_back)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True, "logprobs": True, "top_logprobs": 1}  # fmt: skip
    assert _request("chat", body).continuable
    run = await _serve(script, body, kind="chat")
    continuation = script.bodies("d0")[1]
    assert continuation["logprobs"] == 1 and "top_logprobs" not in continuation
    entries = [e for event in run.sink.events() for c in event.get("choices", [])
               for e in ((c.get("logprobs") or {}).get("content") or [])]  # fmt: skip
    assert entries == _chat_entries([5, 6, 7, 8])["content"]


async def test_a_whole_completion_with_logprobs_merges_them_with_moved_offsets() -> None:
    def answer(ids: list[int], finish: str) -> dict[str, Any]:
        choice = _completion_chunk(ids, finish, first=True)["choices"][0]
        return {"id": "up", "object": "text_completion", "created": 7, "model": "m",
                "choices": [choice | {"logprobs": _completion_logprobs(ids)}],
                "usage": _usage(4, len(ids))}  # fmt: skip

    script = _handback_script(
        _whole(answer([5, 6], "cache_threshold")), _whole(answer([7, 8], "length"))
    )
    body = {"model": "m", "prompt": "hello", "max_tokens": 4, "logprobs": 1}
    run = await _serve(script, body)
    assert script.bodies("d0")[1]["logprobs"] == 1
    logprobs = orjson.loads(run.sink.data)["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [" t5", " t6", " t7", " t8"]
    assert logprobs["text_offset"] == [0, 3, 6, 9]  # the continuation's start after " t5 t6"
    assert len(logprobs["top_logprobs"]) == 4 and logprobs["token_logprobs"] == [-0.5] * 4


TOOL_PARAMETERS = {"type": "object", "properties": {"a": {"type": "integer"}}}
NAMED_TOOL = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": TOOL_PARAMETERS}}],
    "tool_choice": {"type": "function", "function": {"name": "f"}},
}


def _tool_chunk(ids: list[int], arguments: str, finish: str | None = None) -> dict[str, Any]:
    chunk = _chat_chunk(ids, finish)
    call = {"index": 0, "function": {"arguments": arguments}}
    if ids == [5]:
        call |= {"id": "chatcmpl-tool-up", "type": "function"}
        call["function"]["name"] = "f"
    chunk["choices"][0]["delta"] = {"tool_calls": [call]}
    return chunk


async def test_a_named_tool_call_streamed_is_continued_as_argument_deltas() -> None:
    """The continuation is constrained to the tool's parameters; its text reaches the
    client as the same call's argument deltas (no second id, no content)."""
    first = _stream(_tool_chunk([5], '{"a'), _tool_chunk([6], '": 1', "cache_threshold"))
    continued = _stream(_completion_chunk([7], "stop", text="2}"), _usage(6, 1))
    script = _handback_script(first, continued)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": True} | NAMED_TOOL  # fmt: skip
    request = _request("chat", body)
    assert request.resumable and request.named_tool is not None
    run = await _serve(script, body, kind="chat", plan=_plan(resumable=True))
    continuation = script.bodies("d0")[1]
    assert continuation["structured_outputs"] == {"json": TOOL_PARAMETERS}
    assert continuation["cache_hit_resume_tokens"] == 2 and "tools" not in continuation
    deltas = [c["delta"] for e in run.sink.events() for c in e.get("choices", [])]
    calls = [call for d in deltas for call in d.get("tool_calls") or []]
    assert "".join(c["function"]["arguments"] for c in calls) == '{"a": 12}'
    assert [c.get("id") for c in calls] == ["chatcmpl-tool-up", None, None]
    assert not any(d.get("content") for d in deltas)
    finishes = [c["finish_reason"] for e in run.sink.events() for c in e.get("choices", [])]
    assert [f for f in finishes if f] == ["stop"]


async def test_a_named_tool_call_whole_is_continued_into_the_same_call() -> None:
    first = {"id": "chatcmpl-up", "object": "chat.completion", "created": 7, "model": "m",
             "choices": [{"index": 0, "finish_reason": "cache_threshold", "token_ids": [5, 6],
                          "message": {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "chatcmpl-tool-up", "type": "function",
                               "function": {"name": "f", "arguments": '{"a": 1'}}]}}],
             "prompt_token_ids": PROMPT_IDS, "usage": _usage(4, 2)}  # fmt: skip
    continued = {"id": "up", "object": "text_completion", "created": 7, "model": "m",
                 "choices": [{"index": 0, "text": "2}", "token_ids": [7],
                              "finish_reason": "stop"}], "usage": _usage(6, 1)}  # fmt: skip
    script = _handback_script(_whole(first), _whole(continued))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    run = await _serve(script, body | NAMED_TOOL, kind="chat", plan=_plan(resumable=True))
    message = orjson.loads(run.sink.data)["choices"][0]["message"]
    assert message["content"] == ""
    [call] = message["tool_calls"]
    assert call["id"] == "chatcmpl-tool-up" and call["function"] == {
        "name": "f",
        "arguments": '{"a": 12}',
    }


def test_a_tool_choice_that_names_no_defined_tool_is_not_resumable() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | NAMED_TOOL
    auto = _request("chat", body | {"tool_choice": "auto"})
    assert not auto.resumable and auto.uncontinuable_field == "tools"
    other = _request("chat", body | {"tool_choice": {"type": "function",
                                                     "function": {"name": "g"}}})  # fmt: skip
    assert not other.resumable and other.named_tool is None


@pytest.mark.parametrize(
    "field",
    [{"tool_choice": "none"}, {"logprobs": False}, {"response_format": {"type": "text"}}, {}],
    ids=["tool-choice-none", "logprobs-false", "text-format", "nothing"],
)
def test_neutral_values_keep_a_request_continuable(field: dict[str, Any]) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | field
    assert _request("chat", body).continuable


async def test_a_p_d_flow_knows_when_its_prefill_answered_a_local_one_does_not() -> None:
    """What the cost model learns the hand-over from: the prefill answer's time,
    before the first content (:func:`~pd_orchestrator.planner.plan.after_prefill`)."""
    params = {"remote_block_ids": [9], "remote_engine_id": "p0", "remote_host": "p0"}
    prefill = {"id": "p", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
               "kv_transfer_params": params}  # fmt: skip
    rejected = _stream(_completion_chunk([], "cache_threshold", first=True))
    served = _stream(_completion_chunk([5, 6], "length", first=True), _usage(4, 2))
    pd = await _serve(Script({"d0": [rejected, served], "p0": [_whole(prefill)]}), STREAM)
    assert pd.flow.decision == "pd" and pd.flow.answered is not None
    assert pd.flow.answered <= anyio.current_time()
    local = await _serve(Script({"d0": [served]}), STREAM)
    assert local.flow.decision == "decode" and local.flow.answered is None
    assert after_prefill(10.0, 0.5, 10.2) == pytest.approx(0.3)
    assert after_prefill(10.0, 0.5, 10.7) is None  # a continuation's prefill, after the first
    assert after_prefill(10.0, None, 10.2) is None


async def test_a_p_d_flow_tells_what_its_prefiller_said_it_had_cached() -> None:
    """A P/D sample's rate counts what the prefiller lacked, when it says."""
    params = {"remote_block_ids": [9], "remote_engine_id": "p0", "remote_host": "p0"}
    usage = {"prompt_tokens": 40, "completion_tokens": 1,
             "prompt_tokens_details": {"cached_tokens": 32}}  # fmt: skip
    prefill = {"id": "p", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
               "kv_transfer_params": params, "usage": usage}  # fmt: skip
    rejected = _stream(_completion_chunk([], "cache_threshold", first=True))
    served = _stream(_completion_chunk([5, 6], "length", first=True), _usage(4, 2))
    said = await _serve(Script({"d0": [rejected, served], "p0": [_whole(prefill)]}), STREAM)
    assert said.flow.decision == "pd" and said.flow.prefill_cached == 32
    silent = prefill | {"usage": {"prompt_tokens": 40, "completion_tokens": 1}}
    unsaid = await _serve(Script({"d0": [rejected, served], "p0": [_whole(silent)]}), STREAM)
    assert unsaid.flow.decision == "pd" and unsaid.flow.prefill_cached is None
    for bad in (-1, True, "32", None):
        assert cached_count({"prompt_tokens_details": {"cached_tokens": bad}}) is None


async def test_a_p_d_flow_times_its_prefill_leg_apart_from_the_rejection_before_it() -> None:
    """The prefill leg's own time, from its send to its answer: what came before it (a
    decoder's slow rejection at its threshold) is not part of it."""
    params = {"remote_block_ids": [9], "remote_engine_id": "p0", "remote_host": "p0"}
    prefill = {"id": "p", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
               "kv_transfer_params": params, "usage": {"prompt_tokens": 40}}  # fmt: skip
    rejected_at: list[float] = []

    async def slow_rejection() -> AsyncIterator[bytes]:
        await anyio.sleep(0.3)
        rejected_at.append(anyio.current_time())
        for piece in _sse(_completion_chunk([], "cache_threshold", first=True)):
            yield piece

    served = _stream(_completion_chunk([5, 6], "length", first=True), _usage(4, 2))
    script = Script(
        {"d0": [lambda request: MockResponse(200, chunks=slow_rejection()), served],
         "p0": [_whole(prefill)]}
    )  # fmt: skip
    run = await _serve(script, STREAM)
    flow = run.flow
    assert flow.decision == "pd" and flow.answered is not None
    seconds = flow.prefill_seconds
    assert seconds is not None and seconds >= 0.0
    assert flow.answered - seconds >= rejected_at[0]  # sent after the rejection came
