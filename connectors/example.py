"""ExampleConnector (formerly SharedStorageConnector): KV through shared storage.

The prefiller writes the prompt's KV to storage keyed by the prompt; the decoder
finds it there by itself. The proxy only sends a one-token prefill and then the
client's request: nothing travels in ``kv_transfer_params``.
"""

from __future__ import annotations

import copy
from typing import Any

from connectors._base import Body, LegOrder, PrefillOutcome, finished_naturally, one_token_body

__all__ = ["ExampleConnector"]


class ExampleConnector:
    name = "example"
    leg_order = LegOrder.SEQUENTIAL

    def prefill_body(self, body: Body) -> Body:
        out = one_token_body(body)
        out.pop("kv_transfer_params", None)
        return out

    def read_prefill(self, answer: Body) -> PrefillOutcome:
        return PrefillOutcome(params=None, finished=finished_naturally(answer))

    def decode_body(self, body: Body, params: dict[str, Any] | None) -> Body:
        out = copy.deepcopy(body)
        out.pop("kv_transfer_params", None)
        return out
