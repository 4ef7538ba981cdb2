"""Reloading the gateway of ``pd-orchestrator up`` without losing its simulators.

``up`` resolves every simulated endpoint (no ``url``, a ``sim`` block) to the URL of
the simulator it started. The gateway reloads from a file, so ``up`` keeps a
*resolved* copy of the user's file in its run directory: the same YAML, with the
``url`` (and ``model``) of each running simulator written into its endpoint.
:class:`UpGateway` rewrites that copy from the user's file before every reload
(SIGHUP or ``POST /admin/reload``), then lets the gateway reload it.

A reload that names an endpoint with neither a ``url`` nor a running simulator is
refused (``up`` starts simulators only when it starts); the running configuration
stays, as for any invalid file.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import yaml

from pd_orchestrator.config import ConfigError, GatewayConfig
from pd_orchestrator.config.loader import parse_config
from pd_orchestrator.gateway import Gateway
from pd_orchestrator.gateway.state import ReloadResult

__all__ = ["Simulated", "UpGateway", "keep_simulated", "write_resolved"]


@dataclasses.dataclass(frozen=True, slots=True)
class Simulated:
    """What a running simulator serves: its URL and model."""

    url: str
    model: str


_ENDPOINT_LISTS = ("decoders", "prefillers")


def _endpoint_entries(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every endpoint mapping of a raw config document (pools and the v1 lists)."""
    entries: list[Any] = []
    for pool in data.get("pools") or []:
        if isinstance(pool, dict):
            entries.extend(pool.get("endpoints") or [])
    for key in _ENDPOINT_LISTS:
        entries.extend(data.get(key) or [])
    return [entry for entry in entries if isinstance(entry, dict)]


def keep_simulated(
    data: dict[str, Any], simulated: Mapping[str, Simulated], shared_url: str | None = None
) -> dict[str, Any]:
    """Write each running simulator's URL and model into the endpoint of its name
    that has no ``url``, and ``shared_url`` (the NATS server ``up`` started) as
    ``shared_state.url`` unless the document names one (a copy; ``data`` is not
    changed)."""
    document = copy.deepcopy(data)
    for entry in _endpoint_entries(document):
        running = simulated.get(str(entry.get("name")))
        if running is not None and entry.get("url") is None:
            entry["url"] = running.url
            entry["model"] = running.model
    if shared_url is not None:
        shared = document.get("shared_state")
        if not isinstance(shared, dict):
            shared = document["shared_state"] = {}
        if shared.get("url") is None:
            shared["url"] = shared_url
    return document


def _read(source: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(source.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {source}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the document must be a mapping")
    return data


def write_resolved(
    source: Path,
    target: Path,
    simulated: Mapping[str, Simulated],
    shared_url: str | None = None,
) -> GatewayConfig:
    """Validate ``source``, write it to ``target`` with the simulators' URLs (and
    ``shared_url``: :func:`keep_simulated`), and return the resolved configuration.

    Raises :class:`ConfigError` (naming ``source``) when the file is invalid or an
    endpoint has no URL and no running simulator. ``target`` is replaced atomically.
    """
    data = _read(source)
    parse_config(data, str(source))  # errors name the user's file, not the copy
    document = keep_simulated(data, simulated, shared_url)
    config = parse_config(document, str(source))
    missing = [e.name for e in config.fleet() if e.url is None]
    if missing:
        raise ConfigError(
            f"{source}: no url and no running simulator for {', '.join(missing)} "
            "(`up` starts simulators when it starts: restart it to add one)"
        )
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text(yaml.safe_dump(document, sort_keys=False))
    os.replace(partial, target)
    return config


class UpGateway(Gateway):
    """The gateway of ``up``: reloads ``source`` and keeps the simulators' URLs.

    ``resolved`` is the gateway's ``config_path`` (the copy it reloads from).
    """

    def __init__(
        self,
        config: GatewayConfig,
        *,
        source: Path,
        resolved: Path,
        simulated: Mapping[str, Simulated],
        shared_url: str | None = None,
    ) -> None:
        super().__init__(config, config_path=resolved)
        self.source = source
        self.resolved = resolved
        self.simulated = dict(simulated)
        self.shared_url = shared_url
        self._rewrite_lock = anyio.Lock()

    async def reload(self) -> ReloadResult:
        """Rewrite the resolved copy from ``source``, then reload it (see
        :meth:`Gateway.reload`); messages name ``source``."""
        async with self._rewrite_lock:
            try:
                write_resolved(self.source, self.resolved, self.simulated, self.shared_url)
            except ConfigError as exc:
                self.metrics.reloads.labels("refused").inc()
                return ReloadResult(False, f"refused, the old configuration stays: {exc}")
            result = await super().reload()
        message = result.message.replace(str(self.resolved), str(self.source))
        return dataclasses.replace(result, message=message)
