"""Other routers run as baselines by the benchmarks: vllm-router and SMG, from PyPI.

Each peer lives in its own venv under the cache directory (``$PDO_CACHE_DIR``, else
``${XDG_CACHE_HOME:-~/.cache}/pd-orchestrator``), named ``<package>-<version>``:
built with pip on first use, reused afterwards, never inside the clone.
:func:`start_process` runs a peer (or any server that does not print a READY
line) in its own process group with its output in a log file; stop it with
:func:`pd_orchestrator.children.stop_child`.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pd_orchestrator.children import Child
from pd_orchestrator.model.records import record

__all__ = [
    "SMG",
    "VLLM_ROUTER",
    "Peer",
    "cache_root",
    "free_port",
    "peer_executable",
    "start_process",
]


@record
class Peer:
    """A router published on PyPI: its package, pinned version and console script."""

    package: str
    version: str
    script: str

    @property
    def venv_name(self) -> str:
        return f"{self.package}-{self.version}"


VLLM_ROUTER = Peer("vllm-router", "0.1.17", "vllm-router")
SMG = Peer("smg", "1.13.0", "smg")


def cache_root() -> Path:
    """Where heavy installs are cached, outside the clone."""
    explicit = os.environ.get("PDO_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pd-orchestrator"


def peer_executable(peer: Peer, python: str = sys.executable) -> Path:
    """``peer``'s console script in its cached venv (built on first use).

    Raises ``RuntimeError`` with pip's output when the install fails.
    """
    venv = cache_root() / peer.venv_name
    executable = venv / "bin" / peer.script
    if executable.exists():
        return executable
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True, capture_output=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    installed = subprocess.run(
        [*pip, "--disable-pip-version-check", f"{peer.package}=={peer.version}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if installed.returncode != 0 or not executable.exists():
        raise RuntimeError(
            f"installing {peer.package} {peer.version} into {venv} failed:\n"
            f"{installed.stderr[-2000:]}"
        )
    return executable


_EPHEMERAL_LOW = 32768
"""Where the kernel's own port picks start when it cannot say (Linux's default)."""

_LOWEST_PORT = 10000
"""The lowest port handed out: above the well-known and most registered ones."""

_handed_out: set[int] = set()
_ports = random.Random()


def _ephemeral_low(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The first port the kernel may pick for a ``bind(0)`` or an outgoing connect."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_LOW


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a child to bind, from where the kernel never
    picks one itself.

    A child binds its port some time after it starts (a vLLM server, tens of seconds).
    A port the kernel hands out for ``bind(0)`` lies in its ephemeral range, where any
    outgoing connect or ``bind(0)`` meanwhile may be given it, and the child then dies
    with "Address already in use". So the port comes from below that range, and this
    process never hands the same one out twice. Only an explicit bind to the same
    number could still take it.
    """
    high = _ephemeral_low()
    for _ in range(200 if high > _LOWEST_PORT else 0):
        port = _ports.randrange(_LOWEST_PORT, high)
        if port not in _handed_out and _bindable(host, port):
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))  # no room below the kernel's range: take its pick
        picked: int = sock.getsockname()[1]
        return picked


def start_process(name: str, argv: Sequence[str], url: str) -> Child:
    """Start ``argv`` in its own process group, stdout and stderr to a log file.

    ``url`` is where it will listen; the caller waits for it to answer.
    """
    log = tempfile.NamedTemporaryFile(mode="w", prefix=f"{name}-", suffix=".log", delete=False)
    process = subprocess.Popen(
        list(argv),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        process_group=0,  # one session, one scheduling group: see children.py
        text=True,
    )
    log.close()
    return Child(name, url, process, Path(log.name))
