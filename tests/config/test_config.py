"""Configuration: every shipped file loads; strictness; environment overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pd_orchestrator.config import ConfigError, load_config, parse_config
from pd_orchestrator.fleet.endpoints import endpoints_from_config

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
        (BASE | {"sidecar": {"allowed_prefillers": ["host:notaport"]}}, "host:port"),
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
    # an endpoint that also prefills needs no other: it serves what it is sent itself
    alone = parse_config({"pools": [_pool("a-b", "both", "amd", "ab0")]})
    assert [p.name for p in alone.compatible_prefillers(alone.fleet()[0])] == []


def test_a_prefill_pool_that_spills_marks_its_endpoints() -> None:
    config = parse_config(
        {
            "pools": [
                _pool("d", "decode", "g", "d0"),
                _pool("p", "prefill", "g", "p0", spill=True),
                _pool("q", "prefill", "g", "q0"),
            ]
        }
    )
    spills = {e.name: e.spill for e in endpoints_from_config(config)}
    assert spills == {"d0": False, "p0": True, "q0": False}
    # a pool that already decodes cannot spill
    for role in ("decode", "both"):
        with pytest.raises(ConfigError, match=f"spill is for a prefill pool \\(a {role} pool"):
            parse_config({"pools": [_pool("d", role, "g", "d0", spill=True)]})


def test_v1_lists_and_pools_mix() -> None:
    config = parse_config(BASE | {"pools": [_pool("extra", "decode", "default", "d9")]})
    assert [e.name for e in config.endpoints()] == ["d9", "d0", "p0"]
    assert {e.pool for e in config.fleet()} == {"extra", "decoders", "prefillers"}


def test_pools_of_different_connectors_are_kept_apart_unless_bridged() -> None:
    data: dict[str, Any] = {
        "pools": [
            _pool("d", "decode", "g", "d0", connector="multi:nixl,offloading"),
            _pool("p", "prefill", "g", "p0", connector="nixl"),
        ]
    }
    with pytest.raises(ConfigError, match=r"d0 \(group g, connector multi:nixl,offloading\)"):
        parse_config(data)
    bridge = {"prefill_connector": "nixl", "decode_connector": "multi:nixl,offloading"}
    config = parse_config(data | {"compatibility": {"connector_bridges": [bridge]}})
    d0 = next(e for e in config.fleet() if e.name == "d0")
    assert [p.name for p in config.compatible_prefillers(d0)] == ["p0"]
    assert config.compatibility.connector_pairs() == {("nixl", "multi:nixl,offloading")}


@pytest.mark.parametrize(
    ("compatibility", "fragment"),
    [
        (
            {"connector_bridges": [{"prefill_connector": "mooncake", "decode_connector": "nixl"}]},
            "mooncake cannot hand KV over to nixl",
        ),
        (
            {"connector_bridges": [{"prefill_connector": "nixl", "decode_connector": "nixl2"}]},
            "unknown connector 'nixl2'",
        ),
    ],
)
def test_impossible_bridges_are_refused(compatibility: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_config(BASE | {"compatibility": compatibility})


@pytest.mark.parametrize(
    ("connector", "ok"),
    [
        ("nixl-push", True),
        ("multi:nixl,example", True),
        ("multi:nixl,mooncake", False),  # both use remote_engine_id
        ("multi:", False),
        ("p2p-nccl", False),
    ],
)
def test_connector_specs_are_validated(connector: str, ok: bool) -> None:
    data = BASE | {"connector": connector}
    if ok:
        assert parse_config(data).fleet()[0].connector == connector
    else:
        with pytest.raises(ConfigError, match="connector"):
            parse_config(data)


def test_kv_settings_default_to_vllms_and_the_url_host() -> None:
    config = parse_config(
        {
            "pools": [
                _pool(
                    "d",
                    "decode",
                    "g",
                    "d0",
                    connector="moriio",
                    kv={"handshake_port": 7000, "notify_port": 7001, "dp_size": 2},
                ),
                _pool("p", "prefill", "g", "p0", connector="moriio"),
            ]
        }
    )
    fleet = {e.name: e for e in config.fleet()}
    decoder, prefiller = fleet["d0"].peer, fleet["p0"].peer
    assert (decoder.host, decoder.handshake_port, decoder.notify_port) == ("127.0.0.1", 7000, 7001)
    assert decoder.dp_size == 2 and decoder.dp_rank is None
    assert (prefiller.nixl_port, prefiller.bootstrap_port, prefiller.p2p_port) == (5600, 8998, 5710)
    assert (prefiller.handshake_port, prefiller.notify_port) == (6301, 61005)


@pytest.mark.parametrize(
    ("kv", "fragment"),
    [
        ({"dp_rank": 2, "dp_size": 2}, "dp_rank 2 is not below dp_size 2"),
        ({"notify_port": 0}, "notify_port"),
        ({"bootstrap_port": 70000}, "bootstrap_port"),
        ({"engine": "x"}, "engine: unknown key"),
    ],
)
def test_invalid_kv_settings_name_the_field(kv: dict[str, Any], fragment: str) -> None:
    data = BASE | {"decoders": [{"name": "d0", "url": "http://127.0.0.1:9001", "kv": kv}]}
    with pytest.raises(ConfigError, match=fragment):
        parse_config(data)


def test_endpoint_kv_block_overrides_the_pools() -> None:
    pool = _pool("p", "prefill", "g", "p0", "p1", kv={"engine_id": "pool-default"})
    pool["endpoints"][1]["kv"] = {"engine_id": "own", "host": "10.1.1.1"}
    config = parse_config({"pools": [_pool("d", "decode", "g", "d0"), pool]})
    fleet = {e.name: e.peer for e in config.fleet()}
    assert fleet["p0"].engine_id == "pool-default" and fleet["p0"].host == "127.0.0.1"
    assert (fleet["p1"].engine_id, fleet["p1"].host) == ("own", "10.1.1.1")


@pytest.mark.parametrize("token", ["", "two words", "tab\there", "caf\u00e9"], ids=repr)
def test_an_unusable_admin_token_is_a_config_error(token: str) -> None:
    with pytest.raises(ConfigError, match=r"admin\.token"):
        parse_config(BASE | {"admin": {"token": token}})


def test_an_empty_admin_token_from_the_environment_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDO_ADMIN__TOKEN", "")
    with pytest.raises(ConfigError, match=r"admin\.token: Value error, the admin token is empty"):
        parse_config(BASE)
    monkeypatch.setenv("PDO_ADMIN__TOKEN", "s3cret")
    token = parse_config(BASE).admin.token
    assert token is not None and token.get_secret_value() == "s3cret"


def test_limits_and_security_have_safe_defaults_and_env_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = parse_config(BASE)
    assert config.security.trust_client_transfer_params is False
    assert config.limits.max_body_bytes == 16 << 20 and config.limits.max_json_depth == 64
    monkeypatch.setenv("PDO_LIMITS__MAX_BODY_BYTES", "4096")
    monkeypatch.setenv("PDO_SECURITY__TRUST_CLIENT_TRANSFER_PARAMS", "true")
    config = parse_config(BASE)
    assert config.limits.max_body_bytes == 4096
    assert config.security.trust_client_transfer_params is True
    with pytest.raises(ConfigError, match=r"limits\.max_json_depth"):
        parse_config(BASE | {"limits": {"max_json_depth": 300}})  # past the encoder's 254
