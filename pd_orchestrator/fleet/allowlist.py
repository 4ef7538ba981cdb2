"""Which hosts a request may name as its prefiller or KV source (sidecar mode).

A request names instances in headers (llm-d's ``x-prefiller-host-port`` and
``x-kv-cache-source-host-port``); the gateway and the decoder would then connect to
them, so every one is checked against the allow-list first (403 otherwise): no
client can make either connect to a host the configuration does not name.

Entries (``sidecar.allowed_prefillers``, and the lines of ``sidecar.allowlist_file``:
one entry per line, ``#`` starts a comment):

* ``host:port`` -- that port of that host only;
* ``host`` -- any port of that host (llm-d's allow-list holds hosts, not ports);
* ``10.1.0.0/16`` -- any address of that network (a pod network, say);
* a DNS name -- it and the addresses it resolves to (a headless Service's name
  allows its pods), resolved again every ``allowlist_refresh`` seconds; ``name:port``
  allows those addresses on that port only.

A host is a DNS name, an IPv4 address or a bracketed IPv6 address without a zone;
anything else in a header is a 400, and nothing is contacted.

:class:`~pd_orchestrator.config.allowlist.AllowList` is the pure matcher;
:class:`AllowListKeeper` rebuilds it when the file changes or names resolve
differently (the only I/O).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

from pd_orchestrator.config.allowlist import AllowList, parse_entries

__all__ = ["AllowListKeeper"]

logger = logging.getLogger("pd_orchestrator.gateway")


class AllowListKeeper:
    """The current allow-list: configured entries, the file's, resolved names."""

    def __init__(
        self,
        entries: Iterable[str],
        path: Path | None,
        refresh: float,
        *,
        everything: bool = False,
    ) -> None:
        self._entries = list(entries)
        self.path = path
        self.refresh = refresh
        self.everything = everything
        self._mtime: float | None = None
        self._base = self._build(self._read())
        self.current = self._base

    def _read(self) -> list[str]:
        if self.path is None:
            return []
        stat = self.path.stat()
        self._mtime = stat.st_mtime
        return self.path.read_text().splitlines()

    def _build(self, lines: list[str]) -> AllowList:
        return parse_entries([*self._entries, *lines], everything=self.everything)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Resolve names now, then reload and re-resolve every ``refresh`` seconds."""
        await self._update()
        task_status.started()
        while True:
            await anyio.sleep(self.refresh)
            await self._update()

    async def _update(self) -> None:
        try:
            if self.path is not None and self.path.stat().st_mtime != self._mtime:
                self._base = self._build(self._read())
                logger.info("allow-list reloaded from %s", self.path)
        except (OSError, ValueError) as exc:  # a bad edit keeps the last good list
            logger.warning("allow-list file %s not reloaded: %s", self.path, exc)
        resolved = {name: await _resolve(name) for name in self._base.names}
        self.current = self._base.with_addresses(resolved)


async def _resolve(name: str) -> set[str]:
    try:
        infos = await anyio.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        logger.warning("allow-list name %s does not resolve: %s", name, exc)
        return set()
    return {str(info[4][0]).lower() for info in infos}
