"""Allow-list entries and the pure matcher of hosts a request may name (sidecar mode).

Entries: ``host:port`` (that port only), ``host`` (any port: llm-d's allow-list holds
hosts), a network such as ``10.1.0.0/16``, or a DNS name (allowed itself, and the
addresses it resolves to once :class:`~pd_orchestrator.fleet.allowlist.AllowListKeeper`
resolved them). ``#`` starts a comment.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["AllowList", "parse_entries", "split_host_port"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def split_host_port(value: str) -> tuple[str, int | None]:
    """``host:port`` (``[v6]:port``) or a bare host, lower-cased; ValueError if bad."""
    value = value.strip().lower()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port = rest.removeprefix(":") if rest.startswith(":") else ""
    elif value.count(":") == 1:
        host, _, port = value.partition(":")
    else:
        host, port = value, ""
    if not host or (port and not port.isdigit()) or (port and not 0 < int(port) < 65536):
        raise ValueError(f"{value!r} is not host, host:port or a network")
    return host, int(port) if port else None


@dataclass(frozen=True, slots=True)
class AllowList:
    """Allowed ``(host, port)`` pairs, hosts (any port) and networks (pure)."""

    pairs: frozenset[tuple[str, int]] = frozenset()
    hosts: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()
    names: frozenset[str] = field(default=frozenset(), compare=False)
    everything: bool = False

    def allows(self, host: str, port: int) -> bool:
        """Whether ``host:port`` may be connected to."""
        host = host.lower()
        if self.everything or host in self.hosts or (host, port) in self.pairs:
            return True
        if not self.networks:
            return False
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self.networks)

    def with_addresses(self, addresses: Iterable[str]) -> AllowList:
        """This list, also allowing ``addresses`` (what its DNS names resolve to)."""
        return AllowList(
            self.pairs, self.hosts | frozenset(addresses), self.networks, self.names,
            self.everything,
        )  # fmt: skip


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def parse_entries(entries: Iterable[str], *, everything: bool = False) -> AllowList:
    """An :class:`AllowList` of ``entries`` (see the module docstring); ValueError
    names the first bad one."""
    pairs: set[tuple[str, int]] = set()
    hosts: set[str] = set()
    networks: list[Network] = []
    names: set[str] = set()
    for raw in entries:
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        if "/" in entry:
            networks.append(ipaddress.ip_network(entry, strict=False))
            continue
        host, port = split_host_port(entry)
        if port is not None:
            pairs.add((host, port))
        else:
            hosts.add(host)
        if not _is_address(host):
            names.add(host)
    return AllowList(frozenset(pairs), frozenset(hosts), tuple(networks), frozenset(names),
                     everything)  # fmt: skip
