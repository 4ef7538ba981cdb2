"""What the gateway takes from an upstream answer, against real simulators on
loopback that break the protocol (``--protocol-fault``): a choice numbered outside
the request's choices, and one event longer than ``upstream.max_line_bytes``. Each
is the endpoint's protocol error: the client gets one clean error and nothing of the
bad answer, and the endpoint's leg is counted as a protocol failure."""

from __future__ import annotations

from collections.abc import Callable

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
def faulty(module_sims: SimFactory, module_gateways: GatewayFactory) -> Callable[[str], Child]:
    """A gateway over a decoder with the given fault (started once per fault)."""
    started: dict[str, Child] = {}

    def get(fault: str) -> Child:
        if fault not in started:
            started[fault] = _gateway(module_sims, module_gateways, fault)
        return started[fault]

    return get


@pytest.mark.parametrize("fault", ["choice-index", "long-line"])
@STREAM
async def test_an_answer_past_the_protocol_is_the_endpoints_error(
    faulty: Callable[[str], Child], fault: str, stream: bool
) -> None:
    """``choice-index``: an n=1 answer whose choice is numbered 7. ``long-line``: an
    answer whose last chunk carries 17 MiB, past the default 16 MiB limit. Old: both
    relayed as they came (a 64 MiB line cost the gateway 135 MiB)."""
    assert LONG_LINE > 16 << 20
    gateway = faulty(fault)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": stream}
    answer = await call(gateway.url, "completion", body)
    assert "failed" in _failed_cleanly(answer)
    for chunk in [*answer.chunks, answer.body or {}]:
        for choice in chunk.get("choices") or []:
            assert choice.get("index") != 7 and "padding" not in choice
    assert await _protocol_faults(gateway) >= 1
