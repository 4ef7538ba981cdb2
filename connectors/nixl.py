"""NixlConnector: the decoder pulls the prefiller's KV blocks over NIXL.

Prefill: a one-token request with ``kv_transfer_params.do_remote_decode`` and null
remote fields. The prefiller answers ``kv_transfer_params`` (``remote_block_ids``,
``remote_engine_id``, ``remote_host``, ``remote_port``, ...) and holds the blocks
until they are pulled or a lease expires; it returns none when its first token
ended the sequence. Decode: the client's request with those params.
"""

from __future__ import annotations

import copy
from typing import Any

from connectors._base import Body, LegOrder, PrefillOutcome, finished_naturally, one_token_body

__all__ = ["NixlConnector"]

_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class NixlConnector:
    name = "nixl"
    leg_order = LegOrder.SEQUENTIAL

    def prefill_body(self, body: Body) -> Body:
        out = one_token_body(body)
        out["kv_transfer_params"] = dict(_PREFILL_PARAMS)
        return out

    def read_prefill(self, answer: Body) -> PrefillOutcome:
        params = answer.get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("remote_block_ids"):
            return PrefillOutcome(params=None, finished=finished_naturally(answer))
        return PrefillOutcome(params=dict(params), finished=False)

    def decode_body(self, body: Body, params: dict[str, Any] | None) -> Body:
        out = copy.deepcopy(body)
        if params is None:
            out.pop("kv_transfer_params", None)
        else:
            out["kv_transfer_params"] = dict(params)
        return out
