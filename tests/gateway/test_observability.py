"""Logs, metrics and traces of a running gateway (simulators and gateways as processes,
and a gateway served in this process to read its spans)."""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pd_orchestrator.children import Child, python_command, start_child, stop_child
from pd_orchestrator.config import parse_config
from pd_orchestrator.gateway import Gateway
from pd_orchestrator.sim.server import bind_socket
from pd_orchestrator.telemetry.tracing import Tracing

from ..conftest import GatewayFactory, SimFactory, gateway_config
from .helpers import MODEL, call, metric, metrics_text

pytestmark = pytest.mark.anyio
INSTANT = ("--profile", "instant", "--kv-connector", "nixl")


def _cold(max_tokens: int = 4) -> dict[str, Any]:
    prompt = f"{uuid.uuid4().hex} " + "a prompt long enough for a few blocks. " * 4
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}


def _json_lines(child: Child) -> list[dict[str, Any]]:
    lines = child.log_path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


async def _logged(child: Child, predicate: Any, count: int = 1) -> list[dict[str, Any]]:
    """The JSON log records of ``child`` that match, once ``count`` of them are there."""
    with anyio.fail_after(10):
        while True:
            found = [r for r in _json_lines(child) if predicate(r)]
            if len(found) >= count:
                return found
            await anyio.sleep(0.05)


async def test_access_log_and_upstream_failures_carry_the_request_id(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    failing = sim_factory(*INSTANT, "--failure-rate", "1.0", name="failing")
    prefiller = sim_factory(*INSTANT, name="prefill")
    config = gateway_config([failing], [prefiller], logging={"format": "json", "access_log": True})
    gateway = gateway_factory(config)
    served = await call(gateway.url, "completion", _cold(), {"x-request-id": "req-ok-1"})
    assert served.status == 502
    access = await _logged(gateway, lambda r: r["logger"] == "pd_orchestrator.access")
    assert access[0]["request_id"] == "req-ok-1"
    assert access[0]["status"] == 502 and access[0]["decision"] == "error"
    assert access[0]["route"] == "/v1/completions" and access[0]["method"] == "POST"
    assert access[0]["decoder"] == "decode-0" and access[0]["duration"] >= 0
    upstream = [r for r in _json_lines(gateway) if r["logger"] == "pd_orchestrator.upstream"]
    assert len(upstream) == 1, upstream  # logged once, where the leg failed
    assert upstream[0]["request_id"] == "req-ok-1" and upstream[0]["level"] == "WARNING"
    assert upstream[0]["message"] == (
        "upstream decode-0 failed during decode_attempt (UpstreamStatusError): "
        "HTTP 500: injected failure (--failure-rate)"
    )


async def test_flags_override_the_config_and_the_access_log_stays_off_by_default(
    sim_factory: SimFactory, tmp_path: Path
) -> None:
    decoder = sim_factory(*INSTANT, name="decode")
    prefiller = sim_factory(*INSTANT, name="prefill")
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(gateway_config([decoder], [prefiller])))
    argv = python_command(
        "serve", "--config", str(path), "--port", "0", "--log-format", "json",
        "--log-level", "debug",
    )  # fmt: skip
    gateway = start_child("gateway", argv, timeout=60)
    try:
        answer = await call(gateway.url, "completion", _cold(), {"x-request-id": "quiet-1"})
        assert answer.status == 200
        [started] = await _logged(gateway, lambda r: "serving on" in r["message"])
        assert started["level"] == "INFO" and started["logger"] == "pd_orchestrator.gateway"
        assert not [r for r in _json_lines(gateway) if r["logger"] == "pd_orchestrator.access"]
    finally:
        stop_child(gateway)


async def test_sim_logs_as_told() -> None:
    sim = start_child("sim", python_command("sim", "--port", "0", *INSTANT, "--log-format", "json"))
    try:
        [line] = await _logged(sim, lambda r: r["logger"] == "pd_orchestrator.sim")
        assert line["message"].startswith(f"simulated instance on {sim.url}")
    finally:
        stop_child(sim)


async def test_metrics_per_upstream_hand_overs_and_process(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    decoder = sim_factory(*INSTANT, name="decode")
    prefiller = sim_factory(*INSTANT, name="prefill")
    gateway = gateway_factory(gateway_config([decoder], [prefiller]))
    assert (await call(gateway.url, "completion", _cold())).decision == "pd"
    text = await metrics_text(gateway.url)
    assert metric(text, "pd_orchestrator_requests_total", route="/v1/completions") == 1
    counted = "pd_orchestrator_upstream_requests_total"
    assert metric(text, counted, upstream="prefill-0", phase="prefill", outcome="ok") == 1
    assert metric(text, counted, upstream="decode-0", phase="decode", outcome="ok") == 1
    seconds = "pd_orchestrator_upstream_seconds_count"
    assert metric(text, seconds, upstream="decode-0", phase="decode_attempt") == 1
    assert metric(text, "pd_orchestrator_kv_transfers_total", connector="nixl") == 1
    assert metric(text, "process_cpu_seconds_total") > 0
    assert metric(text, "process_resident_memory_bytes") > 0
    assert "_created" not in text
    assert 'endpoint="' not in text  # the Prometheus Operator's label stays free


# -- traces ------------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def _serving(gateway: Gateway) -> AsyncIterator[str]:
    """``gateway`` served by uvicorn on a loopback port of this process."""
    sock = bind_socket("127.0.0.1", 0)
    config = uvicorn.Config(gateway.app(), log_level="warning", log_config=None, lifespan="on")
    server = uvicorn.Server(config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        with anyio.fail_after(10):
            while not server.started:  # noqa: ASYNC110 - uvicorn exposes no event
                await anyio.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True


async def test_a_request_is_traced_below_the_clients_traceparent(sim_factory: SimFactory) -> None:
    decoder = sim_factory(*INSTANT, name="decode")
    prefiller = sim_factory(*INSTANT, name="prefill")
    config = parse_config(
        gateway_config([decoder], [prefiller], threshold={"policy": {"value": 0.6}})
    )
    exporter = InMemorySpanExporter()
    tracing = Tracing("pd-orchestrator", 1.0, SimpleSpanProcessor(exporter))
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    traceparent = f"00-{trace_id}-{parent_id}-01"
    async with _serving(Gateway(config, tracing=tracing)) as url:
        body = _cold(max_tokens=6) | {"stream": True, "stream_options": {"include_usage": True}}
        answer = await call(url, "completion", body, {"traceparent": traceparent})
    assert answer.status == 200 and answer.decision == "pd"
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert {"POST /v1/completions", "decode_attempt", "prefill", "decode"} <= set(spans)
    root = spans["POST /v1/completions"]
    assert f"{root.context.trace_id:032x}" == trace_id
    assert root.parent is not None and f"{root.parent.span_id:016x}" == parent_id
    attributes = dict(root.attributes or {})
    assert attributes["http.route"] == "/v1/completions"
    assert attributes["http.response.status_code"] == 200
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["pd.decision"] == "pd"
    assert attributes["pd.decoder"] == "decode-0" and attributes["pd.prefiller"] == "prefill-0"
    assert attributes["pd.threshold"] == 0.6 and attributes["pd.threshold.policy"]
    assert attributes["pd.threshold.reason"]
    assert attributes["gen_ai.usage.output_tokens"] == 6
    assert attributes["gen_ai.usage.input_tokens"] == answer.usage["prompt_tokens"]  # type: ignore[index]
    assert attributes["pd.handbacks"] == 0
    for name in ("decode_attempt", "prefill", "decode"):
        leg = spans[name]
        assert leg.parent is not None and leg.parent.span_id == root.context.span_id
        assert f"{leg.context.trace_id:032x}" == trace_id
    assert dict(spans["decode"].attributes or {})["pd.completion_tokens"] == 6


class _Collector:
    """An OTLP/HTTP trace receiver on a loopback port (a thread of this process)."""

    def __init__(self) -> None:
        received: list[ExportTraceServiceRequest] = []
        self.received = received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["content-length"])
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(length))
                if self.path == "/v1/traces":
                    received.append(request)
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    @contextlib.contextmanager
    def running(self) -> Iterator[_Collector]:
        thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.server.shutdown()
            self.server.server_close()
            thread.join(5)

    def span_names(self) -> list[str]:
        return [
            span.name
            for request in self.received
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]

    def service_names(self) -> set[str]:
        return {
            attribute.value.string_value
            for request in self.received
            for resource in request.resource_spans
            for attribute in resource.resource.attributes
            if attribute.key == "service.name"
        }


async def test_spans_are_exported_over_otlp_when_an_endpoint_is_configured(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    decoder = sim_factory(*INSTANT, name="decode")
    prefiller = sim_factory(*INSTANT, name="prefill")
    with _Collector().running() as collector:
        tracing = {"otlp_endpoint": collector.url, "service_name": "gateway-under-test"}
        gateway = gateway_factory(gateway_config([decoder], [prefiller], tracing=tracing))
        for _ in range(2):
            assert (await call(gateway.url, "completion", _cold())).status == 200
        stop_child(gateway)  # the shutdown exports what the batch still holds
        names = collector.span_names()
    assert names.count("POST /v1/completions") == 2
    assert names.count("decode_attempt") == 2 and names.count("prefill") == 2
    assert collector.service_names() == {"gateway-under-test"}


async def test_without_tracing_nothing_is_exported_and_no_provider_exists(
    sim_factory: SimFactory,
) -> None:
    decoder = sim_factory(*INSTANT, name="decode")
    prefiller = sim_factory(*INSTANT, name="prefill")
    gateway = Gateway(parse_config(gateway_config([decoder], [prefiller])))
    assert gateway.tracing is None
    async with _serving(gateway) as url, httpx.AsyncClient(base_url=url, timeout=10) as client:
        response = await client.post("/v1/completions", json=_cold())
    assert response.status_code == 200
