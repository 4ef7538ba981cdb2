"""``lmcache``: vLLM's ``LMCacheConnectorV1`` over a shared LMCache store.

What 0.33 does: every instance saves the KV it computes to LMCache in chunks
(256 tokens by default) keyed by the token prefix, and at admission looks the
prompt up there (``lookup_client.lookup``): the longest prefix of stored chunks is
loaded instead of computed. A shared backend (an LMCache server, Redis, a shared
disk) makes a prefill's store visible to every decoder: decode-first needs nothing
else -- the prefill stores, the decoder's lookup finds it. Request options travel
as ``lmcache.*`` keys of ``kv_transfer_params``; the prefill answer carries none
(only ``first_tok`` when asked with ``ret_first_tok``, which this adapter does not
use). LMCache's own P/D mode (``disagg_spec`` pushing to a decoder's receiver
ports) is not this adapter.

Contract for the executor (order ``SEQUENTIAL``; no context needed): prefill leg
``prefill_body(body)`` -- one token, no ``kv_transfer_params``; wait for its answer
(the store is complete when the request is); decode leg ``decode_body(body, None)``
-- the client's request, no ``kv_transfer_params``. Sending the decode leg earlier
would look the prompt up before it is stored.

Source: ``vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py``,
``lmcache_integration/vllm_v1_adapter.py`` (``get_num_new_matched_tokens``,
``extract_request_configs``, ``request_finished``).
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
)

__all__ = ["LMCacheConnector"]


class LMCacheConnector(Adapter):
    name = "lmcache"
    leg_order = LegOrder.SEQUENTIAL

    def describe(self) -> ConnectorInfo:
        return ConnectorInfo(
            name=self.name,
            vllm_connectors=("LMCacheConnectorV1",),
            handovers=frozenset({"lmcache"}),
            leg_order=self.leg_order,
        )

    def prefill_params(self, ctx: TransferContext | None) -> Params | None:
        return None

    def read_prefill(self, answer: Body, ctx: TransferContext | None = None) -> PrefillOutcome:
        return PrefillOutcome(params=None, finished=finished_naturally(answer))
