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
    assert any(e.decodes for e in config.fleet())


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
        (BASE | {"decoders": []}, "at least one decoder"),
        (BASE | {"decoders": [{"name": "d0"}]}, "needs a url"),
        (BASE | {"decoders": [{"name": "d0", "url": "ftp://x"}]}, "http(s) URL"),
        (BASE | {"prefillers": [{"name": "d0", "url": "http://h:1"}]}, "unique: d0"),
        (BASE | {"sidecar": {"allowed_prefillers": ["nohost"]}}, "host:port"),
        ({"decoders": BASE["decoders"]}, "decoders without a compatible prefiller: d0"),
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


def _pool(name: str, role: str, group: str, *endpoints: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "role": role,
        "group": group,
        "endpoints": [
            {"name": e, "url": f"http://127.0.0.1:{9000 + i}"} for i, e in enumerate(endpoints)
        ],
    } | extra


def test_pools_resolve_defaults_and_groups() -> None:
    config = parse_config(
        {
            "pools": [
                _pool("h-d", "decode", "nvidia", "hd0", hardware="h200", model="m"),
                _pool("h-p", "prefill", "nvidia", "hp0", hardware="h200"),
                _pool(
                    "a-both", "both", "amd", "ab0", "ab1", hardware="mi325x", connector="example"
                ),
            ]
        }
    )
    fleet = {e.name: e for e in config.fleet()}
    assert fleet["hd0"].model == "m" and fleet["hd0"].hardware == "h200"
    assert fleet["ab0"].decodes and fleet["ab0"].prefills and fleet["ab0"].connector == "example"
    assert [p.name for p in config.compatible_prefillers(fleet["hd0"])] == ["hp0"]
    assert [p.name for p in config.compatible_prefillers(fleet["ab0"])] == ["ab1"]
    assert config.models() == ["m"]


def test_decoders_without_a_compatible_prefiller_are_named() -> None:
    data = {
        "pools": [
            _pool("h-d", "decode", "nvidia", "hd0"),
            _pool("a-d", "decode", "amd", "ad0", "ad1"),
            _pool("h-p", "prefill", "nvidia", "hp0"),
        ]
    }
    with pytest.raises(ConfigError) as error:
        parse_config(data)
    message = str(error.value)
    assert "ad0 (group amd" in message and "ad1 (group amd" in message and "hd0" not in message
    staged = data | {
        "compatibility": {"host_staged": [{"prefill_group": "nvidia", "decode_group": "amd"}]}
    }
    config = parse_config(staged)
    ad0 = next(e for e in config.fleet() if e.name == "ad0")
    assert [p.name for p in config.compatible_prefillers(ad0)] == ["hp0"]


def test_v1_lists_and_pools_mix() -> None:
    config = parse_config(BASE | {"pools": [_pool("extra", "decode", "default", "d9")]})
    assert [e.name for e in config.endpoints()] == ["d9", "d0", "p0"]
    assert {e.pool for e in config.fleet()} == {"extra", "decoders", "prefillers"}
