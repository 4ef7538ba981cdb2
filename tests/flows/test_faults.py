"""Faults against a scripted transport: retries before the first byte, recoveries after
it, the prefill side's retries and fallback, and what the fleet learns from them."""

from __future__ import annotations

import gc
from typing import Any

import anyio
import orjson
import pytest

from connectors import get_connector
from pd_orchestrator.config.settings import (
    HandbackConfig,
    OutlierConfig,
    TimeoutConfig,
    UpstreamConfig,
)
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.flows import Flow, FlowSettings, GatewayError, Legs, Single, renderer_for
from pd_orchestrator.flows.flow import leg_budget
from pd_orchestrator.flows.legs import MAX_HELD
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.telemetry.metrics import GatewayMetrics
from pd_orchestrator.upstream.client import Upstream
from pd_orchestrator.upstream.errors import UpstreamStatusError, UpstreamUnavailable
from pd_orchestrator.upstream.mock import MockResponse, MockTransport
from pd_orchestrator.upstream.transport import ConnectionBroken, Request

from .test_flow import (
    D1,
    FLEET,
    P0,
    PROMPT_IDS,
    STREAM,
    Script,
    Sink,
    _completion_chunk,
    _pieces,
    _plan,
    _request,
    _serve,
    _stream,
    _text,
    _usage,
    _whole,
)

pytestmark = pytest.mark.anyio

P1 = Endpoint("p1", "http://p1", Role.PREFILL)
WHOLE = {"model": "m", "prompt": "hello", "max_tokens": 4}
PARAMS = {"remote_block_ids": [9], "remote_engine_id": "p", "remote_host": "h"}


def _answer(ids: list[int], finish: str = "length") -> dict[str, Any]:
    choice = {"index": 0, "text": "".join(f" t{i}" for i in ids), "token_ids": ids,
              "prompt_token_ids": PROMPT_IDS, "finish_reason": finish}  # fmt: skip
    usage = {"prompt_tokens": 4, "completion_tokens": len(ids)}
    return {"id": "up", "object": "text_completion", "created": 7, "model": "m",
            "choices": [choice], "usage": usage}  # fmt: skip


def _prefilled(request: Request) -> MockResponse:
    params = PARAMS | {"remote_host": request.origin.host}  # the prefiller's own host
    prefill = {"id": "p", "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
               "kv_transfer_params": params}  # fmt: skip
    return MockResponse(200, json=prefill)


def _status(status: int) -> Any:
    return lambda request: MockResponse(status, json={"error": {"message": "boom", "code": status}})


def _cut_whole(request: Request) -> MockResponse:
    """A whole answer whose connection breaks half-way through its body."""
    return MockResponse(200, chunks=_pieces([b'{"id": "up", "cho'], ConnectionBroken("reset")))


def _rejected(request: Request) -> MockResponse:
    return _stream(_completion_chunk([], "cache_threshold", first=True))(request)


def _metric(metrics: GatewayMetrics, kind: str) -> float:
    value = metrics.registry.get_sample_value(
        "pd_orchestrator_upstream_errors_total", {"upstream": "d0", "kind": kind}
    )
    return value or 0.0


async def test_a_whole_answer_cut_before_its_end_is_served_by_the_next_decoder() -> None:
    script = Script({"d0": [_cut_whole], "d1": [_whole(_answer([5, 6, 7, 8]))]})
    metrics = GatewayMetrics()
    run = await _serve(script, WHOLE | {"return_token_ids": True}, metrics=metrics)
    answer = orjson.loads(run.sink.data)
    assert run.sink.status == 200 and answer["choices"][0]["token_ids"] == [5, 6, 7, 8]
    assert run.flow.decoder == D1
    assert _metric(metrics, "retried") == 1
    assert run.fleet.outlier_of("d0").consecutive_failures == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("status", [500, 503])
async def test_a_decoder_answering_5xx_is_replaced_before_the_first_byte(status: int) -> None:
    script = Script(
        {"d0": [_status(status)], "d1": [_stream(_completion_chunk([5, 6], "length", first=True))]}
    )
    run = await _serve(script, STREAM)
    assert _text(run)[0] == " t5 t6" and run.flow.decoder == D1
    assert run.fleet.outlier_of("d0").consecutive_5xx == 1  # type: ignore[union-attr]


async def test_a_stream_that_breaks_before_its_first_decisive_chunk_is_replaced() -> None:
    role_only = {"id": "up", "object": "text_completion", "created": 7, "model": "m",
                 "choices": [{"index": 0, "text": "", "finish_reason": None}]}  # fmt: skip
    script = Script(
        {
            "d0": [_stream(role_only, done=False, error=ConnectionBroken("reset"))],
            "d1": [_stream(_completion_chunk([5, 6], "length", first=True))],
        }
    )
    run = await _serve(script, STREAM)
    assert _text(run)[0] == " t5 t6" and run.sink.headers["x-pd-decoder"] == "d1"
    assert [host for host, _ in script.seen] == ["d0", "d1"]


async def test_decode_attempts_bound_the_decoders_tried() -> None:
    script = Script({"d0": [_status(500)], "d1": [_whole(_answer([5]))]})
    with pytest.raises(UpstreamStatusError):
        await _serve(script, WHOLE, upstream=UpstreamConfig(decode_attempts=1))
    assert [host for host, _ in script.seen] == ["d0"]


async def test_a_4xx_is_the_answer_and_no_other_decoder_is_asked() -> None:
    script = Script({"d0": [_status(400)], "d1": [_whole(_answer([5]))]})
    with pytest.raises(UpstreamStatusError) as raised:
        await _serve(script, WHOLE)
    assert raised.value.status == 400 and [host for host, _ in script.seen] == ["d0"]


async def test_the_last_decoder_failing_is_the_answer() -> None:
    with pytest.raises(UpstreamUnavailable):
        await _serve(Script({}), WHOLE)  # both refuse


async def test_a_decode_leg_failing_after_a_prefill_starts_over_elsewhere() -> None:
    script = Script(
        {
            "d0": [_rejected, _status(500)],  # the KV pull failed (an expired lease)
            "d1": [_rejected, _stream(_completion_chunk([5, 6], "length", first=True))],
            "p0": [_prefilled],
            "p1": [_prefilled],
        }
    )
    fleet = FleetState((*FLEET, P1))
    run = await _serve(script, STREAM, plan=_plan(prefillers=(P0, P1)), fleet=fleet)
    assert _text(run)[0] == " t5 t6"
    assert run.sink.headers["x-pd-decoder"] == "d1"
    assert run.sink.headers["x-pd-prefiller"] == "p1"  # the first one's KV may be what failed
    assert [host for host, _ in script.seen] == ["d0", "p0", "d0", "d1", "p1", "d1"]


async def test_prefill_retries_skip_ejected_prefillers_and_those_seen_failing() -> None:
    outlier = OutlierConfig(consecutive_5xx=1, max_ejection_percent=100)
    fleet = FleetState((*FLEET, P1, Endpoint("p2", "http://p2", Role.PREFILL)), outlier=outlier)
    fleet.record_error("p0", UpstreamStatusError("p0", "prefill", 500, "x"))  # ejected
    assert not fleet.is_healthy("p0")
    script = Script(
        {
            "d0": [_rejected, _stream(_completion_chunk([5], "length", first=True))],
            "p1": [_status(500)],
            "p2": [_prefilled],
        }
    )
    plan = _plan(prefillers=(P0, P1, Endpoint("p2", "http://p2", Role.PREFILL)))
    run = await _serve(
        script, STREAM, plan=plan, fleet=fleet, upstream=UpstreamConfig(retry_backoff=0.0)
    )
    assert _text(run)[0] == " t5" and run.flow.prefiller is not None
    assert [host for host, _ in script.seen] == ["d0", "p1", "p2", "d0"]


async def test_a_prefill_side_that_keeps_failing_falls_back_to_the_decoder() -> None:
    script = Script(
        {"d0": [_rejected, _stream(_completion_chunk([5, 6], "length", first=True))]}
    )  # p0 refuses every connection
    run = await _serve(script, STREAM)
    assert _text(run)[0] == " t5 t6"
    assert run.flow.decision == "decode" and run.flow.prefiller is None
    local = script.bodies("d0")[1]
    assert local["cache_hit_threshold"] == 0.0 and "kv_transfer_params" not in local


async def test_without_the_fallback_a_failing_prefill_side_is_the_answer() -> None:
    script = Script({"d0": [_rejected]})
    upstream = UpstreamConfig(prefill_attempts=2, retry_backoff=0.0, prefill_fallback="error")
    with pytest.raises(UpstreamUnavailable) as raised:
        await _serve(script, STREAM, upstream=upstream)
    assert raised.value.endpoint == "p0"
    assert [host for host, _ in script.seen] == ["d0", "p0", "p0"]  # no other decoder


async def test_a_continuation_that_cannot_start_is_recovered_on_another_decoder() -> None:
    handed_back = _completion_chunk([6], "cache_threshold")
    script = Script(
        {
            "d0": [
                _stream(_completion_chunk([5], first=True), handed_back, _usage(4, 2)),
                _status(500),  # the continuation's decode leg
            ],
            "d1": [_stream(_completion_chunk([7, 8], "length"))],
            "p0": [_prefilled, _prefilled],
        }
    )
    run = await _serve(script, STREAM)
    assert _text(run)[0] == " t5 t6 t7 t8"
    assert run.flow.decoder == D1 and run.flow.recoveries == 1
    assert script.bodies("d1")[0]["prompt"] == [*PROMPT_IDS, 5, 6]


async def test_a_5xx_error_event_mid_stream_is_recovered() -> None:
    error = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
    script = Script(
        {
            "d0": [_stream(_completion_chunk([5], first=True), error, done=False)],
            "d1": [_stream(_completion_chunk([6, 7, 8], "length"))],
            "p0": [_prefilled],
        }
    )
    run = await _serve(script, STREAM)
    assert _text(run)[0] == " t5 t6 t7 t8"
    assert run.fleet.outlier_of("d0").consecutive_5xx == 1  # type: ignore[union-attr]


async def test_recoveries_are_bounded() -> None:
    broken = _stream(_completion_chunk([5], first=True), done=False, error=ConnectionBroken("x"))
    script = Script({"d0": [broken], "d1": [_status(500)], "p0": [_prefilled]})
    with pytest.raises(UpstreamStatusError):
        await _serve(script, STREAM, handback=HandbackConfig(max_recoveries=1))
    assert [host for host, _ in script.seen] == ["d0", "p0", "d1"]


async def test_a_continuation_failing_on_every_decoder_is_the_answer() -> None:
    handed_back = _completion_chunk([6], "cache_threshold")
    script = Script(
        {
            "d0": [_stream(_completion_chunk([5], first=True), handed_back), _status(502)],
            "d1": [_status(502)],
            "p0": [_prefilled, _prefilled],
        }
    )
    with pytest.raises(UpstreamStatusError) as raised:
        await _serve(script, STREAM, handback=HandbackConfig(max_recoveries=3))
    assert raised.value.endpoint == "d1"
    assert [host for host, _ in script.seen] == ["d0", "p0", "d0", "p0", "d1"]


def _broken_after_one_token(request: Request) -> MockResponse:
    chunk = _completion_chunk([5], first=True)
    return _stream(chunk, done=False, error=ConnectionBroken("reset"))(request)


async def test_a_decoder_that_breaks_every_stream_it_began_is_ejected() -> None:
    outlier = OutlierConfig(consecutive_failures=2, max_ejection_percent=50)
    fleet = FleetState(FLEET, outlier=outlier)
    for _ in range(2):  # each stream begins (its status came), then breaks
        script = Script(
            {
                "d0": [_broken_after_one_token],
                "d1": [_stream(_completion_chunk([6, 7, 8], "length"))],
                "p0": [_prefilled],
            }
        )
        run = await _serve(script, STREAM, fleet=fleet)
        assert _text(run)[0] == " t5 t6 t7 t8"
    record = fleet.outlier_of("d0")
    assert record is not None and record.ejected


async def test_more_tokens_than_the_request_allows_are_a_protocol_error() -> None:
    script = Script(
        {
            "d0": [_stream(_completion_chunk([5, 6], first=True), _completion_chunk([7, 8, 9]))],
            "d1": [_stream(_completion_chunk([7, 8], "length"))],
            "p0": [_prefilled],
        }
    )
    run = await _serve(script, STREAM)  # max_tokens 4
    assert _text(run) == (" t5 t6 t7 t8", [])
    assert script.bodies("d1")[0]["prompt"] == [*PROMPT_IDS, 5, 6]
    assert run.fleet.outlier_of("d0").consecutive_failures == 1  # type: ignore[union-attr]


async def test_a_stream_with_no_content_in_its_first_chunks_is_replaced() -> None:
    empty = {"id": "up", "object": "text_completion", "created": 7, "model": "m",
             "choices": [{"index": 0, "text": "", "finish_reason": None}]}  # fmt: skip
    script = Script(
        {
            "d0": [_stream(*[empty] * (MAX_HELD + 1))],
            "d1": [_stream(_completion_chunk([5, 6], "length", first=True))],
        }
    )
    run = await _serve(script, STREAM)
    assert _text(run)[0] == " t5 t6"
    assert [host for host, _ in script.seen] == ["d0", "d1"]  # not taken for a rejection


async def test_a_request_that_sent_its_budget_is_answered_502_without_another_leg() -> None:
    script = Script({"d0": [_stream(_completion_chunk([5, 6], "length", first=True))]})
    metrics = GatewayMetrics()
    legs = Legs(
        Upstream(UpstreamConfig(), TimeoutConfig(), MockTransport(script)),
        FleetState(FLEET), metrics, "rid", anyio.current_time,
    )  # fmt: skip
    settings = FlowSettings(
        HandbackConfig(), UpstreamConfig(), {"nixl": get_connector("nixl")}, metrics,
        anyio.current_time,
    )  # fmt: skip
    request = _request("completion", STREAM)
    flow = Flow(request, _plan(), legs, Single(), settings)
    assert flow.budget == leg_budget(UpstreamConfig(), HandbackConfig(), len(flow.plan.asked))
    legs.sent = flow.budget  # a request whose bounds let it send this many already
    with pytest.raises(GatewayError) as raised:
        await flow.run(renderer_for(request, flow.transcript, Sink(), anyio.current_time))
    assert raised.value.status == 502 and script.seen == []


def _broken_mid_stream() -> Script:
    broken = _stream(_completion_chunk([5], first=True), done=False, error=ConnectionBroken("x"))
    return Script(
        {
            "d0": [broken],
            "d1": [_stream(_completion_chunk([6, 7, 8], "length"))],
            "p0": [_prefilled],
        }
    )


def _error_event_mid_stream() -> Script:
    error = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}
    return Script(
        {
            "d0": [_stream(_completion_chunk([5], first=True), error, done=False)],
            "d1": [_stream(_completion_chunk([6, 7, 8], "length"))],
            "p0": [_prefilled],
        }
    )


def _cut_then_whole() -> Script:
    return Script({"d0": [_cut_whole], "d1": [_whole(_answer([5, 6, 7, 8]))]})


@pytest.mark.parametrize(
    ("script", "body"),
    [(_broken_mid_stream, STREAM), (_error_event_mid_stream, STREAM), (_cut_then_whole, WHOLE)],
    ids=["broken-stream", "error-event", "cut-whole"],
)
async def test_a_recovered_request_leaves_no_reference_cycle(script: Any, body: Any) -> None:
    """A request whose leg failed and was recovered is freed by reference counting
    when it ends: a failed leg keeps its error for its accounting, and the error's
    traceback holds the leg's own frame, so the leg, the flow and the request would
    otherwise wait for a full collection, which the gateway's collector thresholds
    make rare (the soak's memory grew so, +5.9% in 40 minutes)."""
    gc.collect()
    before = {id(o) for o in gc.get_objects()}
    gc.disable()  # what is left must be freed by reference counting alone
    try:
        for _ in range(5):
            run = await _serve(script(), body)
            assert run.flow.recoveries + (run.flow.decoder == D1) >= 1
            del run
        left = [
            type(o).__name__
            for o in gc.get_objects()
            if isinstance(o, Flow | Legs | BaseException) and id(o) not in before
        ]
    finally:
        gc.enable()
    assert left == []
