"""How a simulated instance hands KV over, per vLLM connector (``sim --kv-connector``).

The simulator speaks each connector's ``kv_transfer_params`` as vLLM 0.33 does (see
the adapters in ``connectors/``) and moves block hashes instead of KV over side
channels on its own HTTP port. ``--kv-connector`` takes a connector spec:
``nixl``, ``nixl-push``, ``mooncake``, ``moriio``, ``offloading``, ``lmcache``,
``example`` or ``multi:A,B`` (the children in vLLM's MultiConnector order).

Producer side (the prefill leg): a request that names a consumer is held, when it
finishes by length, under the keys the consumer will name it by:

========== ============================================ ==========================
connector  producer request                             held under
========== ============================================ ==========================
nixl       ``do_remote_decode``                         its request id
nixl-push  ``do_remote_decode``                         its request id without
                                                        vLLM's ``-xxxxxxxx`` suffix
mooncake   ``do_remote_decode`` + ``transfer_id``       the transfer id
moriio     ``do_remote_decode`` + ``transfer_id``       the transfer id
offloading ``remote_decoder.kv_request_id``             that id
========== ============================================ ==========================

and answers the params vLLM answers (``nixl``/``nixl-push``/``moriio``; none for
``mooncake`` and ``offloading``). Only a prefill that ended by length is held (vLLM
0.33's NIXL connectors also hold one whose first token was EOS; the simulator keeps
the rule of 0.32, which the CPU pair runs). ``lmcache`` and ``example`` save to a shared store
(``--kv-shared-dir``) instead.

Consumer side (the decode leg), before the request is scheduled:

* ``nixl``: ``POST http://remote_host:remote_port/nixl/pull`` -- the blocks must be
  held already (the legs ran in sequence);
* ``nixl-push``: ``POST .../nixl/push`` with the decoder's own base request id (the
  "registration"); the producer answers once it holds that id (the "write");
* ``mooncake``: ``GET remote_bootstrap_addr/query`` (the engine id must be listed),
  then ``POST <worker_addr>/mooncake/pull`` with the transfer id, answered once held;
* ``moriio``: ``POST http://remote_host:remote_notify_port/moriio/notify`` with the
  transfer id (the decoder's "blocks ready" notice), answered once held;
* ``offloading``: ``POST http://remote_host:remote_port/p2p/fetch`` with the
  ``remote_prefiller`` id, answered once held; a ``remote_kv_source`` is probed
  with ``POST .../p2p/lookup`` (how many of the prompt's blocks its prefix cache
  holds) and those are loaded;
* ``lmcache``/``example``: the engine looks the prompt up in the shared store.

A claim waits up to ``--lease-seconds`` for a producer still computing (legs run
together). The consumer then waits the profile's transfer time for the blocks it
lacks and is scheduled with them as external (connector) hits. A failed transfer
fails the request (500) or, with ``--kv-load-failure-policy recompute``, is
computed locally.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from pd_orchestrator.model.records import record
from pd_orchestrator.sim.engine import ComposedKV, ExternalKV, HeldTransfer, PulledKV
from pd_orchestrator.sim.kvstore import DirectoryKeys, LMCacheStore, SharedKVStore
from pd_orchestrator.sim.options import SimOptions, connector_names

__all__ = [
    "STORES",
    "TRANSFERS",
    "Advertised",
    "FetchPlan",
    "Fetched",
    "TransferFailed",
    "base_request_id",
    "external_kv",
    "fetch",
    "held_by",
    "hold_keys",
    "plan_fetch",
    "producer_params",
]

TRANSFERS = frozenset({"nixl", "nixl-push", "mooncake", "moriio", "offloading"})
STORES = frozenset({"lmcache", "example"})

_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


class TransferFailed(Exception):
    """The consumer could not get the producer's blocks (the message says why)."""


def base_request_id(request_id: str) -> str:
    """A request id without vLLM's random ``-xxxxxxxx`` suffix (what push matches on)."""
    return _RANDOM_SUFFIX.sub("", request_id)


def external_kv(options: SimOptions) -> ExternalKV | None:
    """The engine's connector view: shared stores and fetched blocks, in spec order."""
    names = connector_names(options.kv_connector)
    if not names or not any(n in STORES for n in names):
        return None
    directory = options.kv_shared_dir or Path(tempfile.gettempdir()) / "pd-orchestrator-kv"
    keys = DirectoryKeys(directory)
    parts: list[ExternalKV] = []
    for name in names:
        if name == "example":
            parts.append(SharedKVStore(keys, options.block_size))
        elif name == "lmcache":
            parts.append(LMCacheStore(keys, options.block_size, options.lmcache_chunk_size))
        elif not parts or not isinstance(parts[-1], PulledKV):
            parts.append(PulledKV())
    return parts[0] if len(parts) == 1 else ComposedKV(parts)


# -- producer side ---------------------------------------------------------------------
def hold_keys(names: Sequence[str], params: dict[str, Any], request_id: str) -> tuple[str, ...]:
    """The keys a producer request is held under (empty: it is not a producer)."""
    keys: list[str] = []
    remote_decode = bool(params.get("do_remote_decode"))
    transfer_id = params.get("transfer_id")
    for name in names:
        if name == "nixl" and remote_decode:
            keys.append(f"nixl:{request_id}")
        elif name == "nixl-push" and remote_decode:
            keys.append(f"nixl-push:{base_request_id(request_id)}")
        elif name in ("mooncake", "moriio") and remote_decode and transfer_id:
            keys.append(f"{name}:{transfer_id}")
        elif name == "offloading":
            decoder = params.get("remote_decoder")
            if isinstance(decoder, dict) and decoder.get("kv_request_id"):
                keys.append(f"offloading:{decoder['kv_request_id']}")
    return tuple(keys)


@record
class Advertised:
    """How this instance names itself in the params it answers."""

    engine_id: str
    host: str
    port: int


def producer_params(
    names: Sequence[str], held: HeldTransfer, cached: int, me: Advertised
) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` a producer answers (vLLM's ``request_finished``)."""
    merged: dict[str, Any] = {}
    for name in names:
        if held_by(name, held):
            merged |= _params_of(name, held, cached, me)
    return merged or None


def held_by(name: str, held: HeldTransfer) -> bool:
    """Whether connector ``name`` holds ``held`` (one of its keys is that connector's)."""
    return any(key.startswith(f"{name}:") for key in held.keys)


def _params_of(name: str, held: HeldTransfer, cached: int, me: Advertised) -> dict[str, Any]:
    common = {"do_remote_prefill": True, "do_remote_decode": False}
    if name in ("nixl", "nixl-push"):
        params = common | {
            "remote_block_ids": list(held.block_ids),
            "remote_engine_id": me.engine_id,
            "remote_request_id": held.request_id,
            "remote_host": me.host,
            "remote_port": me.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": held.num_tokens,
            "transfer_mode": "pull" if name == "nixl" else "push",
            "remote_prefill_cached_tokens": cached,
        }
        return params
    if name == "moriio":
        transfer_id = next(k for k in held.keys if k.startswith("moriio:"))[len("moriio:") :]
        return common | {
            "remote_block_ids": list(held.block_ids),
            "remote_engine_id": f"{me.host}:{me.port}",
            "remote_host": me.host,
            "remote_handshake_port": me.port,
            "remote_notify_port": me.port,
            "remote_dp_rank": 0,
            "remote_dp_rank_override": True,
            "remote_dp_size": 1,
            "remote_dp_size_local": 1,
            "tp_size": 1,
            "transfer_id": transfer_id,
        }
    return {}  # mooncake, offloading: vLLM answers no params


# -- consumer side ---------------------------------------------------------------------
@record
class Fetched:
    """What a consumer got: the producer's prompt block hashes and prompt length."""

    block_hashes: tuple[bytes, ...]
    num_tokens: int


@record
class FetchPlan:
    """One side-channel call: which connector, where, and what to send."""

    connector: str
    url: str
    payload: dict[str, Any]
    bootstrap: str | None = None  # mooncake: ask /query here first


def _require(params: dict[str, Any], name: str, *keys: str) -> None:
    missing = [k for k in keys if k not in params or params[k] is None]
    if missing:
        raise TransferFailed(f"{name}: kv_transfer_params lacks {', '.join(missing)}")


def _url(host: Any, port: Any, path: str) -> str:
    shown = f"[{host}]" if ":" in str(host) else str(host)
    return f"http://{shown}:{int(port)}{path}"


def plan_fetch(names: Sequence[str], params: dict[str, Any], request_id: str) -> FetchPlan | None:
    """The side-channel call a consumer request makes, if any (first matching child)."""
    for name in names:
        plan = _plan_one(name, params, request_id)
        if plan is not None:
            return plan
    return None


def _plan_one(name: str, params: dict[str, Any], request_id: str) -> FetchPlan | None:
    remote_prefill = bool(params.get("do_remote_prefill"))
    if name == "nixl" and remote_prefill and params.get("remote_block_ids"):
        _require(
            params, name, "remote_engine_id", "remote_request_id", "remote_host", "remote_port"
        )
        payload = {
            "remote_request_id": params["remote_request_id"],
            "remote_engine_id": params["remote_engine_id"],
            "remote_block_ids": params.get("remote_block_ids"),
        }
        return FetchPlan(
            name, _url(params["remote_host"], params["remote_port"], "/nixl/pull"), payload
        )
    if name == "nixl-push" and remote_prefill:
        _require(params, name, "remote_engine_id", "remote_host", "remote_port", "tp_size")
        if "remote_request_id" not in params:  # vLLM indexes the key (KeyError)
            raise TransferFailed("nixl-push: kv_transfer_params lacks remote_request_id")
        payload = {
            "request_id": base_request_id(request_id),
            "remote_engine_id": params["remote_engine_id"],
        }
        return FetchPlan(
            name, _url(params["remote_host"], params["remote_port"], "/nixl/push"), payload
        )
    if name == "mooncake" and remote_prefill and params.get("remote_bootstrap_addr"):
        _require(params, name, "remote_engine_id", "transfer_id")
        payload = {
            "transfer_id": params["transfer_id"],
            "remote_engine_id": params["remote_engine_id"],
        }
        return FetchPlan(name, "", payload, bootstrap=str(params["remote_bootstrap_addr"]))
    if name == "moriio" and remote_prefill and params.get("transfer_id"):
        _require(params, name, "remote_host", "remote_notify_port", "remote_engine_id")
        url = _url(params["remote_host"], params["remote_notify_port"], "/moriio/notify")
        return FetchPlan(name, url, {"transfer_id": params["transfer_id"]})
    if name == "offloading":
        for role in ("remote_prefiller", "remote_kv_source"):
            sub = params.get(role)
            if isinstance(sub, dict) and sub.get("kv_request_id"):
                _require(sub, f"offloading {role}", "remote_host", "remote_port")
                path = "/p2p/fetch" if role == "remote_prefiller" else "/p2p/lookup"
                url = _url(sub["remote_host"], sub["remote_port"], path)
                return FetchPlan(name, url, {"kv_request_id": sub["kv_request_id"]})
    return None


async def fetch(
    client: httpx.AsyncClient,
    plan: FetchPlan,
    block_size: int,
    prompt_hashes: Sequence[bytes],
) -> Fetched:
    """Run ``plan`` over HTTP; :class:`TransferFailed` on any failure."""
    url = plan.url
    if plan.bootstrap is not None:
        url = await _mooncake_worker(client, plan.bootstrap, str(plan.payload["remote_engine_id"]))
    payload = plan.payload | {"block_size": block_size}
    if url.endswith("/p2p/lookup"):
        payload["block_hashes"] = [h.hex() for h in prompt_hashes]
    try:
        response = await client.post(url, json=payload)
    except httpx.HTTPError as exc:
        raise TransferFailed(f"{plan.connector}: {url}: {exc!r}") from None
    if response.status_code != 200:
        raise TransferFailed(f"{plan.connector}: {url} answered {response.status_code}")
    try:
        data = response.json()
        return Fetched(
            block_hashes=tuple(bytes.fromhex(h) for h in data["block_hashes"]),
            num_tokens=int(data["num_tokens"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise TransferFailed(f"{plan.connector}: bad side-channel answer: {exc!r}") from None


async def _mooncake_worker(client: httpx.AsyncClient, bootstrap: str, engine_id: str) -> str:
    """The worker address of ``engine_id`` from the bootstrap server's ``/query``."""
    try:
        response = await client.get(bootstrap.rstrip("/") + "/query")
        entries = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError) as exc:
        raise TransferFailed(f"mooncake: bootstrap {bootstrap}: {exc!r}") from None
    if not isinstance(entries, dict):
        raise TransferFailed(f"mooncake: bootstrap {bootstrap} answered no engines")
    for entry in entries.values():
        if isinstance(entry, dict) and entry.get("engine_id") == engine_id:
            workers = entry.get("worker_addr") or {}
            for tp_entry in workers.values():
                for addr in tp_entry.values():
                    return str(addr) + "/mooncake/pull"
    raise TransferFailed(f"mooncake: engine {engine_id!r} not found at bootstrap {bootstrap}")
