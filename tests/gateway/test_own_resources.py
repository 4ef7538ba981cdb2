"""The gateway's own file descriptors, against a real gateway on loopback whose
open-file limit is lowered to 256 (set in the child before it starts): many
concurrent ``n`` = 16 streams.

* What one request holds is bounded (``limits.max_concurrent_choices``, by default
  one per 64 open files: 4 here), so twenty such streams all complete.
* With that bound lifted the gateway runs out of descriptors, and that is the
  gateway's own failure: a 503 in its words, counted in
  ``pd_orchestrator_gateway_resource_errors_total``, never against the healthy
  decoder (no ``upstream_errors_total``, no ejection, no failed leg). An
  ``accept()`` that runs out is counted there too.
"""

from __future__ import annotations

import asyncio
import errno
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from pd_orchestrator.children import Child, start_child, stop_child
from pd_orchestrator.gateway.protocol import count_accept_errors

from ..conftest import SimFactory, gateway_config
from .helpers import MODEL, Answer, call, metric, metrics_text

pytestmark = pytest.mark.anyio
FILES = 256
STREAMS = 20
N = 16
_LIMITED = (
    "import resource, runpy, sys; "
    "resource.setrlimit(resource.RLIMIT_NOFILE, ({files}, {files})); "
    "sys.argv = ['pd_orchestrator', *sys.argv[1:]]; "
    "runpy.run_module('pd_orchestrator', run_name='__main__')"
)


@pytest.fixture(scope="module")
def decoder(module_sims: SimFactory) -> Child:
    """One instance for both roles; each answer waits half a second, so the choices of
    concurrent requests hold their upstream connections at the same time."""
    return module_sims("--profile", "instant", "--response-delay", "0.5")


def _limited_gateway(path: Path, config: dict[str, Any]) -> Child:
    """``pd-orchestrator serve`` on ``config`` with at most :data:`FILES` open files."""
    path.write_text(yaml.safe_dump(config))
    argv = [sys.executable, "-c", _LIMITED.format(files=FILES)]
    argv += ["serve", "--config", str(path), "--port", "0"]
    return start_child("gateway", argv, timeout=60)


@pytest.fixture
def gateway_with(tmp_path: Path, decoder: Child) -> Iterator[Any]:
    started: list[Child] = []

    def start(limits: dict[str, Any]) -> Child:
        config = gateway_config([decoder], [decoder], limits={"max_connections": 64, **limits})
        child = _limited_gateway(tmp_path / f"gateway-{len(started)}.yaml", config)
        started.append(child)
        return child

    try:
        yield start
    finally:
        for child in started:
            stop_child(child)


async def _streams(gateway: Child) -> list[Answer]:
    body = {"model": MODEL, "prompt": "the same prompt", "max_tokens": 4, "n": N, "stream": True}
    answers: list[Answer] = []

    async def one() -> None:
        answers.append(await call(gateway.url, "completion", body))

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for _ in range(STREAMS):
                tg.start_soon(one)
    return answers


def _error(answer: Answer) -> str | None:
    """The error message of a failed answer (a status, or an SSE error event)."""
    if answer.body is not None and "error" in answer.body:
        return str(answer.body["error"]["message"])
    return None


def _indices(answer: Answer) -> set[int]:
    return {c["index"] for chunk in answer.chunks for c in chunk.get("choices") or []}


def _sample(text: str, name: str, **labels: str) -> float:
    """``metric``, 0 for a series never exported."""
    try:
        return metric(text, name, **labels)
    except AssertionError:
        return 0.0


async def test_one_request_holds_a_bounded_number_of_upstream_connections(
    gateway_with: Any,
) -> None:
    """Old: each of the 16 choices of every request opened its upstream connection at
    once; 7 of 20 streams failed with the decoder named as unavailable."""
    gateway = gateway_with({})
    answers = await _streams(gateway)
    assert [_error(a) for a in answers] == [None] * STREAMS
    assert all(a.status == 200 and a.finish_reason for a in answers)
    assert all(_indices(a) == set(range(N)) for a in answers)
    text = await metrics_text(gateway.url)
    assert _sample(text, "pd_orchestrator_gateway_resource_errors_total") == 0


async def test_running_out_of_descriptors_is_the_gateways_own_failure(gateway_with: Any) -> None:
    """Old: 503 ``decoder decode-0 is unavailable``, and ``upstream_errors_total
    {kind="UpstreamUnavailable"}`` rose on a healthy decoder."""
    gateway = gateway_with({"max_concurrent_choices": N})
    answers = await _streams(gateway)
    errors = [message for a in answers if (message := _error(a)) is not None]
    assert errors, "the limit was not reached: nothing tested"
    assert all("the gateway is out of file descriptors" in m for m in errors), set(errors)
    assert all(a.status in (200, 503) for a in answers)
    text = await metrics_text(gateway.url)
    assert _sample(text, "pd_orchestrator_gateway_resource_errors_total") >= 1
    assert _sample(text, "pd_orchestrator_upstream_errors_total") == 0
    assert _sample(text, "pd_orchestrator_ejections_total") == 0
    for outcome in ("unavailable", "gateway_resource"):
        assert _sample(text, "pd_orchestrator_upstream_requests_total", outcome=outcome) == 0
    body = {"model": MODEL, "prompt": "after", "max_tokens": 2}
    assert (await call(gateway.url, "completion", body)).status == 200  # the decoder is in


def test_an_accept_out_of_descriptors_is_counted_as_the_gateways() -> None:
    """The event loop reports an ``accept()`` that ran out of descriptors (and stops
    accepting for a moment): the gateway counts it as its own resource error; other
    errors it reports are only handled as before."""
    loop = asyncio.new_event_loop()
    counted: list[str] = []
    try:
        count_accept_errors(loop, counted.append)
        for exc in (OSError(errno.EMFILE, "Too many open files"), OSError(errno.ECONNRESET, "")):
            loop.call_exception_handler({"message": "socket.accept() failed", "exception": exc})
    finally:
        loop.close()
    assert counted == ["file_descriptors"]
