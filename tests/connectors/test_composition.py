"""``multi:`` composition, pairing rules and the registry's spec syntax."""

from __future__ import annotations

import pytest

from connectors import (
    ConnectorError,
    LegOrder,
    UnknownConnectorError,
    can_pair,
    get_connector,
    parse_spec,
)

from .helpers import CLIENT, CTX, answer
from .test_vllm033_fields import NIXL_PULL_ANSWER


def test_multi_merges_the_childrens_params_into_one_dict() -> None:
    multi = get_connector("multi:nixl,offloading")
    prefill = multi.prefill_body(CLIENT, CTX)["kv_transfer_params"]
    assert prefill["do_remote_decode"] is True
    assert prefill["remote_decoder"] == {"kv_request_id": "xfer-1"}
    outcome = multi.read_prefill(answer("length", NIXL_PULL_ANSWER), CTX)
    assert outcome.params is not None
    assert outcome.params["remote_block_ids"] == NIXL_PULL_ANSWER["remote_block_ids"]
    assert outcome.params["remote_prefiller"]["kv_request_id"] == "xfer-1"
    assert not outcome.finished


def test_multi_with_a_store_child_keeps_the_other_childs_params() -> None:
    multi = get_connector("multi:nixl,example")
    assert multi.prefill_body(CLIENT)["kv_transfer_params"]["do_remote_decode"] is True
    outcome = multi.read_prefill(answer("length", NIXL_PULL_ANSWER))
    assert outcome.params == NIXL_PULL_ANSWER
    assert multi.describe().handovers == {"nixl-pull", "shared-storage"}


def test_multi_finishes_only_when_no_child_hands_anything_over() -> None:
    multi = get_connector("multi:lmcache,example")
    assert multi.read_prefill(answer("stop")).finished
    assert not multi.read_prefill(answer("length")).finished


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("multi:nixl,mooncake", "both use kv_transfer_params key 'remote_engine_id'"),
        ("multi:nixl,moriio", "both use"),
        ("multi:mooncake,moriio", "both use"),
        ("multi:nixl,nixl", "twice"),
        ("multi:", "comma-separated"),
        ("multi:nixl,", "comma-separated"),
    ],
)
def test_unsound_compositions_are_refused(spec: str, message: str) -> None:
    with pytest.raises(ConnectorError, match=message):
        get_connector(spec)


def test_spec_parsing() -> None:
    assert parse_spec("nixl") == ("nixl",)
    assert parse_spec("multi:nixl, offloading") == ("nixl", "offloading")
    with pytest.raises(UnknownConnectorError, match="'p2p'"):
        parse_spec("multi:nixl,p2p")
    assert get_connector("multi:nixl,offloading").name == "multi:nixl,offloading"


def test_multi_order_is_together_only_when_every_child_is() -> None:
    assert get_connector("multi:mooncake").order(CTX) is LegOrder.TOGETHER
    assert get_connector("multi:nixl-push,offloading").order(CTX) is LegOrder.SEQUENTIAL


@pytest.mark.parametrize(
    ("prefill", "decode", "pairs"),
    [
        ("nixl", "nixl", True),
        ("nixl", "nixl-push", False),  # pull and push do not mix (the NIXL handshake checks)
        ("nixl", "multi:nixl,offloading", True),
        ("multi:nixl,offloading", "offloading", True),
        ("mooncake", "nixl", False),
        ("moriio", "nixl", False),
        ("example", "lmcache", False),
        ("multi:lmcache,example", "example", True),
    ],
)
def test_can_pair(prefill: str, decode: str, pairs: bool) -> None:
    assert can_pair(prefill, decode) is pairs
    assert can_pair(get_connector(prefill), get_connector(decode).describe()) is pairs
