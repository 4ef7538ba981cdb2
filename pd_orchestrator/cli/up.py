"""``pd-orchestrator up``: the simulators a config declares and the gateway, in one command.

A run, in order:

1. Load and validate the config (plugins included); ``--host``/``--port`` override
   ``listen``.
2. Ports: the gateway's socket is bound now and held until the gateway serves on
   it; every fixed simulator port (``sim.port``) is probed. A busy port is reported
   (all of them, at once) before any simulator starts, and nothing starts.
3. A run directory (``$TMPDIR/pdo-up-*``) holds the simulators' logs (``logs/``),
   the example connector's shared KV folder and the resolved config the gateway
   reloads from. It is removed on exit; when a simulator fails to start, ``logs/``
   stays and its path is printed.
4. A simulator per endpoint without a ``url``, each in its own process group and
   told to die with ``up`` (Linux parent-death signal), so even a SIGKILL of ``up``
   takes them down.
5. The gateway serves on the held socket. SIGHUP (or ``POST /admin/reload``)
   reloads the config file as ``serve`` does; simulated endpoints keep their
   simulator's URL and model (:mod:`pd_orchestrator.cli.up_reload`). A SIGHUP while
   ``up`` starts is remembered and applied once the gateway is ready; one while it
   stops is ignored.
6. Every exit path (Ctrl-C, SIGTERM, an error) stops the simulators.
"""

from __future__ import annotations

import argparse
import errno
import json
import signal
import socket
from collections.abc import Iterator
from contextlib import ExitStack, closing, contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from rich.console import Console

from connectors import parse_spec
from pd_orchestrator.children import (
    Child,
    ChildStartError,
    RunDirectory,
    python_command,
    start_child,
    start_nats_server,
    stop_child,
)
from pd_orchestrator.cli.gateway import (
    endpoint_table,
    load_checked,
    serve_gateway,
    with_listen,
    with_logging,
)
from pd_orchestrator.cli.logs import add_logging_arguments
from pd_orchestrator.cli.signals import exit_on_sigterm
from pd_orchestrator.config import ConfigError, EndpointConfig, GatewayConfig
from pd_orchestrator.config.settings import FleetEndpoint, KvSettings, ListenConfig
from pd_orchestrator.model.measured import resolve_profile
from pd_orchestrator.sim.server import bind_socket

if TYPE_CHECKING:
    from pd_orchestrator.cli.up_reload import Simulated

__all__ = [
    "PortsBusy",
    "add_parser",
    "bind_gateway",
    "busy_simulator_ports",
    "resolve_simulated",
    "run_up",
]

DEFAULT_CONFIG = Path("configs/local.yaml")
SIM_HOST = "127.0.0.1"


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = subparsers.add_parser(
        "up",
        help="start the simulated endpoints a config declares and the gateway",
        description="Start a simulator for every endpoint without a url, then the gateway. "
        "Ctrl-C or SIGTERM stops everything; SIGHUP reloads the config file.",
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
    up.add_argument(
        "--shared-state",
        action="store_true",
        help="start a NATS server for the gateway's shared state (shared_state.url), "
        "unless the config names one",
    )
    add_logging_arguments(up)
    up.set_defaults(handler=run_up)


# -- ports ------------------------------------------------------------------------------------
class PortsBusy(Exception):
    """Ports ``up`` needs are taken; ``problems`` has one line per port."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def bind_gateway(listen: ListenConfig) -> socket.socket:
    """The gateway's listening socket, bound now (``PortsBusy`` when taken)."""
    try:
        return bind_socket(listen.host, listen.port)
    except OSError as exc:
        reason = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise PortsBusy(
            [f"gateway port {listen.host}:{listen.port} is {reason} (choose another with --port)"]
        ) from None


def _can_bind(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the simulator binds
        try:
            probe.bind((SIM_HOST, port))
        except OSError:
            return False
    return True


def busy_simulator_ports(config: GatewayConfig, gateway_port: int) -> list[str]:
    """One line per fixed simulator port that cannot be used: taken by another
    process, by the gateway, or by two simulators of the config."""
    problems: list[str] = []
    seen: dict[int, str] = {}
    for endpoint in config.fleet():
        if endpoint.url is not None or endpoint.sim is None or endpoint.sim.port == 0:
            continue
        port = endpoint.sim.port
        if port in seen:
            problems.append(f"simulator port {port} of {endpoint.name} is {seen[port]}'s too")
        elif port == gateway_port:
            problems.append(f"simulator port {port} of {endpoint.name} is the gateway's")
        elif not _can_bind(port):
            problems.append(f"simulator port {SIM_HOST}:{port} of {endpoint.name} is in use")
        seen.setdefault(port, endpoint.name)
    return problems


# -- simulators -------------------------------------------------------------------------------
def _sim_argv(endpoint: FleetEndpoint, shared_dir: Path) -> list[str]:
    spec = endpoint.sim
    assert spec is not None
    argv = python_command(
        "sim",
        "--host", SIM_HOST,
        "--port", str(spec.port),
        "--profile", spec.profile,
        "--time-scale", str(spec.time_scale),
        "--block-size", str(spec.block_size),
        "--max-num-seqs", str(spec.max_num_seqs),
        "--seed", str(spec.seed),
        "--kv-connector", endpoint.connector,
        "--engine-id", endpoint.name,
        "--model", endpoint.model or resolve_profile(spec.profile).model,
    )  # fmt: skip
    if spec.num_kv_blocks is not None:
        argv += ["--num-kv-blocks", str(spec.num_kv_blocks)]
    if {"example", "lmcache"} & set(parse_spec(endpoint.connector)):
        shared_dir.mkdir(exist_ok=True)
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
    config: GatewayConfig, stack: ExitStack, run: RunDirectory
) -> tuple[GatewayConfig, list[Child]]:
    """Start a simulator for every endpoint without a URL; return the config with URLs
    (and models) and the children, which are stopped when ``stack`` closes. Their
    logs go to ``run.logs``; they die with this process."""
    children: list[Child] = []
    resolved = {e.name: e for e in config.fleet()}

    def resolve(endpoint: EndpointConfig) -> EndpointConfig:
        fleet = resolved[endpoint.name]
        if endpoint.url is not None or fleet.sim is None:
            return endpoint
        argv = _sim_argv(fleet, run.path / "kv")
        child = start_child(endpoint.name, argv, log_dir=run.logs, die_with_parent=True)
        stack.callback(stop_child, child)
        children.append(child)
        model = fleet.model or resolve_profile(fleet.sim.profile).model
        update: dict[str, object] = {"url": child.url, "model": model}
        if endpoint.kv is None:  # a simulator's side channels are on its own port
            update["kv"] = _sim_kv(endpoint.name, child.port)
        return endpoint.model_copy(update=update)

    pools = [
        pool.model_copy(update={"endpoints": [resolve(e) for e in pool.endpoints]})
        for pool in config.pools
    ]
    return config.model_copy(update={"pools": pools}), children


# -- SIGHUP outside the gateway ---------------------------------------------------------------
class _Hangups:
    """Notes SIGHUP while the gateway is not serving (start-up, shutdown)."""

    def __init__(self) -> None:
        self.pending = False

    def note(self, signum: int, frame: FrameType | None) -> None:
        self.pending = True

    def install(self) -> None:
        signal.signal(signal.SIGHUP, self.note)


@contextmanager
def _noting_hangups() -> Iterator[_Hangups]:
    hangups = _Hangups()
    previous = signal.getsignal(signal.SIGHUP)
    hangups.install()
    try:
        yield hangups
    finally:
        signal.signal(signal.SIGHUP, previous)


# -- the command ------------------------------------------------------------------------------
def run_up(args: argparse.Namespace) -> int:
    errors = Console(stderr=True)
    config = load_checked(args.config, errors)
    if config is None:
        return 2
    config = with_logging(with_listen(config, args.host, args.port), args)
    with _noting_hangups() as hangups:
        try:
            sock = bind_gateway(config.listen)
        except PortsBusy as exc:
            _report_busy(errors, exc.problems)
            return 1
        with closing(sock):
            busy = busy_simulator_ports(config, sock.getsockname()[1])
            if busy:
                _report_busy(errors, busy)
                return 1
            exit_on_sigterm()
            return _run(args, config, sock, hangups)


def _report_busy(errors: Console, problems: list[str]) -> None:
    for problem in problems:
        errors.print(f"[bold red]error:[/] {problem}", highlight=False)
    errors.print("nothing was started", highlight=False)


def _run(
    args: argparse.Namespace, config: GatewayConfig, sock: socket.socket, hangups: _Hangups
) -> int:
    from pd_orchestrator.cli.up_reload import UpGateway, write_resolved

    console, errors = Console(), Console(stderr=True)
    with RunDirectory(prefix="pdo-up-") as run, ExitStack() as stack:
        try:
            config, children = resolve_simulated(config, stack, run)
        except (ChildStartError, OSError) as exc:  # one failed start stops the whole demo
            errors.print(f"[bold red]error:[/] {exc}", highlight=False)
            errors.print(f"the simulators' logs are kept in {run.keep_logs()}", highlight=False)
            return 1
        simulated = _simulated(config, children)
        shared_url = None
        if args.shared_state and config.shared_state.url is None:
            try:
                nats = start_nats_server(log_dir=run.logs, die_with_parent=True)
            except (ChildStartError, OSError) as exc:
                errors.print(f"[bold red]error:[/] {exc}", highlight=False)
                return 1
            stack.callback(stop_child, nats)
            shared_url = nats.url
        resolved = run.path / "gateway.yaml"
        try:
            write_resolved(args.config, resolved, simulated, shared_url)
        except ConfigError as exc:  # the file changed while the simulators started
            errors.print(f"[bold red]error:[/] {exc}", highlight=False)
            return 2
        if shared_url is not None:
            shared = config.shared_state.model_copy(update={"url": shared_url})
            config = config.model_copy(update={"shared_state": shared})
        if args.state_file is not None:
            _write_state(args.state_file, config, children)
        gateway = UpGateway(
            config,
            source=args.config,
            resolved=resolved,
            simulated=simulated,
            shared_url=shared_url,
        )
        stack.callback(hangups.install)  # once the gateway stops, SIGHUP is noted again

        async def ready(url: str) -> None:
            console.print(endpoint_table(config, title=f"pd-orchestrator up: {args.config}"))
            console.print(f"logs: {run.logs} (removed on exit)", style="dim", highlight=False)
            console.print(f"gateway on [bold]{url}[/] (Ctrl-C stops everything); try:")
            models = config.models()
            console.print(
                _curl(url, models[0] if models else "MODEL"), highlight=False, soft_wrap=True
            )
            if hangups.pending:
                hangups.pending = False
                result = await gateway.reload()
                console.print(f"SIGHUP during start-up, reload: {result.message}")
            print(f"READY {url}", flush=True)

        serve_gateway(config, ready, sock=sock, gateway=gateway)
    return 0


def _simulated(config: GatewayConfig, children: list[Child]) -> dict[str, Simulated]:
    """The URL and model of each started simulator, by endpoint name."""
    from pd_orchestrator.cli.up_reload import Simulated

    started = {child.name: child.url for child in children}
    return {
        e.name: Simulated(started[e.name], e.model or "")
        for e in config.fleet()
        if e.name in started
    }


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
