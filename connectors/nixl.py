"""``nixl``: vLLM's ``NixlConnector`` (0.33: ``NixlPullConnector``) -- the decoder pulls.

Contract for the executor (leg order ``SEQUENTIAL``; no context needed):

1. Prefill leg: ``prefill_body(body)`` -- one token, not streamed, with
   ``kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false,
   remote_engine_id, remote_block_ids, remote_host, remote_port: null}``.
2. The prefiller answers ``kv_transfer_params`` (``do_remote_prefill: true``,
   ``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``,
   ``remote_host``/``remote_port`` = its NIXL side channel, ``tp_size``, ``dcp_size``,
   ``pp_size``, ``remote_num_tokens``, ``remote_blocks_expiry_time``,
   ``remote_registration_generation``, ``transfer_mode: "pull"``) and keeps the
   blocks until the decoder reads them or the lease (``kv_lease_duration``, 30 s)
   runs out. ``read_prefill`` hands those params on unchanged; without
   ``remote_block_ids`` there is nothing to pull (params None).
3. Decode leg: ``decode_body(body, outcome.params)`` -- the client's request with
   those params; the decoder reads the blocks over NIXL.

Any ``X-Request-Id`` works (the pull is keyed by ``remote_request_id``).
Source: ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py``
(``request_finished``, ``update_state_after_alloc``) and vLLM's
``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``.
"""

from __future__ import annotations

from connectors._base import (
    Adapter,
    Body,
    ConnectorInfo,
    LegOrder,
    Params,
    PrefillOutcome,
    TransferContext,
    answer_params,
    finished_naturally,
)

__all__ = ["PREFILL_PARAMS", "NixlConnector"]

PREFILL_PARAMS: dict[str, object] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

_ANSWER_KEYS = frozenset(
    {
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "dcp_size",
        "pp_size",
        "remote_num_tokens",
        "remote_blocks_expiry_time",
        "remote_registration_generation",
        "transfer_mode",
    }
)


class NixlConnector(Adapter):
    name = "nixl"
    leg_order = LegOrder.SEQUENTIAL

    def describe(self) -> ConnectorInfo:
        return ConnectorInfo(
            name=self.name,
            vllm_connectors=("NixlConnector", "NixlPullConnector"),
            handovers=frozenset({"nixl-pull"}),
            leg_order=self.leg_order,
            returns_params=True,
            prefill_keys=frozenset(PREFILL_PARAMS),
            address_keys=frozenset({"remote_host"}),
            decode_keys=_ANSWER_KEYS,
        )

    def prefill_params(self, ctx: TransferContext | None) -> Params | None:
        return dict(PREFILL_PARAMS)

    def read_prefill(self, answer: Body, ctx: TransferContext | None = None) -> PrefillOutcome:
        params = answer_params(answer)
        if params is None or not params.get("remote_block_ids"):
            return PrefillOutcome(params=None, finished=finished_naturally(answer))
        return PrefillOutcome(params=params, finished=False)
