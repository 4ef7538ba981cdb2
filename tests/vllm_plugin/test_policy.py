"""The plugin's pure decisions: thresholds, hit ratio, request fields."""

from __future__ import annotations

import importlib
import math
import sys

import pytest

from pd_orchestrator.vllm_plugin import policy
from pd_orchestrator.vllm_plugin.policy import (
    ENV_GLOBAL_THRESHOLD,
    InvalidThresholdError,
    Phase,
    below_threshold,
    global_threshold,
    hit_ratio,
    is_remote_decode_prefill,
    max_hit_ratio,
    parse_count,
    parse_flag,
    parse_threshold,
    phase_of_stop_reason,
    request_admission_only,
    request_resume_tokens,
    request_threshold,
    resolve_threshold,
    stop_reason_for,
    with_flag_threshold,
)

# --- import -------------------------------------------------------------------------


def test_package_imports_without_vllm() -> None:
    assert "vllm" not in sys.modules
    module = importlib.import_module("pd_orchestrator.vllm_plugin")
    assert callable(module.register)
    assert "vllm" not in sys.modules


# --- parsing and resolution ---------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(None, None), (0, 0.0), (1, 1.0), (0.5, 0.5), ("0.25", 0.25), (" 1 ", 1.0)],
)
def test_parse_threshold_accepts_numbers_in_range(raw: object, expected: float | None) -> None:
    assert parse_threshold(raw, "x") == expected


@pytest.mark.parametrize(
    "raw", [-0.01, 1.01, 2, math.nan, math.inf, "abc", "", True, False, [0.5], {"a": 1}]
)
def test_parse_threshold_rejects_everything_else(raw: object) -> None:
    with pytest.raises(InvalidThresholdError, match="where"):
        parse_threshold(raw, "where")


def test_global_threshold_defaults_to_zero() -> None:
    assert global_threshold(None, {}) == 0.0
    assert global_threshold({}, {ENV_GLOBAL_THRESHOLD: ""}) == 0.0


def test_global_threshold_from_environment() -> None:
    assert global_threshold({}, {ENV_GLOBAL_THRESHOLD: "0.7"}) == 0.7


def test_additional_config_wins_over_environment() -> None:
    assert global_threshold({"cache_hit_threshold": 0.2}, {ENV_GLOBAL_THRESHOLD: "0.7"}) == 0.2


def test_invalid_global_threshold_raises() -> None:
    with pytest.raises(InvalidThresholdError, match="additional-config"):
        global_threshold({"cache_hit_threshold": 3}, {})
    with pytest.raises(InvalidThresholdError, match=ENV_GLOBAL_THRESHOLD):
        global_threshold({}, {ENV_GLOBAL_THRESHOLD: "high"})


@pytest.mark.parametrize(
    ("own", "default", "prefill", "expected"),
    [
        pytest.param(None, 0.6, False, 0.6, id="global-applies"),
        pytest.param(0.9, 0.6, False, 0.9, id="request-overrides-higher"),
        pytest.param(0.0, 0.6, False, 0.0, id="request-zero-disables"),
        pytest.param(0.9, 0.6, True, 0.0, id="remote-decode-prefill-ignores-request"),
        pytest.param(None, 0.6, True, 0.0, id="remote-decode-prefill-ignores-global"),
    ],
)
def test_resolve_threshold(
    own: float | None, default: float, prefill: bool, expected: float
) -> None:
    assert resolve_threshold(own, default, remote_decode_prefill=prefill) == expected


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (None, False),
        ({}, False),
        ({"do_remote_decode": False}, False),
        ({"do_remote_prefill": True}, False),
        ({"do_remote_decode": True, "do_remote_prefill": False}, True),
        ("do_remote_decode", False),
    ],
)
def test_is_remote_decode_prefill(params: object, expected: bool) -> None:
    assert is_remote_decode_prefill(params) is expected


def test_request_field_wins_over_vllm_xargs() -> None:
    assert request_threshold({"cache_hit_threshold": 0.3}, {"cache_hit_threshold": 0.8}) == 0.3


def test_request_threshold_from_vllm_xargs_or_none() -> None:
    assert request_threshold({}, {"cache_hit_threshold": "0.8"}) == 0.8
    assert request_threshold(None, None) is None
    assert request_threshold({"other": 1}, {"kv_transfer_params": {}}) is None


@pytest.mark.parametrize("bad", [1.5, -1, "x", True])
def test_request_threshold_rejects_out_of_range(bad: object) -> None:
    with pytest.raises(InvalidThresholdError, match="cache_hit_threshold"):
        request_threshold({"cache_hit_threshold": bad}, None)
    with pytest.raises(InvalidThresholdError, match="vllm_xargs"):
        request_threshold(None, {"cache_hit_threshold": bad})


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(None, None), (True, True), (False, False), (1, True), (0, False), ("true", True),
     ("False", False)],
)  # fmt: skip
def test_parse_flag_takes_booleans_and_their_xargs_forms(raw: object, expected: bool) -> None:
    assert parse_flag(raw, "x") is expected


@pytest.mark.parametrize("bad", [2, -1, 0.5, "yes", "", [True], {}])
def test_parse_flag_rejects_everything_else(bad: object) -> None:
    with pytest.raises(InvalidThresholdError, match="must be true or false"):
        parse_flag(bad, "x")


def test_admission_only_from_the_body_then_vllm_xargs() -> None:
    key = "cache_hit_admission_only"
    assert request_admission_only({key: True}, {key: "false"}) is True
    assert request_admission_only({}, {key: "true"}) is True
    assert request_admission_only({"other": 1}, {}) is None
    assert request_admission_only(None, None) is None
    with pytest.raises(InvalidThresholdError, match=key):
        request_admission_only({key: "maybe"}, None)
    with pytest.raises(InvalidThresholdError, match=rf"vllm_xargs\.{key}"):
        request_admission_only(None, {key: 7})


@pytest.mark.parametrize(("raw", "expected"), [(None, None), (0, 0), (17, 17), ("42", 42)])
def test_parse_count_takes_integers_and_their_xargs_form(raw: object, expected: int | None) -> None:
    assert parse_count(raw, "x") == expected


@pytest.mark.parametrize("bad", [True, False, -1, 2.0, "2.5", "-3", "", [], {}])
def test_parse_count_rejects_everything_else(bad: object) -> None:
    with pytest.raises(InvalidThresholdError, match="integer >= 0"):
        parse_count(bad, "x")


def test_resume_tokens_from_the_body_then_vllm_xargs() -> None:
    key = "cache_hit_resume_tokens"
    assert request_resume_tokens({key: 3}, {key: "9"}) == 3
    assert request_resume_tokens({}, {key: "9"}) == 9
    assert request_resume_tokens(None, None) is None
    with pytest.raises(InvalidThresholdError, match=f"vllm_xargs.{key}"):
        request_resume_tokens(None, {key: -2})


def test_flag_merges_into_additional_config() -> None:
    assert with_flag_threshold(None, 0.4) == {"cache_hit_threshold": 0.4}
    merged = with_flag_threshold({"other": 1, "cache_hit_threshold": 0.4}, 0.4)
    assert merged == {"other": 1, "cache_hit_threshold": 0.4}


def test_flag_conflicting_with_additional_config_raises() -> None:
    with pytest.raises(InvalidThresholdError, match="conflicts"):
        with_flag_threshold({"cache_hit_threshold": 0.2}, 0.4)


# --- ratio ---------------------------------------------------------------------------


def test_empty_prompt_counts_as_fully_cached() -> None:
    assert hit_ratio(0, 0) == 1.0
    assert not below_threshold(0, 0, 1.0)


def test_ratio_is_hit_over_tokens_clamped() -> None:
    assert hit_ratio(64, 100) == 0.64
    assert hit_ratio(150, 100) == 1.0
    assert hit_ratio(-3, 100) == 0.0


@pytest.mark.parametrize(
    ("hit", "tokens", "threshold", "rejected"),
    [
        pytest.param(0, 100, 0.0, False, id="zero-threshold-never-rejects"),
        pytest.param(0, 100, 0.01, True, id="cold"),
        pytest.param(49, 100, 0.5, True, id="just-below"),
        pytest.param(50, 100, 0.5, False, id="equal-is-admitted"),
        pytest.param(99, 100, 1.0, True, id="one-means-all"),
        pytest.param(100, 100, 1.0, False, id="all-cached"),
    ],
)
def test_below_threshold(hit: int, tokens: int, threshold: float, rejected: bool) -> None:
    assert below_threshold(hit, tokens, threshold) is rejected


@pytest.mark.parametrize(
    ("tokens", "block", "expected"),
    [
        pytest.param(0, 32, 1.0, id="empty"),
        pytest.param(1, 32, 0.0, id="one-token"),
        pytest.param(31, 32, 0.0, id="shorter-than-a-block"),
        pytest.param(32, 32, 0.0, id="exactly-one-block-last-token-recomputed"),
        pytest.param(33, 32, 32 / 33, id="one-block-and-one"),
        pytest.param(192, 32, 160 / 192, id="six-blocks-caps-at-five"),
        pytest.param(100, 16, 96 / 100, id="block-16"),
    ],
)
def test_block_granularity_caps_the_ratio(tokens: int, block: int, expected: float) -> None:
    assert max_hit_ratio(tokens, block) == pytest.approx(expected)


def test_warm_prompt_is_rejected_by_a_threshold_above_its_cap() -> None:
    cap = max_hit_ratio(192, 32)
    best_hit = (192 - 1) // 32 * 32
    assert below_threshold(best_hit, 192, 0.9)
    assert not below_threshold(best_hit, 192, cap)


def test_max_hit_ratio_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block size"):
        max_hit_ratio(10, 0)


def test_resumed_request_counts_outputs_in_the_denominator() -> None:
    prompt, outputs, cached = 150, 100, 128
    assert not below_threshold(cached, prompt, 0.8)
    assert below_threshold(cached, prompt + outputs, 0.8)


# --- stop reason round trip ----------------------------------------------------------


@pytest.mark.parametrize("phase", list(Phase))
def test_stop_reason_round_trip(phase: Phase) -> None:
    assert phase_of_stop_reason(stop_reason_for(phase)) is phase


@pytest.mark.parametrize("other", [None, 7, "stop", "cache_threshold", "cache_threshold:other"])
def test_other_stop_reasons_are_not_rejections(other: object) -> None:
    assert phase_of_stop_reason(other) is None


def test_constants_match_the_rfc_and_simulator() -> None:
    assert policy.FINISH_REASON == "cache_threshold"
    assert policy.EXTRA_ARGS_KEY == "cache_hit_threshold"
    assert {p.value for p in Phase} == {"admission", "preemption"}
