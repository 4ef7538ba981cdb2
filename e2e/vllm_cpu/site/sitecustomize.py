"""Started in every process of a test server (``pair.py`` puts this folder on its
``PYTHONPATH``): the NIXL agent's progress thread waits for UCX events instead of
polling without a pause.

nixl's Python API (1.5.1) creates every agent with a progress thread and
``pthrDelay = 0``; that thread's ``poll()`` then has a timeout of 0 ms, so an idle
server spends one core in ``epoll_wait``/``poll`` (mostly system time). On the 2-core
test host two idle NIXL servers take the whole machine, and a pair started while
another is up (a module's own pair beside the session's) does not get through its
start-up in time. With a delay the thread sleeps in ``poll()`` on the UCX workers'
event fds, which UCX signals when there is work, so hand-overs are not delayed; the
delay only bounds how long the thread sleeps with nothing signalled.

``PDO_E2E_NIXL_PROGRESS_DELAY_US`` (microseconds, default 1000; 0 keeps nixl's
busy poll) sets it. Nothing is imported until vLLM imports nixl.

A server bound to cores (``VLLM_CPU_OMP_THREADS_BIND``, as ``pair.py`` binds the
prefiller to core 0 and the decoder to core 1) also keeps its threads on them.
vLLM 0.32's NIXL worker on CPU calls ``os.sched_setaffinity(0, ...)`` at start-up with
the last core of each NUMA node ("reserved for KV transfer"); the call binds the
calling thread, which is the worker's main thread, the one that runs the model. On a
2-core host that moves the prefiller's model thread onto the decoder's core, and
while the decoder decodes a prefill waits for it: a 1024-token prefill leg took 6.2 s
beside a stream (its usual 30 to 60 ms) and answered when the stream ended. Here
such a call is confined to the server's own cores (the cores asked for that are among
them, else all of them).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

_DELAY_US = int(os.environ.get("PDO_E2E_NIXL_PROGRESS_DELAY_US", "1000"))
_BINDINGS = ("nixl_cu13._bindings", "nixl_cu12._bindings", "nixl._bindings")


def _patch(module: ModuleType) -> None:
    """``module.nixlAgent`` given a progress-thread delay where nixl asked for none."""
    real = module.nixlAgent
    if getattr(real, "__pdo_delay__", None) is not None:
        return

    def agent(name: str, config: Any) -> Any:
        if config.useProgThread and config.pthrDelay == 0:
            config.pthrDelay = _DELAY_US
        return real(name, config)

    agent.__pdo_delay__ = _DELAY_US  # type: ignore[attr-defined]
    module.nixlAgent = agent


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _BINDINGS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def bound_cores(spec: str) -> frozenset[int]:
    """The CPUs a ``VLLM_CPU_OMP_THREADS_BIND`` value names (``0``, ``0-3``, ``0,2``,
    ranks joined by ``|``); empty for any other value (unset, ``auto``, ``nobind``)."""
    cores: set[int] = set()
    for part in spec.replace("|", ",").split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or not (last.isdigit() or not last):
            return frozenset()
        cores.update(range(int(first), int(last or first) + 1))
    return frozenset(cores)


def _confine(cores: frozenset[int]) -> None:
    """``os.sched_setaffinity`` kept within ``cores``: the cores asked for among them,
    else all of them."""
    real = os.sched_setaffinity

    def setaffinity(pid: int, mask: Any) -> None:
        real(pid, (set(mask) & cores) or cores)

    os.sched_setaffinity = setaffinity


if _DELAY_US > 0:
    sys.meta_path.insert(0, _Finder())
_CORES = bound_cores(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""))
if _CORES:
    _confine(_CORES)
