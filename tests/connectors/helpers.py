"""Contexts and bodies shared by the connector tests."""

from __future__ import annotations

from typing import Any

from connectors import PeerInfo, TransferContext

PREFILLER = PeerInfo(
    host="10.0.0.2",
    engine_id="engine-p",
    nixl_port=5601,
    tp_size=2,
    bootstrap_port=8998,
    handshake_port=6301,
    notify_port=61005,
    p2p_port=5710,
)
DECODER = PeerInfo(host="10.0.0.3", handshake_port=6302, notify_port=61006, tp_size=4)
CTX = TransferContext(
    request_id="req-1", transfer_id="xfer-1", prefiller=PREFILLER, decoder=DECODER
)

CLIENT: dict[str, Any] = {
    "model": "m",
    "prompt": "hello",
    "max_tokens": 64,
    "min_tokens": 8,
    "stream": True,
    "stream_options": {"include_usage": True},
    "cache_hit_threshold": 0.7,
    "temperature": 0,
}


def answer(finish: str, params: Any = None) -> dict[str, Any]:
    """A one-token completion answer with ``finish`` and top-level transfer params."""
    return {
        "choices": [{"index": 0, "text": "x", "finish_reason": finish}],
        "kv_transfer_params": params,
    }
