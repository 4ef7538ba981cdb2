"""``serve`` and ``check-config``: the gateway daemon and its configuration check.

(``up``, the embedded demo, is :mod:`pd_orchestrator.cli.up`; it serves through
:func:`serve_gateway` and prints :func:`endpoint_table`.)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import inspect
import json
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, cast

import anyio
import uvicorn
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from pd_orchestrator import __version__
from pd_orchestrator.cli.logs import add_logging_arguments, logging_from_args
from pd_orchestrator.cli.signals import exit_on_sigterm, sigterm_seen
from pd_orchestrator.config import ConfigError, GatewayConfig, load_config
from pd_orchestrator.config.settings import FleetEndpoint
from pd_orchestrator.model.measured import resolve_profile
from pd_orchestrator.sim.server import bind_socket

if TYPE_CHECKING:
    from pd_orchestrator.gateway import Gateway
    from pd_orchestrator.gateway.lifecycle import Drain

__all__ = [
    "add_parsers",
    "endpoint_table",
    "load_checked",
    "serve_gateway",
    "with_listen",
    "with_logging",
]

OnReady = Callable[[str], Awaitable[None] | None]
logger = logging.getLogger("pd_orchestrator.gateway")
_CLOSE_SECONDS = 5
"""After the drain, how long uvicorn waits for connections to close before cancelling."""


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = subparsers.add_parser("serve", help="run the gateway daemon")
    serve.add_argument("--config", type=Path, required=True, help="YAML configuration file")
    serve.add_argument("--host", default=None, help="listen address (overrides the config)")
    serve.add_argument("--port", type=int, default=None, help="listen port (overrides the config)")
    serve.add_argument(
        "--workers",
        type=int,
        default=None,
        help="gateway processes sharing the port (overrides listen.workers; docs/operations.md)",
    )
    add_logging_arguments(serve)
    serve.set_defaults(handler=run_serve)

    check = subparsers.add_parser("check-config", help="validate a configuration file")
    check.add_argument("config", type=Path)
    check.set_defaults(handler=run_check_config)


def load_checked(path: Path, console: Console) -> GatewayConfig | None:
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


def with_listen(config: GatewayConfig, host: str | None, port: int | None) -> GatewayConfig:
    """``config`` with the command line's ``--host`` / ``--port`` (when given)."""
    listen = config.listen.model_copy(
        update={k: v for k, v in (("host", host), ("port", port)) if v is not None}
    )
    return config.model_copy(update={"listen": listen})


def with_logging(config: GatewayConfig, args: argparse.Namespace) -> GatewayConfig:
    """``config`` with the command line's ``--log-level`` and ``--log-format``."""
    return config.model_copy(update={"logging": logging_from_args(args, config.logging)})


class _DrainingServer(uvicorn.Server):
    """uvicorn that drains the gateway when it shuts down
    (:mod:`pd_orchestrator.gateway.lifecycle`) instead of cutting requests after a
    fixed wait, and leaves idle connections open until they close by themselves."""

    def __init__(self, config: uvicorn.Config, drain: Drain, grace: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.grace = grace

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.drain.begin()  # /ready answers 503 from now on
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.drain.begin()
        for server in self.servers:
            server.close()  # no new connection
        for sock in sockets or []:
            sock.close()
        open_connections = self.server_state.connections
        ended = await self.drain.run(
            self.grace, lambda: self.force_exit, lambda: len(open_connections)
        )
        if ended:
            logger.warning("drain: %d request(s) still in flight after %g s were ended",
                           ended, self.grace)  # fmt: skip
        await super().shutdown(sockets)


def serve_gateway(
    config: GatewayConfig,
    on_ready: OnReady | None = None,
    config_path: Path | None = None,
    *,
    sock: socket.socket | None = None,
    gateway: Gateway | None = None,
    extra_sockets: list[socket.socket] | None = None,
    tls: tuple[Path, Path] | None = None,
) -> None:
    """Run the gateway until SIGINT/SIGTERM, then drain it (``lifecycle.drain_seconds``).

    ``on_ready(url)`` runs (and is awaited when it returns an awaitable) once the
    socket is bound and the app has started; by default it prints ``READY <url>``
    (what :mod:`pd_orchestrator.children` waits for). With ``config_path``, SIGHUP
    reloads the configuration from it. ``sock``: a listening socket bound already
    (default: bind ``config.listen`` now). ``gateway``: the gateway to serve
    (default: one built from ``config`` and ``config_path``). ``extra_sockets``: more
    listening sockets serving the same application (a worker's own metrics port).
    ``listen.probe_port``: bound here too (``SO_REUSEPORT`` when ``sock`` has it, so
    every worker serves it), answering only the probes.
    ``tls``: serve HTTPS with this certificate and key file.
    Logging is configured from ``config.logging`` first (uvicorn's records included).
    """
    from pd_orchestrator.gateway import Gateway
    from pd_orchestrator.gateway.protocol import count_accept_errors
    from pd_orchestrator.telemetry.logs import configure_logging

    configure_logging(config.logging)
    if sock is None:
        sock = bind_socket(config.listen.host, config.listen.port)
    scheme = "https" if tls is not None else "http"
    url = f"{scheme}://{config.listen.host}:{sock.getsockname()[1]}"
    if gateway is None:
        gateway = Gateway(config, config_path=config_path)
    extra = list(extra_sockets or [])
    probe_port = config.listen.probe_port
    if probe_port is not None:  # bound with the port's own options (workers share it)
        extra.append(bind_socket(config.listen.host, probe_port, reuse_port=sock_reuses(sock)))
    uvicorn_config = uvicorn.Config(
        gateway.app(),
        log_level="warning",
        log_config=None,
        timeout_graceful_shutdown=_CLOSE_SECONDS,  # after the gateway's own drain
        # uvicorn calls the gateway's Listener per connection, as it would a protocol class
        http=cast("type[asyncio.Protocol]", gateway.http_protocol(probe_port)),
        interface="asgi3",
        proxy_headers=False,
        server_header=False,
        access_log=False,
        ssl_certfile=None if tls is None else str(tls[0]),
        ssl_keyfile=None if tls is None else str(tls[1]),
    )
    server = _DrainingServer(uvicorn_config, gateway.drain, config.lifecycle.drain_seconds)
    tracing = "on" if gateway.tracing is not None else "off"

    async def main() -> None:
        _tune_gc()
        count_accept_errors(asyncio.get_running_loop(), gateway.metrics.count_resource_error)
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock, *extra])
            while not server.started:  # noqa: ASYNC110 - uvicorn exposes no event
                await anyio.sleep(0.02)
            if sigterm_seen():  # stopped before uvicorn took the signals over
                server.should_exit = True
                return
            logger.info(
                "pd-orchestrator %s serving on %s (%s, %d endpoints, tracing %s)",
                __version__, url, config.mode, len(config.fleet()), tracing,
            )  # fmt: skip
            announced = (on_ready or _announce)(url)
            if inspect.isawaitable(announced):
                await announced

    anyio.run(main, backend_options={"use_uvloop": True})


def sock_reuses(sock: socket.socket) -> bool:
    """Whether ``sock`` was bound with ``SO_REUSEPORT`` (a worker's shared port)."""
    return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT))


def _tune_gc() -> None:
    """Collect less often: a request allocates a few hundred short-lived objects, and
    with the default thresholds the collector ran every few requests. What exists
    at start-up (modules, configuration, plans' building blocks) is frozen out of
    every collection."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


def _announce(url: str) -> None:
    print(f"READY {url}", flush=True)


def run_serve(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    config = load_checked(args.config, console)
    if config is None:
        return 2
    missing = [e.name for e in config.endpoints() if e.url is None]
    if missing:
        console.print(f"[bold red]error:[/] endpoints without a url: {', '.join(missing)}")
        return 2
    config = with_logging(with_listen(config, args.host, args.port), args)
    if args.workers is not None:
        listen = config.listen.model_copy(update={"workers": args.workers})
        config = config.model_copy(update={"listen": listen})
    if config.listen.workers > 1:
        from pd_orchestrator.cli.workers import serve_workers

        return serve_workers(config, serve_gateway, _announce, args.config)
    exit_on_sigterm()
    serve_gateway(config, config_path=args.config)
    return 0


def run_check_config(args: argparse.Namespace) -> int:
    console = Console()
    config = load_checked(args.config, Console(stderr=True))
    if config is None:
        return 2
    console.print(endpoint_table(config, title=f"{args.config}: valid"))
    rest = {k: v for k, v in config.public_dict().items() if k not in ("decoders", "prefillers")}
    console.print_json(json.dumps(rest))
    return 0


def endpoint_table(config: GatewayConfig, title: str) -> RenderableType:
    """The fleet as a table that reads at 80 columns: name, role, pool, hardware (with
    the compatibility group when it differs), KV connector, URL (or ``sim PROFILE``); the
    served model below it (several: each with its pools) rather than as a wide column."""
    table = Table(
        title=title,
        title_justify="left",
        box=None,
        pad_edge=False,
        padding=(0, 2, 0, 0),
        header_style="bold underline",
    )
    for column in ("name", "role", "pool", "hardware", "kv"):
        table.add_column(column, no_wrap=True)
    table.add_column("url", overflow="fold")  # a long URL folds rather than cut a name
    models: dict[str, list[str]] = {}
    for e in config.fleet():
        hardware = e.hardware if e.group in (e.hardware, "default") else f"{e.hardware}/{e.group}"
        url = e.url or f"sim {e.sim.profile if e.sim else '?'}"
        table.add_row(e.name, e.role, e.pool, hardware, e.connector, url)
        pools = models.setdefault(_model_of(e), [])
        if e.pool not in pools:
            pools.append(e.pool)
    if len(models) == 1:
        return Group(table, Text.assemble(("model ", "bold"), *models))
    lines = [Text.assemble(("model ", "bold"), m, f"  ({', '.join(p)})") for m, p in models.items()]
    return Group(table, *lines)


def _model_of(endpoint: FleetEndpoint) -> str:
    if endpoint.model:
        return endpoint.model
    return resolve_profile(endpoint.sim.profile).model if endpoint.sim else "(any)"
