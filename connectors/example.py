"""``example``: vLLM's ``ExampleConnector`` (was ``SharedStorageConnector``).

The prefiller writes the KV of every prompt it computes to a shared path keyed by
the prompt; the decoder finds it there by itself. Contract for the executor (leg
order ``SEQUENTIAL``; no context needed): prefill leg ``prefill_body(body)`` -- one
token, no ``kv_transfer_params`` (a client's is removed); wait for it (the save
completes with the request); decode leg ``decode_body(body, None)`` -- the client's
request, no ``kv_transfer_params``. Nothing comes back in the prefill answer.
Source: ``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py``.
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
    finished_naturally,
    with_params,
)

__all__ = ["ExampleConnector"]


class ExampleConnector(Adapter):
    name = "example"
    leg_order = LegOrder.SEQUENTIAL

    def describe(self) -> ConnectorInfo:
        return ConnectorInfo(
            name=self.name,
            vllm_connectors=("ExampleConnector", "SharedStorageConnector"),
            handovers=frozenset({"shared-storage"}),
            leg_order=self.leg_order,
        )

    def prefill_params(self, ctx: TransferContext | None) -> Params | None:
        return None

    def read_prefill(self, answer: Body, ctx: TransferContext | None = None) -> PrefillOutcome:
        return PrefillOutcome(params=None, finished=finished_naturally(answer))

    def decode_body(
        self, body: Body, params: Params | None, ctx: TransferContext | None = None
    ) -> Body:
        return with_params(body, None)
