"""Hosts a request or an upstream names: the sidecar's headers (zones, ports, no
header at all) and the addresses a prefiller's transfer params name."""

from __future__ import annotations

import pytest

from pd_orchestrator.config.allowlist import parse_entries, split_host_port
from pd_orchestrator.telemetry.metrics import GatewayMetrics

from ..conftest import GatewayFactory, SimFactory, gateway_config
from .helpers import MODEL, call, metric, metrics_text

pytestmark = pytest.mark.anyio
NIXL = ("--profile", "instant", "--kv-connector", "nixl")
HEADER = "x-prefiller-host-port"
PROMPT = "a prompt that is long enough to span several blocks of the cache. " * 3


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def _prompts_seen(url: str) -> float:
    return metric(await metrics_text(url), "vllm:prompt_tokens_total")


@pytest.mark.parametrize(
    "value", ["[::1%@127.0.0.1:{port}]:8000", "[::1%#]:80", "[::1%25lo]:{port}"]
)
async def test_an_ipv6_zone_in_the_prefiller_header_is_a_400_and_nothing_is_contacted(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, value: str
) -> None:
    decoder, target = sim_factory(*NIXL), sim_factory(*NIXL)
    config = gateway_config([decoder], [])
    config["sidecar"] = {"enabled": True, "allowed_prefillers": ["::1/128", "127.0.0.0/8"]}
    gateway = gateway_factory(config)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    header = value.format(port=_port(target.url))
    answer = await call(gateway.url, "completion", body, {HEADER: header})
    assert answer.status == 400, answer.body
    assert answer.body is not None and answer.body["error"]["param"] is None
    assert HEADER in answer.body["error"]["message"]
    assert await _prompts_seen(target.url) == 0
    assert await _prompts_seen(decoder.url) == 0


async def test_a_sidecar_request_without_a_prefiller_header_is_served_by_its_decoder(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    decoder = sim_factory(*NIXL)
    config = gateway_config([decoder], [])
    config["sidecar"] = {"enabled": True, "allowed_prefillers": ["127.0.0.1"]}
    gateway = gateway_factory(config)
    for stream in (False, True):
        for extra in ({}, {"cache_hit_threshold": 1.0}):
            cold = f"{stream} {extra} an entirely cold prompt, never seen before. " * 4
            body = {"model": MODEL, "prompt": cold, "max_tokens": 4, "stream": stream} | extra
            answer = await call(gateway.url, "completion", body)
            assert answer.status == 200, answer.body
            assert answer.decision == "decode"
            assert "x-pd-prefiller" not in answer.headers
    empty = await call(gateway.url, "completion", {"model": MODEL, "prompt": PROMPT}, {HEADER: ","})
    assert empty.status == 200 and empty.decision == "decode"
    text = await metrics_text(gateway.url)
    assert metric(text, "pd_orchestrator_threshold_decisions_total", reason="no-prefiller") == 5


async def test_a_named_allow_list_entry_with_a_port_allows_that_port_only(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    decoder, allowed, other = sim_factory(*NIXL), sim_factory(*NIXL), sim_factory(*NIXL)
    config = gateway_config([decoder], [])
    entry = f"localhost:{_port(allowed.url)}"
    config["sidecar"] = {"enabled": True, "allowed_prefillers": [entry]}
    gateway = gateway_factory(config)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    refused = await call(gateway.url, "completion", body, {HEADER: f"127.0.0.1:{_port(other.url)}"})
    assert refused.status == 403, refused.body
    assert await _prompts_seen(other.url) == 0
    served = await call(
        gateway.url, "completion", body, {HEADER: f"127.0.0.1:{_port(allowed.url)}"}
    )
    assert served.status == 200 and served.decision == "pd"


def test_resolved_names_keep_their_entry_s_port() -> None:
    allow = parse_entries(["localhost:19102", "pool.local"]).with_addresses(
        {"localhost": ["127.0.0.1", "::1"], "pool.local": ["10.0.0.7"]}
    )
    assert allow.allows("127.0.0.1", 19102) and allow.allows("::1", 19102)
    assert not allow.allows("127.0.0.1", 8000)
    assert allow.allows("10.0.0.7", 8000)  # a name without a port: any port, as llm-d's


@pytest.mark.parametrize(
    "value",
    ["[::1%eth0]:80", "[::1]x:80", "host_name:80", "a b:80", "h:", "[::1]:", "ho\u0301st:1"],
)
def test_split_host_port_refuses_what_is_no_host(value: str) -> None:
    with pytest.raises(ValueError):
        split_host_port(value)


async def test_transfer_params_naming_another_host_never_reach_the_decoder(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    decoder = sim_factory(*NIXL)
    liar = sim_factory(*NIXL, "--side-channel-host", "127.0.0.2")  # not the prefiller's host
    config = gateway_config([decoder], [liar])
    config["upstream"] = {"prefill_attempts": 1, "prefill_fallback": "error"}
    gateway = gateway_factory(config)
    for stream in (False, True):
        body = {"model": MODEL, "prompt": f"{stream} {PROMPT}", "max_tokens": 4, "stream": stream}
        answer = await call(gateway.url, "completion", body)
        assert answer.status == 502, answer.body
        assert answer.body is not None
        assert "127.0.0.2" not in answer.body["error"]["message"]
    text = await metrics_text(gateway.url)
    errors = metric(
        text, "pd_orchestrator_upstream_errors_total", upstream="prefill-0",
        kind="UpstreamProtocolError",
    )  # fmt: skip
    assert errors == 2
    assert "pd_orchestrator_kv_transfers_total{" not in text  # no decode leg got those params


async def test_sidecar_targets_are_bounded_in_metrics_and_state(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    decoder = sim_factory(*NIXL)
    config = gateway_config([decoder], [])
    config["sidecar"] = {
        "enabled": True,
        "allowed_prefillers": ["127.0.0.1"],
        "max_named_targets": 3,
    }
    config["upstream"] = {"prefill_attempts": 1, "prefill_fallback": "error"}
    gateway = gateway_factory(config)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    for port in range(1, 9):  # eight closed ports of an allowed host
        answer = await call(gateway.url, "completion", body, {HEADER: f"127.0.0.1:{port}"})
        assert answer.status == 502
    text = await metrics_text(gateway.url)
    labels = {
        line.split('upstream="', 1)[1].split('"', 1)[0]
        for line in text.splitlines()
        if line.startswith("pd_orchestrator_upstream_requests_total{")
    }
    assert labels == {"decode-0", "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", "other"}


def test_metric_labels_of_unconfigured_upstreams_are_capped() -> None:
    metrics = GatewayMetrics()
    metrics.label_upstreams({"decode-0"}, 2)
    for name in ("decode-0", "a:1", "b:1", "c:1", "d:1", "a:1"):
        metrics.count_leg(name, "prefill", "ok", 0.1)
        metrics.count_upstream_error(name, "UpstreamTimeout")
    text = metrics.registry.get_sample_value
    assert text("pd_orchestrator_upstream_requests_total", {
        "upstream": "other", "phase": "prefill", "outcome": "ok"}) == 2  # fmt: skip
    assert text("pd_orchestrator_upstream_requests_total", {
        "upstream": "a:1", "phase": "prefill", "outcome": "ok"}) == 2  # fmt: skip
    assert text("pd_orchestrator_upstream_errors_total", {
        "upstream": "other", "kind": "UpstreamTimeout"}) == 2  # fmt: skip
