"""``sidecar``: the gateway beside one decode vLLM, started with llm-d's sidecar flags.

llm-d's routing sidecar (``pd-sidecar``) runs next to each decode vLLM; an upstream
scheduler names the prefiller in ``x-prefiller-host-port`` and, for P2P prefix
pulls, a KV source in ``x-kv-cache-source-host-port``. ``pd-orchestrator sidecar``
takes the same flags (``--flag=value``, ``--flag value``, a bare boolean ``--flag``;
single-dash spellings too) and the same ``--configuration``/``--configuration-file``
YAML (its keys are the flag names), so a manifest keeps its arguments when the image
is swapped. What the sidecar does with them:

=============================== =====================================================
``--port``                      the sidecar's port (default 8000, all interfaces)
``--model-server-port``         the local vLLM (default 8200); ``--vllm-port`` too
``--kv-connector``              ``nixlv2`` -> ``nixl``, ``shared-storage`` ->
                                ``example``, ``mooncake``, ``offloading`` (our own
                                connector names work too); ``--connector`` too
``--enable-p2p-pull``           with ``nixlv2``: ``multi:nixl,offloading``
``--moriio-write-mode``         ``moriio`` (with its ``--moriio-*`` ports and sizes)
``--data-parallel-size``        the local vLLM's data-parallel size
``--mooncake-bootstrap-port``,  the side-channel ports of the instances the headers
``--p2p-connector-port``        name (llm-d takes a KV source's host, not its port)
``--enable-ssrf-protection``    every host a header names must be in the allow-list
                                (``--allowlist-file``: ``host``, ``host:port``, a
                                network or a DNS name per line), else 403; **on by
                                default** here (llm-d: off); ``=false`` accepts any
``--enable-prefiller-sampling`` spread requests over the prefillers a header names
``--prefill-max-retries``,      prefill attempts (retries + 1) and their backoff
``--prefill-retry-backoff``
``--secure-serving``            TLS with ``--cert-path``/tls.crt and tls.key;
                                ``--secure-proxy`` too (llm-d generates a self-signed
                                certificate when no path is given; this sidecar asks
                                for one)
``--metrics-port``              every route (``/metrics`` too) also on this port
``--max-idle-conns-per-host``   idle upstream connections kept per instance
=============================== =====================================================

Accepted and without effect here: ``--inference-pool``, ``--pool-group``,
``--tracing``, ``--metrics-cert-dir``, ``--tls-min-version``,
``--tls-cipher-suites``, llm-d's logging flags. Refused, naming the flag: what this
sidecar does not do (``--ec-connector``, ``--decode-chunk-size`` > 0,
``--enable-speculative-prefill``, ``--enable-tls``, ``--kv-connector=sglang``).

``--config FILE`` (this project's YAML) supplies everything else (threshold policy,
timeouts, ...); the flags win over it.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from pd_orchestrator.cli.gateway import serve_gateway, with_logging
from pd_orchestrator.cli.logs import add_logging_arguments
from pd_orchestrator.cli.signals import exit_on_sigterm
from pd_orchestrator.config import ConfigError, GatewayConfig
from pd_orchestrator.config.loader import load_config, parse_config
from pd_orchestrator.sim.server import bind_socket

__all__ = ["CONNECTORS", "add_parser", "normalize_flags", "sidecar_config"]

CONNECTORS = {
    "nixlv2": "nixl",
    "shared-storage": "example",
    "mooncake": "mooncake",
    "offloading": "offloading",
}
"""llm-d's KV connector names and this project's."""

_UNSUPPORTED = {"sglang": "SGLang's disaggregation is not supported by this sidecar"}
_LONG = re.compile(r"^-(?!-)([a-z][a-z0-9-]+)(=.*)?$")


class SidecarFlagError(ValueError):
    """A flag this sidecar refuses, with the reason."""


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "t", "true", "yes", "on"):
        return True
    if lowered in ("0", "f", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{value!r} is not a boolean")


def _duration(value: str) -> float:
    """A Go duration (``200ms``, ``1.5s``, ``1m``) in seconds."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*(ms|s|m|h)?\s*", str(value))
    if match is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not a duration such as 200ms")
    number = float(match.group(1))
    return number * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[match.group(2) or "s"]


def normalize_flags(argv: Sequence[str]) -> list[str]:
    """Go's single-dash long flags (``-port=8000``) as ``--port=8000``."""
    return [f"--{m.group(1)}{m.group(2) or ''}" if (m := _LONG.match(a)) else a for a in argv]


def _flag(parser: argparse.ArgumentParser, *names: str, kind: Any = str, **kw: Any) -> None:
    if kind is bool:  # --flag, --flag=true, --flag false
        parser.add_argument(*names, type=_bool, nargs="?", const=True, default=None, **kw)
    else:
        parser.add_argument(*names, type=kind, default=None, **kw)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "sidecar",
        help="the gateway beside one decode vLLM, with llm-d's sidecar flags",
        description=__doc__.split("\n\n", 1)[0] if __doc__ else None,
    )
    _flag(parser, "--config", kind=Path, help="this project's YAML (flags win over it)")
    _flag(parser, "--port", kind=int, help="listen port (default 8000)")
    _flag(parser, "--model-server-port", "--vllm-port", dest="model_server_port", kind=int)
    _flag(parser, "--kv-connector", "--connector", dest="kv_connector")
    _flag(parser, "--ec-connector")
    _flag(parser, "--data-parallel-size", kind=int)
    _flag(parser, "--mooncake-bootstrap-port", kind=int)
    _flag(parser, "--p2p-connector-port", kind=int)
    _flag(parser, "--enable-p2p-pull", kind=bool)
    _flag(parser, "--enable-ssrf-protection", kind=bool)
    _flag(parser, "--allowlist-file", kind=Path, help="hosts a header may name, one a line")
    _flag(parser, "--enable-prefiller-sampling", kind=bool)
    _flag(parser, "--enable-speculative-prefill", kind=bool)
    _flag(parser, "--secure-serving", "--secure-proxy", dest="secure_serving", kind=bool)
    _flag(parser, "--cert-path", kind=Path)
    _flag(parser, "--enable-tls")
    _flag(parser, "--tls-insecure-skip-verify")
    _flag(parser, "--prefill-max-retries", kind=int)
    _flag(parser, "--prefill-retry-backoff", kind=_duration)
    _flag(parser, "--decode-chunk-size", kind=int)
    _flag(parser, "--max-idle-conns-per-host", kind=int)
    _flag(parser, "--metrics-port", kind=int)
    _flag(parser, "--moriio-write-mode", kind=bool)
    _flag(parser, "--moriio-local-pod-ip")
    _flag(parser, "--moriio-decode-notify-port", kind=int)
    _flag(parser, "--moriio-decode-handshake-port", kind=int)
    _flag(parser, "--moriio-prefill-notify-port", kind=int)
    _flag(parser, "--moriio-prefill-handshake-port", kind=int)
    _flag(parser, "--moriio-tp-size", kind=int)
    _flag(parser, "--moriio-dp-size", kind=int)
    _flag(parser, "--configuration", help="inline YAML of flag names and values")
    _flag(parser, "--configuration-file", kind=Path)
    for ignored in ("--inference-pool", "--pool-group", "--metrics-cert-dir",
                    "--tls-min-version", "--tls-cipher-suites", "--zap-log-level",
                    "--zap-encoder", "--zap-stacktrace-level", "--zap-time-encoding",
                    "--kubeconfig"):  # fmt: skip
        _flag(parser, ignored, help=argparse.SUPPRESS)
    _flag(parser, "--tracing", "--zap-devel", dest="ignored_bool", kind=bool,
          help=argparse.SUPPRESS)  # fmt: skip
    add_logging_arguments(parser)
    parser.set_defaults(handler=run_sidecar)


def _yaml_flags(args: argparse.Namespace) -> dict[str, Any]:
    """``--configuration`` or ``--configuration-file``: llm-d's YAML of flag names."""
    if args.configuration is not None and args.configuration_file is not None:
        raise SidecarFlagError("--configuration and --configuration-file are exclusive")
    text = args.configuration
    if args.configuration_file is not None:
        text = args.configuration_file.read_text()
    if text is None:
        return {}
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise SidecarFlagError("the sidecar configuration must be a mapping of flag names")
    return {str(key).replace("-", "_"): value for key, value in data.items()}


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """Every flag's value: the command line first, then the YAML configuration."""
    values = {key: value for key, value in vars(args).items() if value is not None}
    for key, value in _yaml_flags(args).items():
        if key == "vllm_port":
            key = "model_server_port"
        if key == "secure_proxy":
            key = "secure_serving"
        values.setdefault(key, value)
    return values


def _refuse(flags: dict[str, Any]) -> None:
    if flags.get("ec_connector"):
        raise SidecarFlagError("--ec-connector: encode/prefill disaggregation is not supported")
    if int(flags.get("decode_chunk_size") or 0) > 0:
        raise SidecarFlagError("--decode-chunk-size: chunked decode is not supported")
    if _truthy(flags.get("enable_speculative_prefill")):
        raise SidecarFlagError("--enable-speculative-prefill is not supported")
    if flags.get("enable_tls") or flags.get("tls_insecure_skip_verify"):
        raise SidecarFlagError("--enable-tls: TLS towards the instances is not supported yet")
    if _truthy(flags.get("secure_serving")) and not flags.get("cert_path"):
        raise SidecarFlagError(
            "--secure-serving needs --cert-path (a folder with tls.crt and tls.key); "
            "pass --secure-serving=false to serve plain HTTP"
        )


def _truthy(value: Any) -> bool:
    return value if isinstance(value, bool) else _bool(str(value)) if value is not None else False


def _connector(flags: dict[str, Any]) -> str:
    name = str(flags.get("kv_connector") or "nixlv2")
    if name in _UNSUPPORTED:
        raise SidecarFlagError(f"--kv-connector={name}: {_UNSUPPORTED[name]}")
    connector = CONNECTORS.get(name, name)
    if _truthy(flags.get("moriio_write_mode")):
        connector = "moriio"
    if _truthy(flags.get("enable_p2p_pull")):
        if connector != "nixl":
            raise SidecarFlagError("--enable-p2p-pull goes with --kv-connector=nixlv2")
        connector = "multi:nixl,offloading"
    return connector


def _kv(flags: dict[str, Any], side: str) -> dict[str, Any]:
    """The ``kv`` block of the local decoder (``side="decode"``) or of the instances
    the headers name (``"prefill"``)."""
    kv: dict[str, Any] = {}
    pairs = {
        "bootstrap_port": "mooncake_bootstrap_port",
        "p2p_port": "p2p_connector_port",
        "handshake_port": f"moriio_{side}_handshake_port",
        "notify_port": f"moriio_{side}_notify_port",
        "tp_size": "moriio_tp_size",
    }
    for field_name, flag in pairs.items():
        if flags.get(flag) is not None:
            kv[field_name] = int(flags[flag])
    if side == "decode":
        size = flags.get("data_parallel_size") or flags.get("moriio_dp_size")
        if size:
            kv["dp_size"] = int(size)
        if flags.get("moriio_local_pod_ip"):
            kv["host"] = str(flags["moriio_local_pod_ip"])
    return kv


def sidecar_config(args: argparse.Namespace) -> GatewayConfig:
    """The gateway configuration the flags (and ``--config``) describe; raises
    :class:`SidecarFlagError` or :class:`~pd_orchestrator.config.ConfigError`."""
    flags = _settings(args)
    _refuse(flags)
    base: dict[str, Any] = {}
    if flags.get("config") is not None:
        base = load_config(Path(flags["config"])).model_dump(mode="json", exclude_unset=True)
    vllm_port = int(flags.get("model_server_port") or 8200)
    decoder: dict[str, Any] = {"name": "local-decoder", "url": f"http://127.0.0.1:{vllm_port}"}
    decode_kv = _kv(flags, "decode")
    if decode_kv:
        decoder["kv"] = decode_kv
    pool = {"name": "local", "role": "decode", "connector": _connector(flags),
            "endpoints": [decoder]}  # fmt: skip
    port = int(flags.get("port") or 8000)
    listen = base.get("listen", {}) | {"host": "0.0.0.0", "port": port}
    sidecar = base.get("sidecar", {}) | {"enabled": True}
    if flags.get("enable_ssrf_protection") is not None:
        sidecar["ssrf_protection"] = _truthy(flags["enable_ssrf_protection"])
    if flags.get("allowlist_file") is not None:
        sidecar["allowlist_file"] = str(flags["allowlist_file"])
    if flags.get("enable_prefiller_sampling") is not None:
        sidecar["prefiller_sampling"] = _truthy(flags["enable_prefiller_sampling"])
    prefill_kv = _kv(flags, "prefill")
    if prefill_kv:
        sidecar["prefiller_kv"] = prefill_kv
    upstream = dict(base.get("upstream", {}))
    if flags.get("prefill_max_retries") is not None:
        upstream["prefill_attempts"] = int(flags["prefill_max_retries"]) + 1
    if flags.get("prefill_retry_backoff") is not None:
        upstream["retry_backoff"] = _duration(str(flags["prefill_retry_backoff"]))
    if flags.get("max_idle_conns_per_host") is not None:
        upstream["max_keepalive_connections"] = int(flags["max_idle_conns_per_host"])
    fleet = ("pools", "decoders", "prefillers")
    document = {key: value for key, value in base.items() if key not in fleet}
    document |= {"listen": listen, "pools": [pool], "sidecar": sidecar, "upstream": upstream}
    config = parse_config(document, "sidecar flags")
    if config.sidecar.ssrf_protection and not (
        config.sidecar.allowed_prefillers or config.sidecar.allowlist_file
    ):
        raise SidecarFlagError(
            "SSRF protection is on and no allow-list is given: pass --allowlist-file (one "
            "host, host:port, network or DNS name per line) or --enable-ssrf-protection=false"
        )
    return config


def run_sidecar(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        config = sidecar_config(args)
    except (SidecarFlagError, ConfigError, OSError) as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        return 2
    if not config.sidecar.ssrf_protection:
        console.print(
            "[yellow]warning:[/] SSRF protection is off: any host a request names in "
            f"{config.sidecar.prefiller_header} will be connected to",
            highlight=False,
        )
    flags = _settings(args)
    extra = []
    if flags.get("metrics_port"):
        extra.append(bind_socket("0.0.0.0", int(flags["metrics_port"])))
    tls = None
    if flags.get("cert_path") and _truthy(flags.get("secure_serving")):
        cert = Path(flags["cert_path"])
        tls = (cert / "tls.crt", cert / "tls.key")
    exit_on_sigterm()
    config = with_logging(config, args)
    serve_gateway(config, config_path=None, extra_sockets=extra, tls=tls)
    return 0
