"""Child processes that announce readiness on stdout (simulators, gateways).

A child prints ``READY <url>`` once it accepts requests. :func:`start_child` waits
for that line (bounded), :func:`stop_child` stops the child's whole process group
(SIGTERM, then SIGKILL after a grace period). Output other than the READY line goes
to a log file whose tail is quoted when a child fails to start.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Child", "ChildStartError", "python_command", "start_child", "stop_child"]

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
    timeout: float = 30.0,
    log_dir: Path | None = None,
) -> Child:
    """Start ``argv`` in its own process group and wait for its READY line."""
    log = tempfile.NamedTemporaryFile(
        mode="w", prefix=f"{name}-", suffix=".log", dir=log_dir, delete=False
    )
    process = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=log,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        text=True,
        start_new_session=True,
    )
    log.close()
    child = Child(name=name, url="", process=process, log_path=Path(log.name))
    try:
        child.url = _await_ready(child, timeout)
    except BaseException:
        stop_child(child)
        raise
    return child


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
                raise ChildStartError(
                    f"{child.name} exited with {child.process.wait(5)} before it was ready:\n"
                    f"{child.log_tail()}"
                )
            pending += data
            for line in pending.split(b"\n")[:-1]:
                text = line.decode(errors="replace")
                if text.startswith(_READY):
                    return text[len(_READY) :].strip()
            pending = pending.rsplit(b"\n", 1)[-1]
    raise ChildStartError(f"{child.name} was not ready after {timeout:.0f}s:\n{child.log_tail()}")


def stop_child(child: Child, grace: float = 5.0) -> int | None:
    """Stop ``child`` and its process group; returns its exit status."""
    process = child.process
    if process.poll() is None:
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            process.wait(grace)
    if process.stdout is not None:
        process.stdout.close()
    return process.returncode


def _signal_group(process: subprocess.Popen[str], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
