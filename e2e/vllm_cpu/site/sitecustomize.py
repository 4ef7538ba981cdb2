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


if _DELAY_US > 0:
    sys.meta_path.insert(0, _Finder())
