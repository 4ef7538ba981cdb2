"""``pd-orchestrator sidecar``: llm-d's flags and headers, in front of simulators."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from pd_orchestrator.children import Child, python_command, start_child, stop_child
from pd_orchestrator.cli.main import build_parser
from pd_orchestrator.cli.sidecar import SidecarFlagError, normalize_flags, sidecar_config

MODEL = "sim-model"
PROMPT = "a document long enough for several blocks of the cache. " * 4


def _port_free_on(*hosts: str) -> int:
    """A port free on every one of ``hosts`` (loopback addresses)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind((hosts[0], 0))
            port = int(first.getsockname()[1])
            try:
                for host in hosts[1:]:
                    with socket.socket() as other:
                        other.bind((host, port))
            except OSError:
                continue
            return port
    raise AssertionError("no common free port")


def _sim(stack: ExitStack, name: str, host: str, port: int, connector: str) -> Child:
    argv = python_command(
        "sim", "--host", host, "--port", str(port), "--profile", "instant",
        "--model", MODEL, "--kv-connector", connector, "--engine-id", name,
    )  # fmt: skip
    child = start_child(name, argv, timeout=60)
    stack.callback(stop_child, child)
    return child


def _sidecar(stack: ExitStack, *flags: str) -> Child:
    child = start_child("sidecar", python_command("sidecar", *flags), timeout=60)
    stack.callback(stop_child, child)
    return child


def _post(url: str, headers: dict[str, str], **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True} | extra
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def test_go_style_flags_and_the_allow_list(stack: ExitStack, tmp_path: Path) -> None:
    decoder = _sim(stack, "decode", "127.0.0.1", 0, "nixl")
    prefiller = _sim(stack, "prefill", "127.0.0.1", 0, "nixl")
    allowlist = tmp_path / "allowlist"
    allowlist.write_text(f"# the prefill pool\n127.0.0.1:{prefiller.port}\n")
    port = _port_free_on("127.0.0.1")
    sidecar = _sidecar(
        stack, f"-port={port}", f"-vllm-port={decoder.port}", "-connector=nixlv2",
        "-enable-ssrf-protection=true", "-secure-proxy=false", f"--allowlist-file={allowlist}",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    allowed = _post(url, {"x-prefiller-host-port": f"127.0.0.1:{prefiller.port}"})
    assert allowed.status_code == 200, allowed.text
    assert allowed.headers["x-pd-decision"] == "pd"
    assert allowed.headers["x-pd-prefiller"] == f"127.0.0.1:{prefiller.port}"
    refused = _post(url, {"x-prefiller-host-port": f"127.0.0.1:{decoder.port}"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == 403
    bad = _post(url, {"x-prefiller-host-port": "no-port-here"})
    assert bad.status_code == 400
    assert sidecar.url.endswith(f":{port}")


def test_ssrf_protection_off_takes_any_named_host(stack: ExitStack) -> None:
    decoder = _sim(stack, "decode", "127.0.0.1", 0, "nixl")
    prefiller = _sim(stack, "prefill", "127.0.0.1", 0, "nixl")
    port = _port_free_on("127.0.0.1")
    _sidecar(
        stack, "--port", str(port), "--model-server-port", str(decoder.port),
        "--enable-ssrf-protection=false", "--secure-serving=false",
    )  # fmt: skip
    answer = _post(f"http://127.0.0.1:{port}", {"x-prefiller-host-port": prefiller.url[7:]})
    assert answer.status_code == 200 and answer.headers["x-pd-decision"] == "pd"


def test_a_kv_source_is_pulled_from_over_the_p2p_tier(stack: ExitStack, tmp_path: Path) -> None:
    """llm-d keeps the source's host and uses the P2P port flag (one port per pod IP):
    three simulators on three loopback addresses share that port."""
    hosts = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
    shared = _port_free_on(*hosts)
    decoder = _sim(stack, "decode", "127.0.0.1", 0, "offloading")
    prefiller = _sim(stack, "prefill", hosts[0], shared, "offloading")
    source = _sim(stack, "source", hosts[1], shared, "offloading")
    warm = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    assert httpx.post(source.url + "/v1/completions", json=warm, timeout=30).status_code == 200
    allowlist = tmp_path / "allowlist"
    allowlist.write_text("127.0.0.0/8\n")
    port = _port_free_on("127.0.0.1")
    _sidecar(
        stack, f"--port={port}", f"--vllm-port={decoder.port}", "--kv-connector=offloading",
        f"--p2p-connector-port={shared}", f"--allowlist-file={allowlist}",
    )  # fmt: skip
    headers = {
        "x-prefiller-host-port": f"{hosts[0]}:{shared}",
        "x-kv-cache-source-host-port": f"{hosts[1]}:8000",  # the port is not used
    }
    answer = _post(f"http://127.0.0.1:{port}", headers)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-pd-decision"] == "pd"
    metrics = httpx.get(prefiller.url + "/metrics", timeout=10).text
    hits = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:external_prefix_cache_hits_total")
    )
    assert hits > 0  # the prefiller loaded the prefix from the source


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-connector=sglang"], "sglang"),
        (["--decode-chunk-size=256"], "chunked decode"),
        (["--ec-connector=ec-example"], "encode"),
        (["--enable-tls=prefiller"], "TLS"),
        (["--secure-serving"], "cert-path"),
        (["--enable-p2p-pull", "--kv-connector=mooncake"], "nixlv2"),
        ([], "allow-list"),
    ],
    ids=["sglang", "chunked", "encoder", "tls", "serving-without-cert", "p2p-pull", "no-list"],
)
def test_flags_this_sidecar_cannot_honour_are_refused(flags: list[str], message: str) -> None:
    args = build_parser().parse_args(["sidecar", *normalize_flags(flags)])
    with pytest.raises(SidecarFlagError, match=message):
        sidecar_config(args)


@pytest.mark.parametrize(
    ("flags", "connector"),
    [
        (["--kv-connector=nixlv2"], "nixl"),
        (["--connector=shared-storage"], "example"),
        (["--kv-connector=mooncake"], "mooncake"),
        (["--kv-connector=offloading"], "offloading"),
        (["--kv-connector=nixlv2", "--enable-p2p-pull"], "multi:nixl,offloading"),
        (["--moriio-write-mode", "--moriio-local-pod-ip=10.0.0.5"], "moriio"),
        (["--configuration={kv-connector: mooncake, port: 9000}"], "mooncake"),
    ],
    ids=["nixlv2", "shared-storage", "mooncake", "offloading", "p2p-pull", "moriio", "yaml"],
)
def test_llm_d_connector_names_map_to_ours(flags: list[str], connector: str) -> None:
    args = build_parser().parse_args(
        ["sidecar", *flags, "--enable-ssrf-protection=false", "--secure-serving=false"]
    )
    config = sidecar_config(args)
    assert [e.connector for e in config.fleet()] == [connector]
