"""Connector adapters, table-driven with the bodies of the NIXL P/D protocol."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from connectors import LegOrder, UnknownConnectorError, available, get_connector

CLIENT = {
    "model": "m",
    "prompt": "hello",
    "max_tokens": 64,
    "min_tokens": 8,
    "stream": True,
    "stream_options": {"include_usage": True},
    "cache_hit_threshold": 0.7,
    "temperature": 0,
}
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 64,
    "max_completion_tokens": 64,
    "stream": False,
}
NIXL_ANSWER_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [1, 2, 3],
    "remote_engine_id": "engine-p",
    "remote_request_id": "cmpl-1",
    "remote_host": "10.0.0.2",
    "remote_port": 5600,
    "tp_size": 1,
}


def _answer(finish: str, params: Any = None) -> dict[str, Any]:
    return {
        "choices": [{"index": 0, "text": "x", "finish_reason": finish}],
        "kv_transfer_params": params,
    }


@pytest.mark.parametrize("name", ["nixl", "example"])
@pytest.mark.parametrize("body", [CLIENT, CHAT], ids=["completion", "chat"])
def test_prefill_body_is_one_token_non_streamed(name: str, body: dict[str, Any]) -> None:
    original = copy.deepcopy(body)
    out = get_connector(name).prefill_body(body)
    assert body == original  # inputs are never mutated
    assert out["stream"] is False and out["max_tokens"] == 1
    assert "stream_options" not in out and "cache_hit_threshold" not in out
    assert out.get("min_tokens", 0) <= 1
    if "max_completion_tokens" in body:
        assert out["max_completion_tokens"] == 1
    assert out["model"] == body["model"]


def test_nixl_prefill_asks_for_remote_decode_with_null_remote_fields() -> None:
    params = get_connector("nixl").prefill_body(CLIENT)["kv_transfer_params"]
    assert params == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def test_example_prefill_carries_no_transfer_params() -> None:
    body = CLIENT | {"kv_transfer_params": {"x": 1}}
    assert "kv_transfer_params" not in get_connector("example").prefill_body(body)


@pytest.mark.parametrize(
    ("name", "answer", "params", "finished"),
    [
        ("nixl", _answer("length", NIXL_ANSWER_PARAMS), NIXL_ANSWER_PARAMS, False),
        ("nixl", _answer("stop", None), None, True),
        ("nixl", _answer("length", None), None, False),
        ("nixl", _answer("length", {"remote_block_ids": []}), None, False),
        ("nixl", {"choices": []}, None, False),
        ("example", _answer("length"), None, False),
        ("example", _answer("stop"), None, True),
    ],
    ids=[
        "nixl-params",
        "nixl-eos-first",
        "nixl-aborted",
        "nixl-empty-blocks",
        "nixl-no-choice",
        "example-length",
        "example-stop",
    ],
)
def test_read_prefill(name: str, answer: dict[str, Any], params: Any, finished: bool) -> None:
    outcome = get_connector(name).read_prefill(answer)
    assert outcome.params == params and outcome.finished is finished


def test_nixl_decode_body_keeps_the_request_and_adds_the_params() -> None:
    out = get_connector("nixl").decode_body(CLIENT, NIXL_ANSWER_PARAMS)
    assert out["kv_transfer_params"] == NIXL_ANSWER_PARAMS
    assert out["stream"] is True and out["max_tokens"] == 64
    assert out["stream_options"] == {"include_usage": True}
    assert "kv_transfer_params" not in get_connector("nixl").decode_body(CLIENT, None)


def test_example_decode_body_is_the_request() -> None:
    assert get_connector("example").decode_body(CLIENT, None) == CLIENT


def test_registry() -> None:
    assert available() == [
        "example",
        "lmcache",
        "mooncake",
        "moriio",
        "nixl",
        "nixl-push",
        "offloading",
    ]
    assert get_connector("nixl").leg_order is LegOrder.SEQUENTIAL
    assert get_connector("example").leg_order is LegOrder.SEQUENTIAL
    with pytest.raises(UnknownConnectorError, match="known: example, lmcache"):
        get_connector("mooncake-typo")


# The outputs of the adapters before the context was added, for the same inputs: the
# existing callers (no context) must get byte-identical bodies.
_GOLDEN_BODIES = [
    CLIENT,
    CHAT | {"kv_transfer_params": {"x": 1}},
]
_GOLDEN_PARAMS = {
    "do_remote_prefill": True,
    "remote_block_ids": [1, 2],
    "remote_engine_id": "e",
    "remote_host": "h",
    "remote_port": 1,
}
_GOLDEN = {
    "nixl": [
        '{"model": "m", "prompt": "hello", "max_tokens": 1, "min_tokens": 1, "stream": false, "temperature": 0, "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}}',  # noqa: E501
        '{"model": "m", "prompt": "hello", "max_tokens": 64, "min_tokens": 8, "stream": true, "stream_options": {"include_usage": true}, "cache_hit_threshold": 0.7, "temperature": 0, "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": [1, 2], "remote_engine_id": "e", "remote_host": "h", "remote_port": 1}}',  # noqa: E501
        '{"model": "m", "prompt": "hello", "max_tokens": 64, "min_tokens": 8, "stream": true, "stream_options": {"include_usage": true}, "cache_hit_threshold": 0.7, "temperature": 0}',  # noqa: E501
        '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "max_completion_tokens": 1, "stream": false, "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}}',  # noqa: E501
        '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "max_completion_tokens": 64, "stream": false, "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": [1, 2], "remote_engine_id": "e", "remote_host": "h", "remote_port": 1}}',  # noqa: E501
        '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "max_completion_tokens": 64, "stream": false}',  # noqa: E501
    ],
    "example": [
        '{"model": "m", "prompt": "hello", "max_tokens": 1, "min_tokens": 1, "stream": false, "temperature": 0}',  # noqa: E501
        '{"model": "m", "prompt": "hello", "max_tokens": 64, "min_tokens": 8, "stream": true, "stream_options": {"include_usage": true}, "cache_hit_threshold": 0.7, "temperature": 0}',  # noqa: E501
        '{"model": "m", "prompt": "hello", "max_tokens": 64, "min_tokens": 8, "stream": true, "stream_options": {"include_usage": true}, "cache_hit_threshold": 0.7, "temperature": 0}',  # noqa: E501
        '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "max_completion_tokens": 1, "stream": false}',  # noqa: E501
        '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "max_completion_tokens": 64, "stream": false}',  # noqa: E501
        '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "max_completion_tokens": 64, "stream": false}',  # noqa: E501
    ],
}


@pytest.mark.parametrize("name", sorted(_GOLDEN))
def test_bodies_without_context_are_byte_identical_to_before(name: str) -> None:
    connector = get_connector(name)
    produced = []
    for body in _GOLDEN_BODIES:
        produced.append(json.dumps(connector.prefill_body(body)))
        produced.append(json.dumps(connector.decode_body(body, _GOLDEN_PARAMS)))
        produced.append(json.dumps(connector.decode_body(body, None)))
    assert produced == _GOLDEN[name]
