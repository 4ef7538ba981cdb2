"""``nixl-push``: vLLM 0.33's ``NixlPushConnector`` -- the prefiller WRITEs into blocks
the decoder allocated.

What 0.33 does: the prefiller runs the one-token prefill as with pull and, when it
finishes (length or stop), keeps its blocks under the lease and answers the usual
NIXL params with ``transfer_mode: "push"``. The decoder, given ``do_remote_prefill``
and the prefiller's *identity* (``remote_engine_id``, ``remote_host``,
``remote_port`` = its NIXL side channel, ``tp_size``, optional ``pp_size``), allocates
blocks and sends the prefiller a registration over NIXL; the prefiller's worker
matches the registration to its finished request by **request id with vLLM's random
``-xxxxxxxx`` suffix stripped**, and writes. The match works in either order (a
registration that arrives first waits for the prefill to finish), so the decoder
never has to be asked first. The decoder needs no block ids (it sets
``remote_block_ids`` itself) but reads the ``remote_request_id`` key.

Contract for the executor:

* Both legs carry the same ``X-Request-Id`` (``headers``) and go to the same API
  path (vLLM prefixes ``cmpl-``/``chatcmpl-``), so the base request ids match.
* Order ``SEQUENTIAL`` while the prefiller's identity is unknown: prefill leg
  ``prefill_body(body, ctx)`` (the pull params), wait, ``read_prefill(answer, ctx)``
  -> decode params without block ids, and ``outcome.learned`` = the identity: cache
  it for that prefiller. Then ``decode_body(body, outcome.params, ctx)``.
* Order ``TOGETHER`` once the context knows the identity (``engine_id`` from config
  or learned, with ``host``, ``nixl_port``, ``tp_size``): send both legs at once, the
  decode leg with ``ahead_params(ctx)``. If ``read_prefill`` says ``stale`` (a
  restarted prefiller has a new engine id), forget the identity, cancel the decode
  leg and send it again with ``outcome.params``.

Source: ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_scheduler.py``
(``update_state_after_alloc``, ``request_finished``), ``nixl/push_worker.py``
(``_pop_matching_finished_blocks``), ``nixl/utils.py`` (``get_base_request_id``),
``nixl/metadata.py`` (``add_new_req_to_recv``) and vLLM's
``tests/v1/kv_connector/nixl_integration/toy_push_proxy_server.py``.
"""

from __future__ import annotations

from connectors._base import (
    Adapter,
    Body,
    ConnectorError,
    ConnectorInfo,
    Leg,
    LegOrder,
    MissingContextError,
    Params,
    PeerUpdate,
    PrefillOutcome,
    TransferContext,
    answer_params,
    finished_naturally,
    require_ctx,
)
from connectors.nixl import PREFILL_PARAMS

__all__ = ["NixlPushConnector"]

_IDENTITY = ("remote_engine_id", "remote_host", "remote_port", "tp_size")
_OPTIONAL_SIZES = ("pp_size", "dcp_size")
_DECODE_KEYS = frozenset(
    {"do_remote_prefill", "do_remote_decode", "remote_request_id", *_IDENTITY, *_OPTIONAL_SIZES}
)


class NixlPushConnector(Adapter):
    name = "nixl-push"
    leg_order = LegOrder.TOGETHER

    def describe(self) -> ConnectorInfo:
        return ConnectorInfo(
            name=self.name,
            vllm_connectors=("NixlPushConnector",),
            handovers=frozenset({"nixl-push"}),
            leg_order=self.leg_order,
            shared_request_id=True,
            returns_params=True,
            peer_fields=frozenset({"engine_id", "host", "nixl_port", "tp_size"}),
            prefill_keys=frozenset(PREFILL_PARAMS),
            address_keys=frozenset({"remote_host"}),
            decode_keys=_DECODE_KEYS,
        )

    def order(self, ctx: TransferContext | None = None) -> LegOrder:
        known = ctx is not None and ctx.prefiller.engine_id is not None
        return LegOrder.TOGETHER if known else LegOrder.SEQUENTIAL

    def headers(self, leg: Leg, ctx: TransferContext) -> dict[str, str]:
        return {"X-Request-Id": ctx.request_id}

    def prefill_params(self, ctx: TransferContext | None) -> Params | None:
        return dict(PREFILL_PARAMS)

    def read_prefill(self, answer: Body, ctx: TransferContext | None = None) -> PrefillOutcome:
        params = answer_params(answer)
        if params is None or any(params.get(key) is None for key in _IDENTITY):
            return PrefillOutcome(params=None, finished=finished_naturally(answer))
        decode: Params = {"do_remote_prefill": True, "do_remote_decode": False}
        decode["remote_request_id"] = params.get("remote_request_id")
        for key in (*_IDENTITY, *_OPTIONAL_SIZES):
            if key in params:
                decode[key] = params[key]
        try:
            learned = PeerUpdate(
                engine_id=str(params["remote_engine_id"]),
                host=str(params["remote_host"]),
                nixl_port=int(params["remote_port"]),
                tp_size=int(params["tp_size"]),
            )
        except (TypeError, ValueError):
            raise ConnectorError(f"nixl-push: malformed prefiller identity in {params}") from None
        stale = self.order(ctx) is LegOrder.TOGETHER and (
            ctx is not None and ctx.prefiller.updated(learned) != ctx.prefiller
        )
        return PrefillOutcome(params=decode, finished=False, learned=learned, stale=stale)

    def ahead_params(self, ctx: TransferContext) -> Params:
        peer = require_ctx(ctx, self.name).prefiller
        if peer.engine_id is None:
            raise MissingContextError(
                "nixl-push runs its legs together only when the prefiller's engine id is "
                "known (configure kv.engine_id or learn it from a prefill answer)"
            )
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_request_id": ctx.request_id,
            "remote_engine_id": peer.engine_id,
            "remote_host": peer.host,
            "remote_port": peer.nixl_port,
            "tp_size": peer.tp_size,
        }
