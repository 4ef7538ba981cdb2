"""``moriio``: vLLM's ``MoRIIOConnector`` (ROCm) in its default WRITE mode -- the
prefiller RDMA-writes into blocks the decoder allocated and announced.

What 0.33 does: both legs name the same ``transfer_id`` (without one, each side
makes up ``sidecar-<its own request id>``, which differ). The prefill leg carries
``do_remote_decode`` and the *decoder's* address: ``remote_host``,
``remote_handshake_port``, ``remote_notify_port`` (the required keys
``remote_engine_id``/``remote_block_ids`` may be null: the prefiller derives the
decoder's engine id as ``host:handshake_port``). The decode leg carries
``do_remote_prefill`` and the *prefiller's* address and notify port; once it has
allocated blocks, the decoder sends them to the prefiller's notify port (plus the
data-parallel and tensor-parallel offset), and the prefiller writes as soon as both
its prefill and that notice are there (it waits up to ``defer_timeout``, 60 s). So
the legs run together. The data-parallel rank of the prefiller is router-chosen:
``remote_dp_rank`` with ``remote_dp_rank_override: true`` in both bodies and the
``X-data-parallel-rank`` header pin both legs to the same rank H. The prefill
answer (on length only) echoes decode-ready params, ``remote_engine_id =
"<prefiller host>:<handshake port>"`` included.

Contract for the executor (order ``TOGETHER``): send ``prefill_body(body, ctx)`` and
``decode_body(body, ahead_params(ctx), ctx)`` at once with ``headers(leg, ctx)``;
``read_prefill(answer, ctx)``: ``finished`` -> cancel the decode leg and serve the
prefill answer; ``stale`` (the prefiller answered another engine id than the
configured host/handshake port make) -> fix the endpoint's ``kv`` settings (the
decode leg notified the wrong address), cancel the decode leg and resend it with
``outcome.params``. Run sequentially, ``outcome.params`` are the answer's params.
The ports come from endpoint config (``kv.handshake_port``, ``kv.notify_port``,
defaults 6301 and 61005, as vLLM's ``kv_connector_extra_config``).

Source: ``vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py``
(``update_state_after_alloc``, ``request_finished``, ``_release_write_prefill_blocks``,
``save_kv_layer``), ``moriio/moriio_common.py`` (``MoRIIOConnectorMetadata.add_new_req``,
``MoRIIOConstants``, ``get_port_offset``); llm-d's ``connector_nixlv2.go``
(``runNIXLProtocolV2WriteParallel``) and vLLM's
``examples/online_serving/disaggregated_serving/moriio_toy_proxy_server.py``.
"""

from __future__ import annotations

from connectors._base import (
    Adapter,
    Body,
    ConnectorInfo,
    Leg,
    LegOrder,
    Params,
    PrefillOutcome,
    TransferContext,
    answer_params,
    finished_naturally,
    require_ctx,
)

__all__ = ["MoRIIOConnector", "engine_id"]

_PREFILL_KEYS = frozenset(
    {
        "do_remote_decode",
        "do_remote_prefill",
        "remote_engine_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
        "remote_handshake_port",
        "remote_notify_port",
        "remote_dp_rank",
        "remote_dp_rank_override",
        "remote_dp_size",
        "remote_tp_size",
        "transfer_id",
    }
)


def engine_id(host: str, handshake_port: int) -> str:
    """MoRI-IO's engine id of an instance: ``host:handshake_port``."""
    return f"{host}:{handshake_port}"


class MoRIIOConnector(Adapter):
    name = "moriio"
    leg_order = LegOrder.TOGETHER

    def describe(self) -> ConnectorInfo:
        return ConnectorInfo(
            name=self.name,
            vllm_connectors=("MoRIIOConnector",),
            handovers=frozenset({"moriio-write"}),
            leg_order=self.leg_order,
            returns_params=True,
            peer_fields=frozenset(
                {"host", "handshake_port", "notify_port", "tp_size", "dp_rank", "dp_size"}
            ),
            prefill_keys=_PREFILL_KEYS,
            address_keys=frozenset({"remote_host"}),
            decode_keys=_PREFILL_KEYS | {"remote_dp_size_local", "tp_size"},
        )

    def _rank(self, ctx: TransferContext) -> int:
        return ctx.prefiller.pick_dp_rank(ctx.transfer_id)

    def headers(self, leg: Leg, ctx: TransferContext) -> dict[str, str]:
        rank = self._rank(ctx)
        if leg is Leg.PREFILL and ctx.prefiller.dp_size > 1:
            return {"X-data-parallel-rank": str(rank)}
        if leg is Leg.DECODE and ctx.decoder.dp_size > 1:
            return {"X-data-parallel-rank": str(ctx.decoder.pick_dp_rank(ctx.transfer_id))}
        return {}

    def prefill_params(self, ctx: TransferContext | None) -> Params | None:
        ctx = require_ctx(ctx, self.name)
        decoder = ctx.decoder
        return {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": decoder.host,
            "remote_port": None,
            "remote_handshake_port": decoder.handshake_port,
            "remote_notify_port": decoder.notify_port,
            "remote_dp_rank": self._rank(ctx),
            "remote_dp_rank_override": True,
            "remote_dp_size": decoder.dp_size,
            "remote_tp_size": decoder.tp_size,
            "transfer_id": ctx.transfer_id,
        }

    def read_prefill(self, answer: Body, ctx: TransferContext | None = None) -> PrefillOutcome:
        params = answer_params(answer)
        if params is None or not params.get("do_remote_prefill"):
            return PrefillOutcome(params=None, finished=finished_naturally(answer))
        stale = False
        if ctx is not None:
            expected = self.ahead_params(ctx)
            stale = params.get("remote_engine_id") != expected["remote_engine_id"]
            params.setdefault("transfer_id", ctx.transfer_id)
        return PrefillOutcome(params=params, finished=False, stale=stale)

    def ahead_params(self, ctx: TransferContext) -> Params:
        ctx = require_ctx(ctx, self.name)
        peer = ctx.prefiller
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": engine_id(peer.host, peer.handshake_port),
            "remote_block_ids": [],
            "remote_host": peer.host,
            "remote_port": peer.handshake_port,
            "remote_handshake_port": peer.handshake_port,
            "remote_notify_port": peer.notify_port,
            "remote_dp_rank": self._rank(ctx),
            "remote_dp_rank_override": True,
            "remote_dp_size": peer.dp_size,
            "remote_tp_size": peer.tp_size,
            "transfer_id": ctx.transfer_id,
        }
