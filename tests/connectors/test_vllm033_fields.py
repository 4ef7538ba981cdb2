"""The ``kv_transfer_params`` each adapter writes and reads, row by row from vLLM 0.33.

Every row names the file of the vLLM 0.33.0 wheel (or the proxy) its field comes
from. Paths are relative to the ``vllm/`` package; ``v1/`` stands for
``vllm/distributed/kv_transfer/kv_connector/v1/``.
"""

from __future__ import annotations

from typing import Any

import pytest

from connectors import ConnectorError, Leg, LegOrder, MissingContextError, PeerInfo, get_connector
from connectors._base import Params

from .helpers import CLIENT, CTX, DECODER, PREFILLER, answer

ABSENT = object()

# (connector, key, value in the prefill leg's kv_transfer_params)
PREFILL_ROWS: list[tuple[str, str, Any]] = [
    # v1/nixl/pull_scheduler.py: request_finished holds blocks for do_remote_decode
    ("nixl", "do_remote_decode", True),
    ("nixl", "do_remote_prefill", False),
    # tests/v1/kv_connector/nixl_integration/toy_proxy_server.py: null remote fields
    ("nixl", "remote_engine_id", None),
    ("nixl", "remote_block_ids", None),
    ("nixl", "remote_host", None),
    ("nixl", "remote_port", None),
    # v1/nixl/push_scheduler.py: the prefill side is the pull one (do_remote_decode)
    ("nixl-push", "do_remote_decode", True),
    ("nixl-push", "remote_block_ids", None),
    # v1/mooncake/mooncake_connector.py: update_state_after_alloc needs transfer_id
    ("mooncake", "do_remote_decode", True),
    ("mooncake", "do_remote_prefill", False),
    ("mooncake", "transfer_id", "xfer-1"),
    ("mooncake", "remote_engine_id", ABSENT),
    # v1/lmcache_connector.py: a shared store needs no params
    ("lmcache", "do_remote_decode", ABSENT),
    # v1/example_connector.py: shared storage needs no params
    ("example", "do_remote_decode", ABSENT),
    # vllm/v1/kv_offload/tiering/p2p/manager.py: _parse_dest reads remote_decoder
    ("offloading", "remote_decoder", {"kv_request_id": "xfer-1"}),
    ("offloading", "remote_prefiller", ABSENT),
    # v1/moriio/moriio_connector.py: update_state_after_alloc (producer, WRITE mode)
    ("moriio", "do_remote_decode", True),
    ("moriio", "transfer_id", "xfer-1"),
    # v1/moriio/moriio_common.py: add_new_req reads the peer (the decoder) address
    ("moriio", "remote_host", DECODER.host),
    ("moriio", "remote_handshake_port", DECODER.handshake_port),
    ("moriio", "remote_notify_port", DECODER.notify_port),
    # v1/moriio/moriio_common.py: add_new_req indexes these keys (null allowed)
    ("moriio", "remote_engine_id", None),
    ("moriio", "remote_block_ids", None),
    # v1/moriio/moriio_connector.py: router-pinned rank, honoured with the override
    ("moriio", "remote_dp_rank", 0),
    ("moriio", "remote_dp_rank_override", True),
    # v1/moriio/moriio_common.py: add_new_req prefers remote_tp_size for the peer
    ("moriio", "remote_tp_size", DECODER.tp_size),
    # v1/multi_connector.py: one dict for every child
    ("multi:nixl,offloading", "do_remote_decode", True),
    ("multi:nixl,offloading", "remote_decoder", {"kv_request_id": "xfer-1"}),
]


@pytest.mark.parametrize(("spec", "key", "value"), PREFILL_ROWS)
def test_prefill_params(spec: str, key: str, value: Any) -> None:
    body = get_connector(spec).prefill_body(CLIENT, CTX)
    params = body.get("kv_transfer_params") or {}
    assert params.get(key, ABSENT) == value
    assert body["max_tokens"] == 1 and body["stream"] is False


# (connector, key, value in the decode params built before the prefill answers)
AHEAD_ROWS: list[tuple[str, str, Any]] = [
    # v1/nixl/push_scheduler.py: update_state_after_alloc reads the prefiller's identity
    ("nixl-push", "do_remote_prefill", True),
    ("nixl-push", "remote_engine_id", PREFILLER.engine_id),
    ("nixl-push", "remote_host", PREFILLER.host),
    ("nixl-push", "remote_port", PREFILLER.nixl_port),
    ("nixl-push", "tp_size", PREFILLER.tp_size),
    # v1/nixl/metadata.py: add_new_req_to_recv indexes remote_request_id
    ("nixl-push", "remote_request_id", "req-1"),
    # v1/nixl/push_scheduler.py: the decoder sets remote_block_ids itself
    ("nixl-push", "remote_block_ids", ABSENT),
    # v1/mooncake/mooncake_connector.py: update_state_after_alloc requires these three
    ("mooncake", "do_remote_prefill", True),
    ("mooncake", "transfer_id", "xfer-1"),
    ("mooncake", "remote_engine_id", PREFILLER.engine_id),
    # vllm/envs.py: VLLM_MOONCAKE_BOOTSTRAP_PORT; mooncake_connector.py appends /query
    ("mooncake", "remote_bootstrap_addr", "http://10.0.0.2:8998"),
    # vllm/v1/kv_offload/tiering/p2p/manager.py: _parse_source reads remote_prefiller
    (
        "offloading",
        "remote_prefiller",
        {"kv_request_id": "xfer-1", "remote_host": "10.0.0.2", "remote_port": 5710},
    ),
    # v1/moriio/moriio_connector.py: the decoder notifies the prefiller's notify port
    ("moriio", "do_remote_prefill", True),
    ("moriio", "remote_host", PREFILLER.host),
    ("moriio", "remote_notify_port", PREFILLER.notify_port),
    ("moriio", "remote_handshake_port", PREFILLER.handshake_port),
    ("moriio", "transfer_id", "xfer-1"),
    # v1/moriio/moriio_connector.py: the engine id is host_ip:handshake_port
    ("moriio", "remote_engine_id", "10.0.0.2:6301"),
    # v1/moriio/moriio_common.py: add_new_req indexes remote_block_ids ([] in WRITE mode)
    ("moriio", "remote_block_ids", []),
    ("moriio", "remote_dp_rank_override", True),
]


@pytest.mark.parametrize(("spec", "key", "value"), AHEAD_ROWS)
def test_ahead_params(spec: str, key: str, value: Any) -> None:
    connector = get_connector(spec)
    params = connector.ahead_params(CTX)
    assert params.get(key, ABSENT) == value
    decode = connector.decode_body(CLIENT, params, CTX)
    assert decode["kv_transfer_params"] == params
    assert decode["max_tokens"] == CLIENT["max_tokens"] and decode["stream"] is True


# A prefill answer of each kind, as 0.33's request_finished builds it.
NIXL_PULL_ANSWER = {  # v1/nixl/pull_scheduler.py: request_finished
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "engine-p",
    "remote_request_id": "cmpl-req-1-0-0123abcd",
    "remote_host": "10.0.0.2",
    "remote_port": 5601,
    "tp_size": 2,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 48,
    "remote_blocks_expiry_time": None,
    "remote_registration_generation": 1,
    "transfer_mode": "pull",
}
NIXL_PUSH_ANSWER = {  # v1/nixl/push_scheduler.py: request_finished
    key: NIXL_PULL_ANSWER[key]
    for key in NIXL_PULL_ANSWER
    if key not in ("remote_blocks_expiry_time", "remote_registration_generation")
} | {"transfer_mode": "push"}
MORIIO_ANSWER = {  # v1/moriio/moriio_connector.py: request_finished (producer, length)
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[4, 5]],
    "remote_engine_id": "10.0.0.2:6301",
    "remote_host": "10.0.0.2",
    "remote_handshake_port": 6301,
    "remote_notify_port": 61005,
    "remote_dp_rank": 0,
    "remote_dp_rank_override": True,
    "remote_dp_size": 1,
    "remote_dp_size_local": 1,
    "tp_size": 2,
    "transfer_id": "xfer-1",
}

# (connector, prefill answer, decode params expected, finished)
READ_ROWS: list[tuple[str, dict[str, Any], Params | None, bool]] = [
    # v1/nixl/pull_scheduler.py: the decoder gets the answer's params unchanged
    ("nixl", answer("length", NIXL_PULL_ANSWER), NIXL_PULL_ANSWER, False),
    # v1/nixl/pull_scheduler.py: aborted requests return no params
    ("nixl", answer("abort", None), None, False),
    # tests/v1/kv_connector/nixl_integration/toy_push_proxy_server.py: identity, no blocks
    (
        "nixl-push",
        answer("length", NIXL_PUSH_ANSWER),
        {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_request_id": "cmpl-req-1-0-0123abcd",
            "remote_engine_id": "engine-p",
            "remote_host": "10.0.0.2",
            "remote_port": 5601,
            "tp_size": 2,
            "pp_size": 1,
            "dcp_size": 1,
        },
        False,
    ),
    ("nixl-push", answer("stop", None), None, True),
    # v1/mooncake/mooncake_connector.py: request_finished returns no params; a stop
    # (not FINISHED_LENGTH_CAPPED) is not handed over
    ("mooncake", answer("stop", None), None, True),
    # v1/moriio/moriio_connector.py: request_finished echoes decode-ready params
    ("moriio", answer("length", MORIIO_ANSWER), MORIIO_ANSWER, False),
    ("moriio", answer("stop", None), None, True),
    # v1/example_connector.py and v1/lmcache_connector.py: nothing comes back
    ("example", answer("length", None), None, False),
    ("lmcache", answer("length", None), None, False),
    ("lmcache", answer("stop", None), None, True),
    ("offloading", answer("stop", None), None, True),
]


@pytest.mark.parametrize(("spec", "prefill_answer", "params", "finished"), READ_ROWS)
def test_read_prefill(
    spec: str, prefill_answer: dict[str, Any], params: Params | None, finished: bool
) -> None:
    outcome = get_connector(spec).read_prefill(prefill_answer, CTX)
    assert outcome.params == params
    assert outcome.finished is finished
    assert not outcome.stale


@pytest.mark.parametrize("spec", ["mooncake", "offloading"])
def test_answers_without_params_hand_over_through_the_context(spec: str) -> None:
    # v1/mooncake/mooncake_connector.py and vllm/v1/kv_offload/tiering/p2p/manager.py:
    # the decoder's params do not come from the answer, so a sequential run uses the
    # context's
    connector = get_connector(spec)
    outcome = connector.read_prefill(answer("length", None), CTX)
    assert outcome.params == connector.ahead_params(CTX) and not outcome.finished


def test_push_answer_teaches_the_identity_and_detects_a_stale_one() -> None:
    # v1/nixl/push_worker.py: the write needs the prefiller that ran the prefill
    push = get_connector("nixl-push")
    outcome = push.read_prefill(answer("length", NIXL_PUSH_ANSWER), CTX)
    assert outcome.learned is not None and outcome.learned.engine_id == "engine-p"
    assert not outcome.stale
    restarted = answer("length", NIXL_PUSH_ANSWER | {"remote_engine_id": "engine-p2"})
    assert push.read_prefill(restarted, CTX).stale
    unknown = type(CTX)(
        request_id="req-1",
        transfer_id="xfer-1",
        prefiller=PeerInfo(host="10.0.0.2"),
        decoder=DECODER,
    )
    assert not push.read_prefill(restarted, unknown).stale  # sequential: nothing to contradict


def test_moriio_answer_from_another_engine_is_stale() -> None:
    # v1/moriio/moriio_connector.py: the engine id is host_ip:handshake_port
    other = answer("length", MORIIO_ANSWER | {"remote_engine_id": "10.0.0.9:6301"})
    assert get_connector("moriio").read_prefill(other, CTX).stale


# (connector, leg, context, headers)
HEADER_ROWS: list[tuple[str, Leg, Any, dict[str, str]]] = [
    # v1/nixl/push_worker.py: _pop_matching_finished_blocks matches base request ids
    ("nixl-push", Leg.PREFILL, CTX, {"X-Request-Id": "req-1"}),
    ("nixl-push", Leg.DECODE, CTX, {"X-Request-Id": "req-1"}),
    ("nixl", Leg.PREFILL, CTX, {}),
    ("mooncake", Leg.PREFILL, CTX, {}),
    # entrypoints/generate/base/serving.py: X-data-parallel-rank picks the engine
    (
        "mooncake",
        Leg.PREFILL,
        type(CTX)("r", "t", PeerInfo("p", engine_id="e", dp_size=2, dp_rank=1), DECODER),
        {"X-data-parallel-rank": "1"},
    ),
    ("mooncake", Leg.DECODE, CTX, {}),
    # v1/moriio/moriio_connector.py: the router pins both legs to one rank
    (
        "moriio",
        Leg.PREFILL,
        type(CTX)("r", "t", PeerInfo("p", dp_size=4, dp_rank=3), DECODER),
        {"X-data-parallel-rank": "3"},
    ),
    ("moriio", Leg.PREFILL, CTX, {}),
]


@pytest.mark.parametrize(("spec", "leg", "ctx", "headers"), HEADER_ROWS)
def test_headers(spec: str, leg: Leg, ctx: Any, headers: dict[str, str]) -> None:
    assert get_connector(spec).headers(leg, ctx) == headers


# (connector, order with a complete context, order without any context)
ORDER_ROWS: list[tuple[str, LegOrder, LegOrder]] = [
    # tests/v1/kv_connector/nixl_integration/toy_proxy_server.py: prefill, then decode
    ("nixl", LegOrder.SEQUENTIAL, LegOrder.SEQUENTIAL),
    # v1/nixl/push_worker.py: a registration may arrive before the prefill finishes
    ("nixl-push", LegOrder.TOGETHER, LegOrder.SEQUENTIAL),
    # v1/mooncake/mooncake_connector.py: the pull waits for the prefill's blocks
    ("mooncake", LegOrder.TOGETHER, LegOrder.TOGETHER),
    # v1/lmcache_integration/vllm_v1_adapter.py: the lookup finds stored chunks only
    ("lmcache", LegOrder.SEQUENTIAL, LegOrder.SEQUENTIAL),
    ("example", LegOrder.SEQUENTIAL, LegOrder.SEQUENTIAL),
    # vllm/v1/kv_offload/tiering/p2p/manager.py: an early fetch waits on a deadline
    ("offloading", LegOrder.SEQUENTIAL, LegOrder.SEQUENTIAL),
    # v1/moriio/moriio_connector.py: the write waits for the decoder's notice
    ("moriio", LegOrder.TOGETHER, LegOrder.TOGETHER),
    # v1/multi_connector.py: the children together
    ("multi:nixl,offloading", LegOrder.SEQUENTIAL, LegOrder.SEQUENTIAL),
    ("multi:mooncake,offloading", LegOrder.SEQUENTIAL, LegOrder.SEQUENTIAL),
    ("multi:moriio,lmcache", LegOrder.SEQUENTIAL, LegOrder.SEQUENTIAL),
]


@pytest.mark.parametrize(("spec", "with_ctx", "without"), ORDER_ROWS)
def test_orders(spec: str, with_ctx: LegOrder, without: LegOrder) -> None:
    connector = get_connector(spec)
    assert connector.order(CTX) is with_ctx
    assert connector.order() is without


def test_mooncake_looks_the_engine_id_up_until_it_is_known() -> None:
    # v1/mooncake/mooncake_utils.py: /query maps dp ranks to {engine_id, worker_addr}
    mooncake = get_connector("mooncake")
    assert mooncake.lookups(CTX) == ()
    unknown = type(CTX)("r", "t", PeerInfo("10.0.0.2", bootstrap_port=9000), DECODER)
    (lookup,) = mooncake.lookups(unknown)
    assert lookup.leg is Leg.PREFILL and lookup.url == "http://10.0.0.2:9000/query"
    update = lookup.parse({"1": {"engine_id": "e1", "worker_addr": {}}, "0": {"engine_id": "e0"}})
    assert (update.engine_id, update.dp_rank) == ("e0", 0)
    known = unknown.with_peer(Leg.PREFILL, update)
    assert mooncake.lookups(known) == ()
    assert mooncake.ahead_params(known)["remote_engine_id"] == "e0"
    with pytest.raises(MissingContextError):
        mooncake.ahead_params(unknown)


@pytest.mark.parametrize("spec", ["mooncake", "offloading", "moriio"])
def test_context_is_required_where_the_body_needs_it(spec: str) -> None:
    with pytest.raises(MissingContextError):
        get_connector(spec).prefill_body(CLIENT)


def test_a_malformed_push_identity_is_a_connector_error() -> None:
    bad = answer("length", NIXL_PUSH_ANSWER | {"remote_port": "not-a-port"})
    with pytest.raises(ConnectorError, match="malformed"):
        get_connector("nixl-push").read_prefill(bad, CTX)
