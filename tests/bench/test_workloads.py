"""Workload generators: deterministic, and shaped as specified."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from pd_orchestrator.bench.workloads import (
    WORKLOADS,
    BenchRequest,
    Segment,
    Workload,
    WorkloadOptions,
    build_workload,
    digest_segments,
    materialize,
    mooncake,
    timestamp_step,
)
from pd_orchestrator.sim.tokenizer import NUM_WORDS, WORD_BASE


def _trace(tmp_path: Path) -> Path:
    lines = [
        {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
        {"timestamp": 500, "input_length": 1500, "output_length": 20, "hash_ids": [0, 1, 2]},
        {"timestamp": 2000, "input_length": 600, "output_length": 5, "hash_ids": [0, 7]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("name", [w for w in WORKLOADS if w != "mooncake"])
def test_synthetic_workloads_are_deterministic(name: str) -> None:
    first = build_workload(name, WorkloadOptions(seed=3))
    again = build_workload(name, WorkloadOptions(seed=3))
    other = build_workload(name, WorkloadOptions(seed=4))
    assert first == again
    assert first != other


def test_mooncake_blocks_lengths_and_time_scaling(tmp_path: Path) -> None:
    workload = mooncake(WorkloadOptions(trace=_trace(tmp_path), time_scale=0.5, bursts=True))
    first, second, third = workload.requests
    assert [s.length for s in first.segments] == [512, 488]
    assert [r.own_tokens for r in workload.requests] == [1000, 1500, 600]
    assert [r.max_tokens for r in workload.requests] == [10, 20, 5]
    assert [r.arrival for r in workload.requests] == [0.0, 0.25, 1.0]
    # a shared hash id is the same content: the second request extends the first
    assert second.segments[0] == first.segments[0]
    assert materialize(second.segments)[:512] == materialize(first.segments)[:512]
    assert materialize(third.segments)[512:] != materialize(first.segments)[512:600]


def test_mooncake_size_scale_and_limit(tmp_path: Path) -> None:
    options = WorkloadOptions(trace=_trace(tmp_path), size_scale=0.25, requests=2)
    workload = mooncake(options)
    assert len(workload) == 2
    assert [s.length for s in workload.requests[1].segments] == [128, 128, 119]


def test_mooncake_seed_picks_a_window_of_the_trace(tmp_path: Path) -> None:
    trace = _trace(tmp_path)
    first = mooncake(WorkloadOptions(trace=trace, requests=2))
    second = mooncake(WorkloadOptions(trace=trace, requests=2, seed=1, time_scale=0.5, bursts=True))
    assert [r.own_tokens for r in first.requests] == [1000, 1500]
    # the third line only, its clock from its own timestamp
    assert [r.own_tokens for r in second.requests] == [600]
    assert [r.arrival for r in second.requests] == [0.0]
    assert [r.max_tokens for r in second.requests] == [5]
    assert "lines 3-3" in second.description and "lines 1-2" in first.description
    # the same hash id is the same content in every window
    assert second.requests[0].segments[0] == first.requests[0].segments[0]
    pairs = mooncake(WorkloadOptions(trace=trace, requests=1, seed=1, time_scale=0.5))
    assert [r.own_tokens for r in pairs.requests] == [1500]
    assert [r.arrival for r in pairs.requests] == [0.0]
    # an offset moves every window: seed 0 after one line is seed 1's window above
    moved = mooncake(WorkloadOptions(trace=trace, requests=1, trace_offset=1))
    assert [r.own_tokens for r in moved.requests] == [1500] and "lines 2-2" in moved.description
    assert moved.window == "lines 2-2, development"
    long = _ticks(tmp_path, ticks=241, per_tick=10)
    held = mooncake(WorkloadOptions(trace=long, requests=5, trace_offset=2400))
    assert held.window == "lines 2401-2405, held out" and held.window in held.description
    with pytest.raises(ValueError, match="offset"):
        WorkloadOptions(trace_offset=-1)


def _ticks(tmp_path: Path, ticks: int, per_tick: int, step: int = 3000) -> Path:
    """A trace of ``per_tick`` requests at each of ``ticks`` timestamps ``step`` ms
    apart, with the trace's jitter (+-1 ms) on every other tick."""
    lines = [
        {
            "timestamp": t * step + (t % 2),
            "input_length": 600,
            "output_length": 8,
            "hash_ids": [t, i],
        }
        for t in range(ticks)
        for i in range(per_tick)
    ]
    path = tmp_path / "ticks.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_timestamp_step_is_detected_from_the_distinct_timestamps() -> None:
    assert timestamp_step([0, 0, 3000, 5999, 9000, 15001]) == pytest.approx(3000.2, abs=0.5)
    assert timestamp_step([0, 1000, 1000, 3000]) == pytest.approx(1000.0)
    assert timestamp_step([5, 5, 5]) == 0.0 and timestamp_step([]) == 0.0


def test_mooncake_spreads_each_step_and_replays_bursts_on_request(tmp_path: Path) -> None:
    trace = _ticks(tmp_path, ticks=4, per_tick=10)
    spread = mooncake(WorkloadOptions(trace=trace, time_scale=0.5))
    bursts = mooncake(WorkloadOptions(trace=trace, time_scale=0.5, bursts=True))
    assert [r.arrival for r in bursts.requests[:10]] == [0.0] * 10
    assert "bursts as recorded" in bursts.description
    arrivals = [r.arrival for r in spread.requests]
    assert "spread over 3s steps" in spread.description
    # in trace order, each tick's requests within its own (scaled) step, no two together
    assert arrivals == sorted(arrivals) and len(set(arrivals)) == len(arrivals)
    for tick in range(4):
        own = arrivals[tick * 10 : (tick + 1) * 10]
        start = bursts.requests[tick * 10].arrival
        assert all(start <= a < start + 1.5 for a in own)
        assert max(own) - min(own) > 0.5
    # seeded: the same options spread the same way
    assert mooncake(WorkloadOptions(trace=trace, time_scale=0.5)) == spread


def test_mooncake_windows_out_of_the_trace_are_refused(tmp_path: Path) -> None:
    trace = _trace(tmp_path)
    with pytest.raises(ValueError, match="ends before seed 2's window"):
        mooncake(WorkloadOptions(trace=trace, requests=2, seed=2))
    with pytest.raises(ValueError, match="needs --requests"):
        mooncake(WorkloadOptions(trace=trace, seed=1))
    with pytest.raises(ValueError, match=">= 0"):
        mooncake(WorkloadOptions(trace=trace, requests=1, seed=-1))


def test_mooncake_needs_a_well_formed_trace(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="trace file"):
        mooncake(WorkloadOptions())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="trace line 1"):
        mooncake(WorkloadOptions(trace=bad))


def test_shared_prefix_shape() -> None:
    workload = build_workload("shared-prefix", WorkloadOptions())
    systems = {r.segments[0] for r in workload.requests}
    assert len(workload) == 16 * 64 and len(systems) == 16
    assert all(2048 <= r.segments[0].length <= 6000 for r in workload.requests)
    assert all(256 <= r.segments[1].length <= 1200 for r in workload.requests)
    assert {r.max_tokens for r in workload.requests} == {256}
    arrivals = [r.arrival for r in workload.requests]
    assert arrivals == sorted(arrivals)


def test_shared_prefix_longer_draw_adds_users_and_keeps_shorter_draws() -> None:
    long = build_workload("shared-prefix", WorkloadOptions(requests=3000, seed=3))
    sessions = {r.session for r in long.requests}
    assert len(long) == 3000 and len(sessions) == 3000  # one question per user
    assert len({r.segments[0] for r in long.requests}) == 16
    assert "16 groups x 188 users" in long.description
    # a draw within 16 x 64 is the same as before longer draws existed
    short = build_workload("shared-prefix", WorkloadOptions(requests=400, seed=3))
    full = build_workload("shared-prefix", WorkloadOptions(seed=3))
    assert short.requests == full.requests[:400]
    assert "16 groups x 64 users" in short.description


def test_multi_turn_shape() -> None:
    workload = build_workload("multi-turn", WorkloadOptions())
    sessions: dict[str, list[BenchRequest]] = {}
    for request in workload.requests:
        sessions.setdefault(request.session, []).append(request)
    assert all(5 <= len(turns) <= 20 for turns in sessions.values())
    for turns in sessions.values():
        assert turns[0].after is None and not turns[0].extends
        assert all(t.after == p.index and t.extends for p, t in itertools.pairwise(turns))


def test_multi_turn_budget_spans_open_loop_conversations_not_a_few_closed_loops() -> None:
    workload = build_workload("multi-turn", WorkloadOptions(requests=400, seed=2))
    assert len(workload) == 400
    sessions: dict[str, list[BenchRequest]] = {}
    for request in workload.requests:
        sessions.setdefault(request.session, []).append(request)
    # the first 400 turns in time, not the first ~32 conversations whole
    assert len(sessions) > 60
    for turns in sessions.values():
        assert [t.turn for t in turns] == list(range(len(turns)))  # each a prefix
        assert turns[0].after is None
        assert all(t.after == p.index and t.extends for p, t in itertools.pairwise(turns))
    # conversation starts are open loop at the rate: ~2/s, not all at once
    starts = sorted(turns[0].arrival for turns in sessions.values())
    span = starts[-1] - starts[0]
    assert 0.5 < (len(starts) - 1) / span < 8.0
    faster = build_workload("multi-turn", WorkloadOptions(requests=400, seed=2, rate=8.0))
    assert len({r.session for r in faster.requests}) > len(sessions)


def test_long_doc_shape() -> None:
    workload = build_workload("long-doc", WorkloadOptions())
    documents = [r.segments[0] for r in workload.requests]
    assert all(8192 <= d.length <= 32768 for d in documents)
    reused = len(documents) - len(set(documents))
    assert 0 < reused < len(documents) * 0.25


def test_time_scale_compresses_arrivals_and_limit_keeps_predecessors() -> None:
    base = build_workload("multi-turn", WorkloadOptions())
    fast = build_workload("multi-turn", WorkloadOptions(time_scale=0.5, requests=30))
    assert len(fast) == 30
    assert fast.requests[5].arrival == pytest.approx(base.requests[5].arrival * 0.5)
    assert all(r.after is None or r.after < r.index for r in fast.requests)


def test_tokens_are_words_and_digests_share_exactly_the_common_prefix() -> None:
    a = (Segment(1, 40), Segment(2, 30))
    b = (Segment(1, 40), Segment(3, 30))
    tokens = materialize(a)
    assert len(tokens) == 70 and all(WORD_BASE <= t < WORD_BASE + NUM_WORDS for t in tokens)
    da, db = digest_segments(a, 16), digest_segments(b, 16)
    assert da.num_tokens == 70 and len(da.block_hashes) == 4 and len(da.tail) == 6
    common = sum(x == y for x, y in zip(da.block_hashes, db.block_hashes, strict=True))
    assert common == 2  # 40 shared tokens: two full blocks of 16
    assert digest_segments(a, 16) == da
    assert da.tail == tuple(tokens[64:])


def test_workload_rejects_out_of_order_requests() -> None:
    request = BenchRequest(index=1, session="s", turn=0, segments=(Segment(1, 4),), max_tokens=1)
    with pytest.raises(ValueError, match="position 0"):
        Workload("w", "", (request,))
