"""Configuration: every shipped file loads; strictness; environment overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pd_orchestrator.config import ConfigError, load_config, parse_config

CONFIGS = sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml"))
BASE: dict[str, Any] = {
    "decoders": [{"name": "d0", "url": "http://127.0.0.1:9001"}],
    "prefillers": [{"name": "p0", "url": "http://127.0.0.1:9002"}],
}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path: Path) -> None:
    config = load_config(path)
    assert config.decoders


def test_configs_directory_is_not_empty() -> None:
    assert any(p.name == "local.yaml" for p in CONFIGS)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (BASE | {"bogus": 1}, "bogus: unknown key"),
        (BASE | {"decoders": [{"name": "d0", "urll": "x"}]}, "decoders.0.urll: unknown key"),
        (
            BASE | {"threshold": {"policy": {"type": "static", "value": 1.5}}},
            "threshold.policy.value",
        ),
        (BASE | {"connector": "carrier-pigeon"}, "connector"),
        (BASE | {"decoders": []}, "decoders"),
        (BASE | {"decoders": [{"name": "d0"}]}, "needs a url"),
        (BASE | {"decoders": [{"name": "d0", "url": "ftp://x"}]}, "http(s) URL"),
        (BASE | {"prefillers": [{"name": "d0", "url": "http://h:1"}]}, "unique: d0"),
        (BASE | {"sidecar": {"allowed_prefillers": ["nohost"]}}, "host:port"),
        ({"decoders": BASE["decoders"]}, "at least one prefiller"),
        (BASE | {"decoders": [{"name": "d", "sim": {"profile": "tpu"}}]}, "unknown profile"),
    ],
    ids=[
        "unknown-top-key",
        "unknown-nested-key",
        "threshold-range",
        "connector",
        "no-decoders",
        "no-url",
        "bad-url",
        "duplicate-name",
        "allow-list",
        "no-prefiller",
        "sim-profile",
    ],
)
def test_invalid_configs_name_the_problem(data: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_config(data)
    assert fragment in str(error.value)


def test_environment_overrides_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDO_THRESHOLD__POLICY__VALUE", "0.25")
    monkeypatch.setenv("PDO_LISTEN__PORT", "9999")
    config = parse_config(BASE | {"threshold": {"honour_client": False}})
    assert config.threshold.policy.value == 0.25
    assert config.threshold.honour_client is False
    assert config.listen.port == 9999


def test_unreadable_and_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("decoders: [")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
