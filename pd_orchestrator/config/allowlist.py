"""Allow-list entries and the pure matcher of hosts a request may name (sidecar mode).

Entries: ``host:port`` (that port only), ``host`` (any port: llm-d's allow-list holds
hosts), a network such as ``10.1.0.0/16``, or a DNS name (allowed itself, and the
addresses it resolves to once :class:`~pd_orchestrator.fleet.allowlist.AllowListKeeper`
resolved them -- on the entry's port only, when the entry names one). ``#`` starts a
comment.

A host is a DNS name (letters, digits, ``-`` and ``.``), an IPv4 address or a
bracketed IPv6 address; an IPv6 zone (``%...``) is refused, in entries and in the
headers a request sends alike (a zone names an interface of the machine that reads
it, and its free text would otherwise ride past the allow-list).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import field

from pd_orchestrator.model.records import record

__all__ = ["AllowList", "parse_entries", "split_host_port"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_NAME = re.compile(r"[a-z0-9](?:[a-z0-9\-]{0,62})(?:\.[a-z0-9](?:[a-z0-9\-]{0,62}))*\.?")


def _host(host: str, bracketed: bool) -> str:
    """``host`` checked (ValueError if it is no DNS name, IPv4 or, bracketed, IPv6
    address without a zone), in its canonical form."""
    if bracketed:
        if "%" in host:
            raise ValueError("an IPv6 zone is not allowed")
        return str(ipaddress.IPv6Address(host))
    if len(host) > 253 or _NAME.fullmatch(host) is None:
        raise ValueError(f"{host!r} is no host name or address")
    return host


def split_host_port(value: str) -> tuple[str, int | None]:
    """``host:port`` (``[v6]:port``) or a bare host, lower-cased and checked (see the
    module docstring); ValueError if bad, saying why."""
    try:
        return _split(value.strip().lower())
    except ValueError as exc:
        raise ValueError(f"{value.strip()!r} is not host, host:port or a network ({exc})") from None


def _split(value: str) -> tuple[str, int | None]:
    bracketed = value.startswith("[")
    if bracketed:
        host, closed, rest = value[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ValueError("not [v6]:port")
        port = rest[1:]
    elif value.count(":") == 1:
        host, _, port = value.partition(":")
    else:  # a bare host: a name, or an IPv6 address without brackets (no port then)
        host, port, bracketed = value, "", ":" in value
    if value.endswith(":") or (
        port and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536)
    ):
        raise ValueError("no valid port")
    return _host(host, bracketed), int(port) if port else None


@record
class AllowList:
    """Allowed ``(host, port)`` pairs, hosts (any port) and networks (pure).

    ``names`` maps each DNS name of the entries to the ports it was allowed on (None:
    any port), so the addresses it resolves to are allowed on those ports only.
    """

    pairs: frozenset[tuple[str, int]] = frozenset()
    hosts: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()
    names: Mapping[str, frozenset[int | None]] = field(default_factory=dict, compare=False)
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

    def with_addresses(self, resolved: Mapping[str, Iterable[str]]) -> AllowList:
        """This list, also allowing what each DNS name resolved to (``resolved``: name
        -> addresses), on the ports the name itself is allowed on."""
        pairs, hosts = set(self.pairs), set(self.hosts)
        for name, addresses in resolved.items():
            ports = self.names.get(name, frozenset())
            for address in addresses:
                for port in ports:
                    if port is None:
                        hosts.add(address)
                    else:
                        pairs.add((address, port))
        return AllowList(
            frozenset(pairs), frozenset(hosts), self.networks, self.names, self.everything
        )


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
    names: dict[str, set[int | None]] = {}
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
            names.setdefault(host, set()).add(port)
    frozen = {name: frozenset(ports) for name, ports in names.items()}
    return AllowList(frozenset(pairs), frozenset(hosts), tuple(networks), frozen, everything)
