"""``serve``, ``check-config`` and ``up``: the gateway daemon and the embedded demo."""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import anyio
import uvicorn
from rich.console import Console
from rich.table import Table

from connectors import parse_spec
from pd_orchestrator import __version__
from pd_orchestrator.children import Child, python_command, start_child, stop_child
from pd_orchestrator.cli.logs import add_logging_arguments, logging_from_args
from pd_orchestrator.cli.signals import exit_on_sigterm
from pd_orchestrator.config import ConfigError, EndpointConfig, GatewayConfig, load_config
from pd_orchestrator.config.settings import FleetEndpoint, KvSettings
from pd_orchestrator.sim.profiles import get_profile
from pd_orchestrator.sim.server import bind_socket

__all__ = ["add_parsers", "resolve_simulated", "serve_gateway"]

DEFAULT_CONFIG = Path("configs/local.yaml")
logger = logging.getLogger("pd_orchestrator.gateway")


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = subparsers.add_parser("serve", help="run the gateway daemon")
    serve.add_argument("--config", type=Path, required=True, help="YAML configuration file")
    serve.add_argument("--host", default=None, help="listen address (overrides the config)")
    serve.add_argument("--port", type=int, default=None, help="listen port (overrides the config)")
    add_logging_arguments(serve)
    serve.set_defaults(handler=run_serve)

    check = subparsers.add_parser("check-config", help="validate a configuration file")
    check.add_argument("config", type=Path)
    check.set_defaults(handler=run_check_config)

    up = subparsers.add_parser(
        "up", help="start the simulated endpoints a config declares and the gateway"
    )
    up.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    up.add_argument("--port", type=int, default=None, help="gateway port (overrides the config)")
    up.add_argument("--host", default=None, help="gateway address (overrides the config)")
    up.add_argument(
        "--state-file",
        type=Path,
        default=None,
        help="write the started endpoints (name, role, url, pid) here as JSON",
    )
    add_logging_arguments(up)
    up.set_defaults(handler=run_up)


def _load(path: Path, console: Console) -> GatewayConfig | None:
    """The validated config (plugins included), or None after printing why not."""
    from pd_orchestrator.gateway.state import check_plugins
    from pd_orchestrator.routing.registry import RoutingConfigError

    try:
        config = load_config(path)
        check_plugins(config)
    except (ConfigError, RoutingConfigError) as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        return None
    return config


def _listen(config: GatewayConfig, host: str | None, port: int | None) -> GatewayConfig:
    listen = config.listen.model_copy(
        update={k: v for k, v in (("host", host), ("port", port)) if v is not None}
    )
    return config.model_copy(update={"listen": listen})


def _logging(config: GatewayConfig, args: argparse.Namespace) -> GatewayConfig:
    """``config`` with the command line's ``--log-level`` and ``--log-format``."""
    return config.model_copy(update={"logging": logging_from_args(args, config.logging)})


def serve_gateway(
    config: GatewayConfig,
    on_ready: Callable[[str], None] | None = None,
    config_path: Path | None = None,
) -> None:
    """Run the gateway until SIGINT/SIGTERM.

    ``on_ready(url)`` runs once the socket is bound and the app has started; by
    default it prints ``READY <url>`` (what :mod:`pd_orchestrator.children` waits for).
    With ``config_path``, SIGHUP reloads the configuration from it. Logging is
    configured from ``config.logging`` first (uvicorn's records included).
    """
    from pd_orchestrator.gateway import Gateway
    from pd_orchestrator.telemetry.logs import configure_logging

    configure_logging(config.logging)
    sock = bind_socket(config.listen.host, config.listen.port)
    url = f"http://{config.listen.host}:{sock.getsockname()[1]}"
    gateway = Gateway(config, config_path=config_path)
    server = uvicorn.Server(
        uvicorn.Config(
            gateway.app(),
            log_level="warning",
            log_config=None,
            timeout_graceful_shutdown=5,
            http="httptools",
            interface="asgi3",
            proxy_headers=False,
            server_header=False,
            access_log=False,
        )
    )

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])
            while not server.started:  # noqa: ASYNC110 - uvicorn exposes no event
                await anyio.sleep(0.02)
            logger.info(
                "pd-orchestrator %s serving on %s (%s, %d endpoints, tracing %s)",
                __version__, url, config.mode, len(config.fleet()),
                "on" if gateway.tracing is not None else "off",
            )  # fmt: skip
            (on_ready or _announce)(url)

    anyio.run(main, backend_options={"use_uvloop": True})


def _announce(url: str) -> None:
    print(f"READY {url}", flush=True)


def run_serve(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    config = _load(args.config, console)
    if config is None:
        return 2
    missing = [e.name for e in config.endpoints() if e.url is None]
    if missing:
        console.print(f"[bold red]error:[/] endpoints without a url: {', '.join(missing)}")
        return 2
    exit_on_sigterm()
    config = _logging(_listen(config, args.host, args.port), args)
    serve_gateway(config, config_path=args.config)
    return 0


def run_check_config(args: argparse.Namespace) -> int:
    console = Console()
    config = _load(args.config, Console(stderr=True))
    if config is None:
        return 2
    console.print(_endpoint_table(config, title=f"{args.config}: valid"))
    rest = {k: v for k, v in config.public_dict().items() if k not in ("decoders", "prefillers")}
    console.print_json(json.dumps(rest))
    return 0


def _endpoint_table(config: GatewayConfig, title: str) -> Table:
    table = Table(title=title)
    for column in ("pool", "role", "name", "hardware", "group", "connector", "model", "url"):
        table.add_column(column)
    for e in config.fleet():
        url = e.url or f"(simulated: {e.sim.profile if e.sim else '?'})"
        row = (e.pool, e.role, e.name, e.hardware, e.group, e.connector, e.model or "-", url)
        table.add_row(*row)
    return table


# -- up ----------------------------------------------------------------------------------------
def _sim_argv(endpoint: FleetEndpoint, shared_dir: Path) -> list[str]:
    spec = endpoint.sim
    assert spec is not None
    argv = python_command(
        "sim",
        "--host", "127.0.0.1",
        "--port", str(spec.port),
        "--profile", spec.profile,
        "--time-scale", str(spec.time_scale),
        "--block-size", str(spec.block_size),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--seed", str(spec.seed),
        "--kv-connector", endpoint.connector,
        "--engine-id", endpoint.name,
        "--model", endpoint.model or get_profile(spec.profile).model,
    )  # fmt: skip
    if spec.num_kv_blocks is not None:
        argv += ["--num-kv-blocks", str(spec.num_kv_blocks)]
    if {"example", "lmcache"} & set(parse_spec(endpoint.connector)):
        argv += ["--kv-shared-dir", str(shared_dir)]
    return argv + spec.extra_args


def _sim_kv(name: str, port: int) -> KvSettings:
    """A simulator serves every KV side channel on its HTTP port, as engine ``name``."""
    return KvSettings(
        host="127.0.0.1",
        engine_id=name,
        nixl_port=port,
        bootstrap_port=port,
        handshake_port=port,
        notify_port=port,
        p2p_port=port,
    )


def resolve_simulated(
    config: GatewayConfig, stack: ExitStack, shared_dir: Path
) -> tuple[GatewayConfig, list[Child]]:
    """Start a simulator for every endpoint without a URL; return the config with URLs.

    Children are stopped when ``stack`` closes.
    """
    children: list[Child] = []
    resolved = {e.name: e for e in config.fleet()}

    def resolve(endpoint: EndpointConfig) -> EndpointConfig:
        fleet = resolved[endpoint.name]
        if endpoint.url is not None or fleet.sim is None:
            return endpoint
        child = start_child(endpoint.name, _sim_argv(fleet, shared_dir))
        stack.callback(stop_child, child)
        children.append(child)
        model = fleet.model or get_profile(fleet.sim.profile).model
        update: dict[str, object] = {"url": child.url, "model": model}
        if endpoint.kv is None:  # a simulator's side channels are on its own port
            update["kv"] = _sim_kv(endpoint.name, child.port)
        return endpoint.model_copy(update=update)

    pools = [
        pool.model_copy(update={"endpoints": [resolve(e) for e in pool.endpoints]})
        for pool in config.pools
    ]
    return config.model_copy(update={"pools": pools}), children


def _write_state(path: Path, config: GatewayConfig, children: list[Child]) -> None:
    pids = {child.name: child.process.pid for child in children}
    endpoints = [
        {"name": e.name, "role": e.role, "pool": e.pool, "url": e.url, "pid": pids.get(e.name)}
        for e in config.fleet()
    ]
    path.write_text(json.dumps({"endpoints": endpoints}, indent=2))


def _curl(url: str, model: str) -> str:
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
    )
    return f"curl -s {url}/v1/chat/completions -H 'content-type: application/json' -d '{body}'"


def run_up(args: argparse.Namespace) -> int:
    console = Console()
    config = _load(args.config, Console(stderr=True))
    if config is None:
        return 2
    config = _logging(_listen(config, args.host, args.port), args)
    exit_on_sigterm()
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="pdo-kv-") as shared:
        try:
            config, children = resolve_simulated(config, stack, Path(shared))
        except Exception as exc:  # a child that fails to start stops the whole demo
            console.print(f"[bold red]error:[/] {exc}", highlight=False)
            return 1
        models = config.models()
        if args.state_file is not None:
            _write_state(args.state_file, config, children)

        def ready(url: str) -> None:
            console.print(_endpoint_table(config, title="pd-orchestrator up"))
            example = _curl(url, models[0] if models else "MODEL")
            console.print(f"gateway on [bold]{url}[/] (Ctrl-C stops everything); try:")
            console.print(example, highlight=False, soft_wrap=True)
            _announce(url)

        serve_gateway(config, ready)
    return 0
