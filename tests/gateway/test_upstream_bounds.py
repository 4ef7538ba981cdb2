"""What the gateway takes from an upstream answer, against real simulators on
loopback that break the protocol (``--protocol-fault``): a choice numbered outside
the request's choices, and one event longer than ``upstream.max_line_bytes``. Each
is the endpoint's protocol error: the client gets one clean error and nothing of the
bad answer, and the endpoint's leg is counted as a protocol failure."""

from __future__ import annotations

import pytest

from pd_orchestrator.children import Child
from pd_orchestrator.sim.faults import LONG_LINE

from ..conftest import GatewayFactory, SimFactory, gateway_config
from .helpers import MODEL, Answer, call, metric, metrics_text

pytestmark = pytest.mark.anyio
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])


def _gateway(sims: SimFactory, gateways: GatewayFactory, fault: str) -> Child:
    decoder = sims("--profile", "instant", "--protocol-fault", fault)
    return gateways(gateway_config([decoder], [decoder]))


def _failed_cleanly(answer: Answer) -> str:
    """The error message of an answer that is one clean error (a status, or a 200
    stream whose one error event follows what came before)."""
    assert answer.body is not None and "error" in answer.body, answer
    if answer.status != 200:
        assert answer.status == 502, answer
    return str(answer.body["error"]["message"])


async def _protocol_faults(gateway: Child) -> float:
    text = await metrics_text(gateway.url)
    return metric(text, "pd_orchestrator_upstream_requests_total", outcome="protocol")


@pytest.fixture(scope="module")
def numbered_seven(module_sims: SimFactory, module_gateways: GatewayFactory) -> Child:
    return _gateway(module_sims, module_gateways, "choice-index")


@STREAM
async def test_a_choice_index_the_request_did_not_ask_for_is_a_protocol_error(
    numbered_seven: Child, stream: bool
) -> None:
    """Old: an n=1 answer with ``index: 7`` was relayed as it came."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": stream}
    answer = await call(numbered_seven.url, "completion", body)
    assert "failed" in _failed_cleanly(answer)
    for chunk in [*answer.chunks, answer.body or {}]:
        assert all(c.get("index") != 7 for c in chunk.get("choices") or [])
    assert await _protocol_faults(numbered_seven) >= 1


@pytest.fixture(scope="module")
def long_lines(module_sims: SimFactory, module_gateways: GatewayFactory) -> Child:
    return _gateway(module_sims, module_gateways, "long-line")


@STREAM
async def test_an_event_longer_than_the_limit_is_a_protocol_error(
    long_lines: Child, stream: bool
) -> None:
    """An answer whose last chunk carries 17 MiB, past the default 16 MiB limit. Old:
    relayed whole (a 64 MiB line cost the gateway 135 MiB)."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": stream}
    answer = await call(long_lines.url, "completion", body)
    assert "failed" in _failed_cleanly(answer)
    assert all("padding" not in c for chunk in answer.chunks for c in chunk.get("choices") or [])
    assert LONG_LINE > 16 << 20
    assert await _protocol_faults(long_lines) >= 1
