"""Integration in virtual time: simulated decoders, the routing pipeline, the precise
index fed through the wire codec. On a shared-prefix workload every prefix router
keeps conversations on warm decoders, and no decoder takes more than its fair share
plus a slack."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd_orchestrator.bench.prefix_replay import (
    ROUTERS,
    FleetSpec,
    ReplayResult,
    TraceRequest,
    global_hit_rate,
    mooncake_workload,
    replay,
    shared_prefix_workload,
)

SLACK = 0.12
FLEET = FleetSpec(decoders=4, kv_tokens=64_000)


@pytest.fixture(scope="module")
def workload() -> list[TraceRequest]:
    return shared_prefix_workload(groups=16, users=4, turns=3, rate=4.0, think_seconds=10.0)


@pytest.fixture(scope="module")
def baseline(workload: list[TraceRequest]) -> ReplayResult:
    return replay(workload, "round-robin", ROUTERS["round-robin"], FLEET)


@pytest.mark.parametrize("router", ["approximate", "precise", "precise+queue", "affinity"])
def test_prefix_routers_keep_conversations_warm_within_fair_share(
    workload: list[TraceRequest], baseline: ReplayResult, router: str
) -> None:
    result = replay(workload, router, ROUTERS[router], FLEET)
    assert result.requests == len(workload) == sum(result.per_decoder)
    assert result.sticky >= 0.75
    assert result.hit_rate >= baseline.hit_rate + 0.25
    assert result.hit_rate <= global_hit_rate(workload, FLEET.block_size) + 1e-9
    assert result.max_share <= result.fair_share + SLACK


def test_round_robin_is_fair_and_cold(baseline: ReplayResult) -> None:
    assert baseline.max_share == pytest.approx(baseline.fair_share, abs=0.01)
    assert baseline.sticky < 0.5


def test_replays_are_deterministic(workload: list[TraceRequest]) -> None:
    first = replay(workload[:60], "affinity", ROUTERS["affinity"], FLEET)
    second = replay(workload[:60], "affinity", ROUTERS["affinity"], FLEET)
    assert (first.hit_rate, first.per_decoder) == (second.hit_rate, second.per_decoder)


def test_shared_prefix_workload_shape() -> None:
    items = shared_prefix_workload(groups=2, users=3, turns=2, seed=5)
    assert len(items) == 12
    assert [i.arrival for i in items] == sorted(i.arrival for i in items)
    first, second = (
        next(i for i in items if i.conversation == items[0].conversation and i.turn == t)
        for t in (0, 1)
    )
    assert second.tokens[: len(first.tokens)] == first.tokens
    assert 2000 + 256 <= len(first.tokens) <= 6000 + 1200


def test_mooncake_workload_scales_the_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 1200, "output_length": 64, "hash_ids": [0, 1, 2]}\n'
        '{"timestamp": 2000, "input_length": 1700, "output_length": 9, "hash_ids": [0, 1, 2, 3]}\n'
    )
    first, second = mooncake_workload(trace, limit=5, block_tokens=32, time_scale=2.0)
    assert len(first.tokens) == 75 and len(second.tokens) == 106
    assert second.tokens[:75] == first.tokens
    assert (second.arrival, second.turn, second.output_tokens) == (1.0, 1, 1)
    assert global_hit_rate([first, second], 16) == pytest.approx(64 / (75 + 106))
