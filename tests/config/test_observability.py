"""The logging:, tracing: and auth: blocks, and upstream keys per pool."""

from __future__ import annotations

from typing import Any

import pytest

from pd_orchestrator.config import ConfigError, parse_config
from pd_orchestrator.fleet.endpoints import endpoints_from_config

POOLS: dict[str, Any] = {
    "pools": [
        {"name": "dec", "role": "decode", "api_key": "dec-key",
         "endpoints": [{"name": "d0", "url": "http://127.0.0.1:9001"}]},
        {"name": "pre", "role": "prefill",
         "endpoints": [{"name": "p0", "url": "http://127.0.0.1:9002"}]},
    ]
}  # fmt: skip


def test_defaults_log_text_at_info_without_access_log_tracing_or_keys() -> None:
    config = parse_config(POOLS)
    assert (config.logging.level, config.logging.format) == ("info", "text")
    assert not config.logging.access_log
    assert not config.tracing.enabled and config.auth.api_keys == []


@pytest.mark.parametrize(
    ("given", "used"),
    [
        ("http://collector:4318", "http://collector:4318/v1/traces"),
        ("http://collector:4318/", "http://collector:4318/v1/traces"),
        ("https://otel.example/custom/path", "https://otel.example/custom/path"),
    ],
)
def test_an_otlp_base_url_gets_the_traces_path(given: str, used: str) -> None:
    config = parse_config(POOLS | {"tracing": {"otlp_endpoint": given}})
    assert config.tracing.enabled and config.tracing.otlp_endpoint == used


@pytest.mark.parametrize(
    ("block", "fragment"),
    [
        ({"logging": {"level": "verbose"}}, "logging.level"),
        ({"logging": {"format": "xml"}}, "logging.format"),
        ({"logging": {"colour": True}}, "logging.colour: unknown key"),
        ({"tracing": {"otlp_endpoint": "collector:4318"}}, "http(s) URL"),
        ({"tracing": {"otlp_endpoint": "http://c", "sample_ratio": 2}}, "tracing.sample_ratio"),
        ({"auth": {"api_keys": [" "]}}, "cannot be empty"),
    ],
    ids=["level", "format", "unknown-key", "otlp-url", "ratio", "blank-key"],
)
def test_bad_blocks_name_the_key(block: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match="invalid") as info:
        parse_config(POOLS | block)
    assert fragment in str(info.value)


def test_keys_come_from_the_environment_and_never_print(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDO_AUTH__API_KEYS", '["k1", "k2"]')
    monkeypatch.setenv("PDO_UPSTREAM__API_KEY", "shared-upstream-key")
    config = parse_config(POOLS)
    assert [k.get_secret_value() for k in config.auth.api_keys] == ["k1", "k2"]
    by_name = {e.name: e for e in endpoints_from_config(config)}
    assert by_name["d0"].authorization == "Bearer dec-key"  # the pool's key wins
    assert by_name["p0"].authorization == "Bearer shared-upstream-key"
    printed = str(config.public_dict()) + repr(by_name) + repr(config.fleet())
    for secret in ("k1", "k2", "shared-upstream-key", "dec-key"):
        assert secret not in printed


def test_without_keys_the_endpoints_send_the_clients() -> None:
    pools = [dict(pool) for pool in POOLS["pools"]]
    pools[0].pop("api_key")
    endpoints = endpoints_from_config(parse_config({"pools": pools}))
    assert all(e.authorization is None for e in endpoints)
