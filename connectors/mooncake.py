"""``mooncake``: vLLM's ``MooncakeConnector`` -- the decoder pulls from the prefiller's
Mooncake transfer engine, found through the prefiller's bootstrap server.

What 0.33 does: both legs name the same ``transfer_id``. The prefiller, given
``do_remote_decode`` and a ``transfer_id``, keeps its blocks when it finishes by
length (not on a stop: a first-token EOS is not handed over) and answers **no**
``kv_transfer_params``. The decoder, given ``do_remote_prefill``, the ``transfer_id``,
``remote_bootstrap_addr`` (``http://<prefiller host>:<bootstrap port>``, default
port 8998) and ``remote_engine_id``, asks ``GET <bootstrap>/query`` for the
prefiller's workers (a map ``{dp_rank: {"engine_id", "worker_addr"}}``), fails the
load unless ``remote_engine_id`` is in it, and pulls once the prefiller's request
has finished. The pull waits for the prefill, so the legs run together.

Contract for the executor (order ``TOGETHER``):

* Lookup: while the prefiller's ``engine_id`` is unknown, ``lookups(ctx)`` asks for
  ``GET http://<host>:<bootstrap_port>/query``; its parser picks the entry of the
  prefiller's ``dp_rank`` (else the lowest rank) and returns its engine id and
  rank. Cache it per prefiller (the engine id changes when vLLM restarts without a
  configured ``engine_id``: forget it when a hand-over through that prefiller
  fails). Or configure ``kv.engine_id`` and skip the lookup.
* Send ``prefill_body(body, ctx)`` (``{do_remote_decode: true, do_remote_prefill:
  false, transfer_id}``, header ``X-data-parallel-rank`` when the prefiller runs
  data parallel) and ``decode_body(body, ahead_params(ctx), ctx)`` at once.
* ``read_prefill(answer, ctx)``: ``finished`` (first token was EOS) -> cancel the
  decode leg and serve the prefill answer; otherwise relay the decode leg.
  Run sequentially, the same calls work: ``outcome.params`` is the decode params.

Source: ``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py``
(``update_state_after_alloc``, ``request_finished``, ``MooncakeConnectorMetadata.add_new_req``,
``_connect_to_prefiller_bootstrap``), ``mooncake/mooncake_utils.py``
(``MooncakeBootstrapServer.query``), ``vllm/envs.py`` (``VLLM_MOONCAKE_BOOTSTRAP_PORT``);
llm-d's sidecar (``connector_mooncake.go``) runs the legs at once the same way.
"""

from __future__ import annotations

from typing import Any

from connectors._base import (
    Adapter,
    Body,
    ConnectorError,
    ConnectorInfo,
    Leg,
    LegOrder,
    Lookup,
    MissingContextError,
    Params,
    PeerUpdate,
    PrefillOutcome,
    TransferContext,
    finished_naturally,
    require_ctx,
)

__all__ = ["MooncakeConnector", "bootstrap_addr", "engine_from_query"]


def bootstrap_addr(host: str, port: int) -> str:
    """The ``remote_bootstrap_addr`` value (IPv6 hosts bracketed)."""
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{shown}:{port}"


def engine_from_query(payload: Any, dp_rank: int | None = None) -> PeerUpdate:
    """The engine id and rank from a bootstrap ``/query`` answer.

    The answer maps data-parallel ranks (JSON keys are strings) to entries with an
    ``engine_id``; ``dp_rank`` picks one, else the lowest rank.
    """
    if not isinstance(payload, dict) or not payload:
        raise ConnectorError("mooncake bootstrap /query answered no engine")
    ranks: dict[int, str] = {}
    for key, entry in payload.items():
        if isinstance(entry, dict) and isinstance(entry.get("engine_id"), str):
            try:
                ranks[int(key)] = entry["engine_id"]
            except ValueError:
                continue
    if not ranks:
        raise ConnectorError("mooncake bootstrap /query answered no engine_id")
    rank = dp_rank if dp_rank in ranks else min(ranks)
    return PeerUpdate(engine_id=ranks[rank], dp_rank=rank)


class MooncakeConnector(Adapter):
    name = "mooncake"
    leg_order = LegOrder.TOGETHER

    def describe(self) -> ConnectorInfo:
        return ConnectorInfo(
            name=self.name,
            vllm_connectors=("MooncakeConnector",),
            handovers=frozenset({"mooncake"}),
            leg_order=self.leg_order,
            peer_fields=frozenset({"host", "bootstrap_port", "engine_id", "dp_rank", "dp_size"}),
            prefill_keys=frozenset({"do_remote_decode", "do_remote_prefill", "transfer_id"}),
            address_keys=frozenset({"remote_bootstrap_addr"}),
            decode_keys=frozenset(
                {
                    "do_remote_decode",
                    "do_remote_prefill",
                    "transfer_id",
                    "remote_bootstrap_addr",
                    "remote_engine_id",
                }
            ),
        )

    def lookups(self, ctx: TransferContext) -> tuple[Lookup, ...]:
        peer = ctx.prefiller
        if peer.engine_id is not None:
            return ()
        rank = peer.dp_rank

        def parse(payload: Any) -> PeerUpdate:
            return engine_from_query(payload, rank)

        url = bootstrap_addr(peer.host, peer.bootstrap_port) + "/query"
        return (Lookup(leg=Leg.PREFILL, url=url, parse=parse),)

    def headers(self, leg: Leg, ctx: TransferContext) -> dict[str, str]:
        peer = ctx.prefiller
        if leg is Leg.PREFILL and peer.dp_size > 1:
            return {"X-data-parallel-rank": str(peer.pick_dp_rank(ctx.transfer_id))}
        return {}

    def prefill_params(self, ctx: TransferContext | None) -> Params | None:
        ctx = require_ctx(ctx, self.name)
        return {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": ctx.transfer_id,
        }

    def read_prefill(self, answer: Body, ctx: TransferContext | None = None) -> PrefillOutcome:
        if finished_naturally(answer) or ctx is None:
            return PrefillOutcome(params=None, finished=finished_naturally(answer))
        return PrefillOutcome(params=self.ahead_params(ctx), finished=False)

    def ahead_params(self, ctx: TransferContext) -> Params:
        peer = require_ctx(ctx, self.name).prefiller
        if peer.engine_id is None:
            raise MissingContextError(
                "mooncake needs the prefiller's engine id: run lookups() or configure kv.engine_id"
            )
        return {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "transfer_id": ctx.transfer_id,
            "remote_bootstrap_addr": bootstrap_addr(peer.host, peer.bootstrap_port),
            "remote_engine_id": peer.engine_id,
        }
