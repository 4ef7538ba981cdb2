"""What the legs report, against the scripted transport: per-upstream metrics, the
one log line per upstream failure, the headers every leg carries (request id, the
client's or the pool's ``Authorization``, ``traceparent``) and the spans of a trace."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from connectors import get_connector
from pd_orchestrator.config.routing import RoutingConfig
from pd_orchestrator.config.settings import (
    AskAllConfig,
    HandbackConfig,
    TimeoutConfig,
    UpstreamConfig,
)
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.flows import Flow, FlowSettings, Legs, Probe, Race, Single, renderer_for
from pd_orchestrator.flows.attempts import Attempt
from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.planner.plan import Plan, Planner, RequestFacts
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.policies.threshold import ThresholdResolver
from pd_orchestrator.routing import build_profiles
from pd_orchestrator.telemetry.metrics import GatewayMetrics
from pd_orchestrator.telemetry.tracing import RequestTrace, Tracing
from pd_orchestrator.upstream.client import Upstream
from pd_orchestrator.upstream.errors import UpstreamStatusError
from pd_orchestrator.upstream.mock import MockResponse, MockTransport
from pd_orchestrator.upstream.transport import ConnectionBroken, Request

from .test_flow import (
    D0,
    D1,
    P0,
    PROMPT_IDS,
    STREAM,
    Script,
    Sink,
    _completion_chunk,
    _Half,
    _request,
    _stream,
    _usage,
    _whole,
)

pytestmark = pytest.mark.anyio

PARAMS = {"remote_block_ids": [9], "remote_engine_id": "p0", "remote_host": "p0"}
PREFILL = {"id": "p", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
           "kv_transfer_params": PARAMS}  # fmt: skip


@dataclass
class Observed:
    flow: Flow
    legs: Legs
    metrics: GatewayMetrics
    transport: MockTransport
    spans: list[ReadableSpan]
    request_span: RequestTrace | None

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def headers(self, host: str) -> list[dict[str, str]]:
        return [
            {k.lower(): v for k, v in r.headers} for r in self.transport.requests
            if r.origin.host == host
        ]  # fmt: skip


async def _serve(
    script: Script,
    body: dict[str, Any],
    *,
    forward: dict[str, str] | None = None,
    fleet: tuple[Endpoint, ...] = (D0, D1, P0),
    tracing: bool = False,
    attempt: Attempt | None = None,
    handback: HandbackConfig | None = None,
    state: FleetState | None = None,
    blocks: tuple[int, ...] = (),
) -> Observed:
    metrics = GatewayMetrics()
    transport = MockTransport(script)
    upstream = Upstream(UpstreamConfig(), TimeoutConfig(), transport)
    exporter = InMemorySpanExporter()
    trace = None
    if tracing:
        tracer = Tracing("test", 1.0, SimpleSpanProcessor(exporter))
        trace = tracer.request("POST", "/v1/completions", {})
    request = _request("completion", body)
    settings = FlowSettings(
        handback or HandbackConfig(),
        UpstreamConfig(prefill_attempts=3, retry_backoff=0.0),
        {"nixl": get_connector("nixl")},
        metrics,
        anyio.current_time,
    )
    legs = Legs(
        upstream, state or FleetState(fleet), metrics, "rid", anyio.current_time,
        forward=forward, trace=trace,
    )  # fmt: skip
    plan = replace(_plan_over(fleet), blocks=blocks)
    flow = Flow(request, plan, legs, attempt or Single(), settings)
    with anyio.fail_after(5):
        try:
            await flow.run(renderer_for(request, flow.transcript, Sink(), anyio.current_time))
        finally:
            if trace is not None:
                trace.finish(200, {"pd.decision": flow.decision})
    return Observed(flow, legs, metrics, transport, list(exporter.get_finished_spans()), trace)


def _plan_over(fleet: tuple[Endpoint, ...]) -> Plan:
    """The test_flow plan (decoders in order, threshold 0.5) over ``fleet``."""
    routing = RoutingConfig.model_validate(
        {"decode": {"scorers": [], "picker": {"type": "max-score", "params": {"ties": "rotate"}}}}
    )
    threshold = ThresholdResolver(_Half())  # type: ignore[arg-type]
    planner = Planner(build_profiles(routing, builtin_registry()), threshold)
    candidates = [Candidate(e) for e in fleet]
    return planner.plan(RequestFacts(model="m", prompt_chars=10), candidates, 0.0, 0)


def _pd_script() -> Script:
    return Script(
        {
            "d0": [
                _stream(_completion_chunk([], "cache_threshold", first=True)),
                _stream(_completion_chunk([5, 6, 7, 8], "length", first=True), _usage(4, 4)),
            ],
            "p0": [_whole(PREFILL)],
        }
    )


async def test_every_leg_is_counted_by_upstream_phase_and_outcome() -> None:
    run = await _serve(_pd_script(), STREAM)
    assert run.flow.decision == "pd"
    counted = "pd_orchestrator_upstream_requests_total"
    # the attempt answered cache_threshold without a token: rejected, not failed
    assert run.sample(counted, upstream="d0", phase="decode_attempt", outcome="rejected") == 1
    assert run.sample(counted, upstream="p0", phase="prefill", outcome="ok") == 1
    assert run.sample(counted, upstream="d0", phase="decode", outcome="ok") == 1
    seconds = "pd_orchestrator_upstream_seconds_count"
    assert run.sample(seconds, upstream="p0", phase="prefill") == 1
    assert run.sample(seconds, upstream="d0", phase="decode") == 1
    assert run.sample("pd_orchestrator_kv_transfers_total", connector="nixl") == 1
    assert run.sample("pd_orchestrator_prefill_retries_total") == 0


async def test_a_prefill_sent_again_is_a_retry_and_its_failure_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    script = _pd_script()
    unavailable = {"error": {"message": "engine overloaded, try later", "code": 503}}
    script.steps["p0"].insert(0, lambda request: MockResponse(503, json=unavailable))
    with caplog.at_level(logging.INFO, logger="pd_orchestrator.upstream"):
        run = await _serve(script, STREAM)
    assert run.flow.decision == "pd"
    assert run.sample("pd_orchestrator_prefill_retries_total") == 1
    counted = "pd_orchestrator_upstream_requests_total"
    assert run.sample(counted, upstream="p0", phase="prefill", outcome="http_5xx") == 1
    assert run.sample(counted, upstream="p0", phase="prefill", outcome="ok") == 1
    errors = "pd_orchestrator_upstream_errors_total"
    assert run.sample(errors, upstream="p0", kind="UpstreamStatusError") == 1
    [record] = [r for r in caplog.records if r.name == "pd_orchestrator.upstream"]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "upstream p0 failed during prefill (UpstreamStatusError): "
        "HTTP 503: engine overloaded, try later"
    )


async def test_a_stream_that_breaks_mid_answer_is_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broken = _stream(
        _completion_chunk([5], first=True), done=False, error=ConnectionBroken("reset by peer")
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
    with caplog.at_level(logging.INFO, logger="pd_orchestrator.upstream"):
        run = await _serve(script, STREAM)
    assert run.flow.decoder == D1
    counted = "pd_orchestrator_upstream_requests_total"
    assert run.sample(counted, upstream="d0", phase="decode_attempt", outcome="protocol") == 1
    assert run.sample(counted, upstream="d1", phase="decode", outcome="ok") == 1
    errors = "pd_orchestrator_upstream_errors_total"
    assert run.sample(errors, upstream="d0", kind="UpstreamProtocolError") == 1
    assert run.sample(errors, upstream="d0", kind="recovered") == 1
    messages = [r.getMessage() for r in caplog.records if r.name == "pd_orchestrator.upstream"]
    assert messages == [
        "upstream d0 failed during decode_attempt (UpstreamProtocolError): "
        "connection broken (reset by peer)"
    ]


async def test_a_client_error_from_upstream_is_logged_at_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    too_long = {"error": {"message": "This model's maximum context length is 8", "code": 400}}
    script = Script({"d0": [lambda request: MockResponse(400, json=too_long)]})
    with (
        caplog.at_level(logging.INFO, logger="pd_orchestrator.upstream"),
        pytest.raises(UpstreamStatusError),
    ):
        await _serve(script, STREAM)
    [record] = [r for r in caplog.records if r.name == "pd_orchestrator.upstream"]
    assert record.levelno == logging.INFO
    assert "maximum context length is 8" in record.getMessage()


async def test_the_clients_authorization_is_forwarded_unless_the_pool_has_a_key() -> None:
    keyed = replace(P0, authorization="Bearer pool-key")
    run = await _serve(
        _pd_script(), STREAM, forward={"authorization": "Bearer client"}, fleet=(D0, D1, keyed)
    )
    attempt, decode = run.headers("d0")
    [prefill] = run.headers("p0")
    assert attempt["authorization"] == decode["authorization"] == "Bearer client"
    assert prefill["authorization"] == "Bearer pool-key"
    ids = [attempt["x-request-id"], prefill["x-request-id"], decode["x-request-id"]]
    assert len(set(ids)) == 3 and all(i.startswith("rid-") for i in ids)
    assert "pool-key" not in repr(keyed)


async def test_without_tracing_the_clients_traceparent_is_passed_on() -> None:
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    run = await _serve(_pd_script(), STREAM, forward={"traceparent": parent})
    assert {h["traceparent"] for h in run.headers("d0") + run.headers("p0")} == {parent}
    assert run.spans == []


async def test_a_trace_has_a_span_per_leg_below_the_request_and_propagates_it() -> None:
    run = await _serve(_pd_script(), STREAM, tracing=True)
    by_name = {span.name: span for span in run.spans}
    assert sorted(by_name) == ["POST /v1/completions", "decode", "decode_attempt", "prefill"]
    root = by_name["POST /v1/completions"]
    assert root.kind is SpanKind.SERVER and root.parent is None
    for name in ("decode_attempt", "prefill", "decode"):
        span = by_name[name]
        assert span.kind is SpanKind.CLIENT
        assert span.parent is not None and span.parent.span_id == root.context.span_id
        assert span.context.trace_id == root.context.trace_id
    attributes = {name: dict(span.attributes or {}) for name, span in by_name.items()}
    assert attributes["prefill"]["pd.endpoint"] == "p0"
    assert attributes["decode_attempt"]["pd.outcome"] == "rejected"
    assert attributes["decode"]["pd.completion_tokens"] == 4
    # each upstream request carries its own leg span's context
    attempt, decode = run.headers("d0")
    [prefill] = run.headers("p0")
    sent = [attempt, prefill, decode]
    legs = [by_name["decode_attempt"], by_name["prefill"], by_name["decode"]]
    for headers, span in zip(sent, legs, strict=True):
        context = span.context
        flags = f"{context.trace_flags:02x}"
        assert context.trace_flags.sampled
        expected = f"00-{context.trace_id:032x}-{context.span_id:016x}-{flags}"
        assert headers["traceparent"] == expected


async def test_a_hand_back_traces_a_continuation_leg() -> None:
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
    run = await _serve(script, STREAM, tracing=True)
    names = [span.name for span in run.spans]
    assert names == ["decode_attempt", "prefill", "continuation", "POST /v1/completions"]
    continuation = run.spans[2]
    assert dict(continuation.attributes or {})["pd.phase"] == "decode"
    assert run.flow.transcript.prompt_ids == PROMPT_IDS


async def test_a_failed_leg_span_is_an_error_with_the_upstream_message() -> None:
    script = _pd_script()
    script.steps["p0"].insert(
        0, lambda request: MockResponse(503, json={"error": {"message": "busy", "code": 503}})
    )
    run = await _serve(script, STREAM, tracing=True)
    failed = [
        s for s in run.spans if s.name == "prefill" and s.status.status_code is StatusCode.ERROR
    ]
    assert len(failed) == 1
    assert "HTTP 503: busy" in (failed[0].status.description or "")
    assert dict(failed[0].attributes or {})["pd.outcome"] == "http_5xx"


async def test_ask_all_probes_are_their_own_legs() -> None:
    answer = {"id": "a", "object": "text_completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "text": " t5", "token_ids": [5],
                           "finish_reason": "length"}],
              "usage": {"prompt_tokens": 4, "completion_tokens": 1,
                        "prompt_tokens_details": {"cached_tokens": 4}}}  # fmt: skip
    script = Script(
        {
            "d0": [_whole(answer), _stream(_completion_chunk([5, 6], "length", first=True))],
            "d1": [_whole(answer | {"usage": {"prompt_tokens": 4, "completion_tokens": 1}})],
        }
    )
    run = await _serve(
        script, STREAM, tracing=True,
        attempt=Probe(AskAllConfig(tokenize_from=None), GatewayMetrics()),
    )  # fmt: skip
    counted = "pd_orchestrator_upstream_requests_total"
    assert run.sample(counted, upstream="d0", phase="probe", outcome="ok") == 1
    assert run.sample(counted, upstream="d1", phase="probe", outcome="ok") == 1
    assert sorted(s.name for s in run.spans if s.name == "probe") == ["probe", "probe"]


async def test_tokenize_once_is_a_leg_and_every_asked_decoder_gets_the_ids() -> None:
    """Ask-all over two decoders: one ``/tokenize`` on the first asked decoder (its own
    leg, phase ``tokenize``), then both asked decoders get the ids on completions."""
    script = Script(
        {
            "d0": [
                _whole({"count": 4, "max_model_len": 64, "tokens": PROMPT_IDS}),
                _stream(_completion_chunk([5, 6], "length", first=True)),
            ],
            "d1": [_stream(_completion_chunk([], "cache_threshold", first=True))],
        }
    )
    metrics = GatewayMetrics()
    run = await _serve(script, STREAM, tracing=True, attempt=Race(AskAllConfig(), metrics))
    assert run.flow.decoder == D0 and run.flow.decision == "decode"
    tokenize, attempt = script.bodies("d0")
    assert tokenize == {"model": "m", "prompt": "hello"}
    [other] = script.bodies("d1")
    assert attempt["prompt"] == PROMPT_IDS and other["prompt"] == PROMPT_IDS
    counted = "pd_orchestrator_upstream_requests_total"
    assert run.sample(counted, upstream="d0", phase="tokenize", outcome="ok") == 1
    form = metrics.registry.get_sample_value(
        "pd_orchestrator_ask_all_prompts_total", {"form": "tokenized"}
    )
    assert form == 1


async def test_a_leg_cancelled_while_it_connects_leaves_nothing_in_flight() -> None:
    async def never(request: Request) -> MockResponse:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    script = Script(
        {"d0": [_stream(_completion_chunk([5, 6], "length", first=True))], "d1": [never]}
    )
    fleet = (D0, D1, P0)
    race = Race(AskAllConfig(tokenize_from=None), GatewayMetrics())
    run = await _serve(script, STREAM, fleet=fleet, attempt=race, tracing=True)
    assert run.flow.decoder == D0
    assert run.legs.fleet.status("d1").in_flight == 0  # the loser was still connecting
    counted = "pd_orchestrator_upstream_requests_total"
    assert run.sample(counted, upstream="d1", phase="decode_attempt", outcome="cancelled") == 1
    [loser] = [s for s in run.spans if dict(s.attributes or {}).get("pd.endpoint") == "d1"]
    assert dict(loser.attributes or {})["pd.outcome"] == "cancelled"


def _watcher(state: FleetState, seen: list[tuple[str, int, int]]) -> Any:
    """Wraps a scripted answer: it records the endpoint's backlog and in-flight count
    when the request arrives."""

    def watching(name: str, answer: Any) -> Any:
        def handler(request: Request) -> MockResponse:
            status = state.status(name)
            seen.append((name, status.backlog, status.in_flight))
            response: MockResponse = answer(request)
            return response

        return handler

    return watching


async def test_a_prompt_is_in_its_endpoint_s_backlog_until_its_first_answer() -> None:
    """The decode attempt's prompt counts at the decoder until its rejection, the
    prefill's at the prefiller until its answer; the decode leg that brings its KV
    through the connector counts none; at the end every backlog is empty."""
    state = FleetState((D0, D1, P0))
    seen: list[tuple[str, int, int]] = []
    watching = _watcher(state, seen)
    script = Script(
        {
            "d0": [
                watching("d0", _stream(_completion_chunk([], "cache_threshold", first=True))),
                watching("d0", _stream(_completion_chunk([5, 6], "length", first=True))),
            ],
            "p0": [watching("p0", _whole(PREFILL))],
        }
    )
    run = await _serve(script, STREAM, state=state)
    assert run.flow.decision == "pd"
    tokens = run.legs.prompt_tokens
    assert tokens > 0
    assert seen == [("d0", tokens, 1), ("p0", tokens, 1), ("d0", 0, 1)]
    assert [state.status(n).backlog for n in ("d0", "d1", "p0")] == [0, 0, 0]
    assert [state.status(n).in_flight for n in ("d0", "d1", "p0")] == [0, 0, 0]


async def test_a_prompt_s_blocks_are_pending_at_its_endpoint_until_its_first_answer() -> None:
    """The plan's block keys are held pending with the backlog: at the decoder until
    the attempt's rejection, at the prefiller until its answer, none for the decode
    leg that brings the KV; none are left at the end."""
    keys = (11, 12, 13)
    state = FleetState((D0, D1, P0))
    seen: list[tuple[str, int, int]] = []

    def watching(name: str, answer: Any) -> Any:
        def handler(request: Request) -> MockResponse:
            pending = state.pending
            seen.append((name, pending.leading(keys, "d0"), pending.leading(keys, "p0")))
            response: MockResponse = answer(request)
            return response

        return handler

    script = Script(
        {
            "d0": [
                watching("d0", _stream(_completion_chunk([], "cache_threshold", first=True))),
                watching("d0", _stream(_completion_chunk([5, 6], "length", first=True))),
            ],
            "p0": [watching("p0", _whole(PREFILL))],
        }
    )
    run = await _serve(script, STREAM, state=state, blocks=keys)
    assert run.flow.decision == "pd"
    assert seen == [("d0", 3, 0), ("p0", 0, 3), ("d0", 0, 0)]
    assert [state.pending.keys(n) for n in ("d0", "d1", "p0")] == [0, 0, 0]


async def test_a_failed_leg_gives_its_backlog_and_its_pending_blocks_back() -> None:
    state = FleetState((D0, D1, P0))
    script = Script(
        {"d0": [lambda request: MockResponse(503, json={"error": "busy"})],
         "d1": [_stream(_completion_chunk([5, 6], "length", first=True))]}
    )  # fmt: skip
    run = await _serve(script, STREAM, state=state, blocks=(1, 2))
    assert run.flow.decoder == D1
    assert [state.status(n).backlog for n in ("d0", "d1", "p0")] == [0, 0, 0]
    assert [state.pending.keys(n) for n in ("d0", "d1", "p0")] == [0, 0, 0]


async def test_a_whole_answer_of_many_tokens_holds_no_backlog() -> None:
    """A client that wants a whole answer gets a whole decode attempt: its answer
    comes after the last token, so it is not counted (the reading covers it); the
    prefill's one-token answer is."""
    state = FleetState((D0, D1, P0))
    seen: list[tuple[str, int, int]] = []
    watching = _watcher(state, seen)
    rejected = {
        "id": "a",
        "object": "text_completion",
        "model": "m",
        "choices": [{"index": 0, "text": "", "finish_reason": "cache_threshold"}],
    }
    served = {"id": "d", "object": "text_completion", "model": "m",
              "choices": [{"index": 0, "text": " t5", "token_ids": [5],
                           "finish_reason": "length"}]}  # fmt: skip
    script = Script(
        {
            "d0": [watching("d0", _whole(rejected)), watching("d0", _whole(served))],
            "p0": [watching("p0", _whole(PREFILL))],
        }
    )
    whole = {"model": "m", "prompt": "hello", "max_tokens": 4}
    run = await _serve(script, whole, state=state)
    assert run.flow.decision == "pd"
    assert seen == [("d0", 0, 1), ("p0", run.legs.prompt_tokens, 1), ("d0", 0, 1)]
    assert [state.status(n).backlog for n in ("d0", "d1", "p0")] == [0, 0, 0]
