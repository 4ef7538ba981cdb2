"""Several gateway processes on one port (``listen.workers``, ``serve --workers N``).

One Python process relays a few thousand requests a second on one core; with
``workers`` > 1, the parent reserves the port, forks that many workers, and each
binds its own listening socket to the same port with ``SO_REUSEPORT``: the kernel
spreads new connections over them. The parent does no request work: it announces
``READY <url>`` once every worker is serving, forwards SIGTERM, SIGINT and SIGHUP
(reload) to them, and stops them all when one dies.

Each worker is a whole gateway and keeps its own state: health and in-flight
counts, load readings (each polls every endpoint's ``/metrics``), the threshold
policies' controller state and the prompt-length calibration, the prefix routing
state (the approximate index learns only from its own requests; the precise index
follows the KV events, to which every worker subscribes), and its own Prometheus
registry. With ``listen.worker_metrics_port`` P, worker *i* also serves every route
on port P + *i*: scrape each of them (the shared port answers from whichever worker
the connection lands on).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from pd_orchestrator.cli.signals import exit_on_sigterm
from pd_orchestrator.config import GatewayConfig
from pd_orchestrator.sim.server import bind_socket

__all__ = ["serve_workers"]

READY_SECONDS = 120.0
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _reserve(host: str, port: int) -> socket.socket:
    """A bound, not listening, ``SO_REUSEPORT`` socket: it holds the port (``port`` 0
    picks one) without taking connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def _worker(
    index: int,
    config: GatewayConfig,
    port: int,
    config_path: Path | None,
    ready: int,
    serve: Callable[..., None],
) -> None:
    """The body of worker ``index`` (in the child process)."""
    listen = config.listen
    sock = bind_socket(listen.host, port, reuse_port=True)
    extra = []
    if listen.worker_metrics_port is not None:
        extra.append(bind_socket(listen.host, listen.worker_metrics_port + index))

    def announce(url: str) -> None:
        os.write(ready, b"+")

    serve(config, announce, config_path, sock=sock, extra_sockets=extra)


def serve_workers(
    config: GatewayConfig,
    serve: Callable[..., None],
    on_ready: Callable[[str], None],
    config_path: Path | None = None,
) -> int:
    """Run ``config.listen.workers`` gateways (each ``serve(config, announce,
    config_path, sock=..., extra_sockets=...)``) until a signal stops them; returns
    the exit status (non-zero when a worker failed)."""
    listen = config.listen
    reserved = _reserve(listen.host, listen.port)
    port = reserved.getsockname()[1]
    url = f"http://{listen.host}:{port}"
    ready_r, ready_w = os.pipe()
    children: list[int] = []
    for index in range(listen.workers):
        pid = os.fork()
        if pid == 0:  # the worker
            os.close(ready_r)
            for signum in _FORWARDED:
                signal.signal(signum, signal.SIG_DFL)
            exit_on_sigterm()
            status = 0
            try:
                _worker(index, config, port, config_path, ready_w, serve)
            except BaseException as exc:
                status = 1
                print(f"worker {index} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            finally:
                os._exit(status)
        children.append(pid)
    os.close(ready_w)
    return _supervise(children, reserved, ready_r, url, on_ready)


def _supervise(
    children: list[int],
    reserved: socket.socket,
    ready: int,
    url: str,
    on_ready: Callable[[str], None],
) -> int:
    stopping = False

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = stopping or signum != signal.SIGHUP
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    for signum in _FORWARDED:
        signal.signal(signum, forward)
    alive = set(children)
    status = 0
    if _wait_ready(ready, alive):
        reserved.close()
        on_ready(url)
    else:
        print("not every worker started (see above), stopping the others", file=sys.stderr)
        status = 1
        stopping = True
        forward(signal.SIGTERM, None)
    while alive:
        try:
            pid, code = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        alive.discard(pid)
        if code != 0 or not stopping:
            status = 1
            if not stopping:  # a worker died on its own: the others go too
                forward(signal.SIGTERM, None)
    return status


def _wait_ready(ready: int, alive: set[int]) -> bool:
    """Until every worker in ``alive`` announced itself on the ``ready`` pipe; False
    when one exits first (it is taken out of ``alive``) or after ``READY_SECONDS``."""
    deadline = time.monotonic() + READY_SECONDS
    seen = 0
    while seen < len(alive):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        readable, _, _ = select.select([ready], [], [], min(left, 0.2))
        if readable:
            data = os.read(ready, len(alive))
            if not data:
                return False
            seen += len(data)
            continue
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            alive.discard(pid)
            return False
    return True
