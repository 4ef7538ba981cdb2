"""``offloading``: the P2P tier of vLLM's ``OffloadingConnector`` -- the decoder fetches
the prefiller's blocks from its P2P side channel.

What 0.33 does: ``kv_transfer_params`` carry role sub-dicts. A prefill request with
``remote_decoder: {kv_request_id}`` stores every block of the request under that id,
parked until a peer fetches it (unbound stores are reaped after 60 s). A decode
request with ``remote_prefiller: {kv_request_id, remote_host, remote_port}`` opens a
session to ``remote_host:remote_port`` (the prefiller's
``VLLM_P2P_SIDE_CHANNEL_HOST``/``_PORT``, default 5710, plus its data-parallel
index), treats the whole prompt as a hit and fetches the blocks. A request with
``remote_kv_source: {kv_request_id, remote_host, remote_port}`` instead *probes* that
peer for cached blocks (symmetric P2P: llm-d's ``x-kv-cache-source-host-port``).
The prefill answer carries no ``kv_transfer_params``.

Contract for the executor (order ``SEQUENTIAL``, as llm-d's sidecar runs it: a fetch
that arrives before the prefill stored anything waits against the decoder's load
deadline and may give up and recompute): prefill leg ``prefill_body(body, ctx)``
(``remote_decoder`` with ``kv_request_id = ctx.transfer_id``, plus
``remote_kv_source`` when ``ctx.kv_source`` names another instance), wait, then
``decode_body(body, read_prefill(answer, ctx).params, ctx)`` (``remote_prefiller``
with the same id and the prefiller's ``host``/``p2p_port``). Running them together
also works in 0.33 (``ahead_params``) but risks that deadline.

Source: ``vllm/v1/kv_offload/tiering/p2p/manager.py`` (``_parse_source``,
``_parse_dest``, ``lookup``, ``submit_store``), ``vllm/envs.py``
(``VLLM_P2P_SIDE_CHANNEL_PORT``), ``.../v1/offloading/scheduler.py``
(``request_finished`` returns no params); llm-d's ``connector_p2p.go``.
"""

from __future__ import annotations

from connectors._base import (
    Adapter,
    Body,
    ConnectorInfo,
    LegOrder,
    Params,
    PeerInfo,
    PrefillOutcome,
    TransferContext,
    finished_naturally,
    require_ctx,
)

__all__ = ["OffloadingConnector"]


def _same_instance(a: PeerInfo, b: PeerInfo) -> bool:
    return (a.host, a.p2p_port) == (b.host, b.p2p_port)


class OffloadingConnector(Adapter):
    name = "offloading"
    leg_order = LegOrder.SEQUENTIAL

    def describe(self) -> ConnectorInfo:
        return ConnectorInfo(
            name=self.name,
            vllm_connectors=("OffloadingConnector",),
            handovers=frozenset({"offloading-p2p"}),
            leg_order=self.leg_order,
            peer_fields=frozenset({"host", "p2p_port"}),
            prefill_keys=frozenset({"remote_decoder", "remote_kv_source"}),
            decode_keys=frozenset({"remote_prefiller"}),
        )

    def prefill_params(self, ctx: TransferContext | None) -> Params | None:
        ctx = require_ctx(ctx, self.name)
        params: Params = {"remote_decoder": {"kv_request_id": ctx.transfer_id}}
        source = ctx.kv_source
        if source is not None and not _same_instance(source, ctx.prefiller):
            params["remote_kv_source"] = {
                "kv_request_id": f"{ctx.transfer_id}-source",
                "remote_host": source.host,
                "remote_port": source.p2p_port,
            }
        return params

    def read_prefill(self, answer: Body, ctx: TransferContext | None = None) -> PrefillOutcome:
        if finished_naturally(answer) or ctx is None:
            return PrefillOutcome(params=None, finished=finished_naturally(answer))
        return PrefillOutcome(params=self.ahead_params(ctx), finished=False)

    def ahead_params(self, ctx: TransferContext) -> Params:
        ctx = require_ctx(ctx, self.name)
        peer = ctx.prefiller
        return {
            "remote_prefiller": {
                "kv_request_id": ctx.transfer_id,
                "remote_host": peer.host,
                "remote_port": peer.p2p_port,
            }
        }
