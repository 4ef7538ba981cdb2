"""Properties of every adapter: inputs are never mutated, outputs never alias them.

Bodies are copied at the top level (the client's nested values are shared, never
changed); everything else an adapter returns is fresh all the way down."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from connectors import Leg, MissingContextError, PeerInfo, TransferContext, available, get_connector

SPECS = [*available(), "multi:nixl,offloading", "multi:nixl,example", "multi:lmcache,offloading"]

_json_leaf = st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=4)
_json = st.recursive(
    _json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)

bodies = st.fixed_dictionaries(
    {
        "model": st.just("m"),
        "prompt": st.text(max_size=8) | st.lists(st.integers(0, 9), max_size=4),
    },
    optional={
        "max_tokens": st.integers(1, 100),
        "max_completion_tokens": st.integers(1, 100),
        "min_tokens": st.integers(0, 5) | st.none(),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "cache_hit_threshold": st.floats(0, 1),
        "kv_transfer_params": st.dictionaries(st.text(max_size=4), _json, max_size=3),
        "extra": _json,
    },
)

peers = st.builds(
    PeerInfo,
    host=st.sampled_from(["10.0.0.2", "h", "::1"]),
    engine_id=st.none() | st.text(min_size=1, max_size=6),
    nixl_port=st.integers(1, 65535),
    tp_size=st.integers(1, 8),
    dp_rank=st.none() | st.integers(0, 3),
    dp_size=st.integers(1, 4),
    bootstrap_port=st.integers(1, 65535),
    handshake_port=st.integers(1, 65535),
    notify_port=st.integers(1, 65535),
    p2p_port=st.integers(1, 65535),
)

contexts = st.builds(
    TransferContext,
    request_id=st.text(min_size=1, max_size=8),
    transfer_id=st.text(min_size=1, max_size=8),
    prefiller=peers,
    decoder=peers,
    kv_source=st.none() | peers,
)

answers = st.fixed_dictionaries(
    {
        "choices": st.lists(
            st.fixed_dictionaries(
                {"finish_reason": st.sampled_from(["length", "stop", "abort"]), "text": st.text()}
            ),
            max_size=1,
        ),
    },
    optional={
        "kv_transfer_params": st.none()
        | st.fixed_dictionaries(
            {
                "do_remote_prefill": st.booleans(),
                "remote_block_ids": st.lists(st.integers(0, 9), max_size=3),
                "remote_engine_id": st.text(min_size=1, max_size=4),
                "remote_request_id": st.text(max_size=4),
                "remote_host": st.text(min_size=1, max_size=4),
                "remote_port": st.integers(1, 65535),
                "tp_size": st.integers(1, 4),
            },
            optional={"transfer_mode": st.sampled_from(["pull", "push"]), "nested": _json},
        ),
    },
)


def _mutate_all(value: Any) -> None:
    """Change every container reachable from ``value`` in place."""
    if isinstance(value, dict):
        for item in list(value.values()):
            _mutate_all(item)
        value["__mutated__"] = True
    elif isinstance(value, list):
        for item in value:
            _mutate_all(item)
        value.append("__mutated__")


@settings(max_examples=40, deadline=None)
@given(spec=st.sampled_from(SPECS), body=bodies, ctx=contexts, prefill_answer=answers)
def test_no_method_mutates_its_inputs(
    spec: str, body: dict[str, Any], ctx: TransferContext, prefill_answer: dict[str, Any]
) -> None:
    connector = get_connector(spec)
    body_before, answer_before, ctx_before = (
        copy.deepcopy(body),
        copy.deepcopy(prefill_answer),
        copy.deepcopy(ctx),
    )
    prefill = connector.prefill_body(body, ctx)
    outputs: list[Any] = [
        prefill.get("kv_transfer_params"),
        connector.headers(Leg.PREFILL, ctx),
        connector.headers(Leg.DECODE, ctx),
        connector.lookups(ctx),
        connector.order(ctx),
        connector.describe(),
    ]
    try:
        outcome = connector.read_prefill(prefill_answer, ctx)
    except MissingContextError:  # mooncake before its lookup: the executor looks up first
        outcome = connector.read_prefill(prefill_answer, None)
    outputs.append(outcome)
    params = outcome.params
    params_before = copy.deepcopy(params)
    decode = connector.decode_body(body, params, ctx)
    outputs.append(decode.get("kv_transfer_params"))
    assert body == body_before
    assert prefill_answer == answer_before
    assert ctx == ctx_before
    assert params == params_before
    # Outputs are fresh objects (bodies at their top level): changing them leaves every
    # input as it was.
    for out in (prefill, decode):
        out["__mutated__"] = True
        out.pop("model", None)
    for out in outputs:
        _mutate_all(out)
    if params is not None:
        _mutate_all(params)
    assert body == body_before and prefill_answer == answer_before


@settings(max_examples=25, deadline=None)
@given(spec=st.sampled_from(SPECS), body=bodies, ctx=contexts)
def test_prefill_body_is_one_token_and_keeps_the_rest(
    spec: str, body: dict[str, Any], ctx: TransferContext
) -> None:
    out = get_connector(spec).prefill_body(body, ctx)
    assert out["max_tokens"] == 1 and out["stream"] is False
    assert "stream_options" not in out and "cache_hit_threshold" not in out
    untouched = set(body) - {
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "stream",
        "stream_options",
        "cache_hit_threshold",
        "kv_transfer_params",
    }
    assert {k: out[k] for k in untouched} == {k: body[k] for k in untouched}


@settings(max_examples=25, deadline=None)
@given(spec=st.sampled_from(SPECS), body=bodies, ctx=contexts)
def test_ahead_params_reach_the_decode_body_unchanged(
    spec: str, body: dict[str, Any], ctx: TransferContext
) -> None:
    connector = get_connector(spec)
    try:
        params = connector.ahead_params(ctx)
    except ValueError:  # sequential-only adapters, or an identity the context lacks
        return
    decode = connector.decode_body(body, params, ctx)
    assert decode["kv_transfer_params"] == params
    assert {k: v for k, v in decode.items() if k != "kv_transfer_params"} == {
        k: v for k, v in body.items() if k != "kv_transfer_params"
    }
