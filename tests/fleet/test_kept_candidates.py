"""The routing candidates kept current (``LoadScraper.current``) against the ones made
afresh from a fleet snapshot (``LoadScraper.candidates``), through every kind of
change a gateway sees: requests entering and leaving, health checks, ejections and
returns, other gateways' loads, load polls answered, refused or unreadable, readings
going stale, a clock that goes back."""

from __future__ import annotations

import random

import pytest

from pd_orchestrator.config.settings import OutlierConfig
from pd_orchestrator.fleet.scraper import LoadConfig, LoadScraper
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.upstream.errors import UpstreamStatusError
from pd_orchestrator.upstream.mock import MockResponse, MockTransport
from pd_orchestrator.upstream.transport import ConnectFailed, Request
from tests.fleet.test_scraper import MODEL, Clock, _text, upstream

NAMES = ("d0", "d1", "d2", "p0", "p1")


def _endpoints() -> list[Endpoint]:
    return [
        Endpoint(name, f"http://{name}.test", Role.DECODE if name[0] == "d" else Role.PREFILL,
                 "h200", MODEL)
        for name in NAMES
    ]  # fmt: skip


class Answers:
    """``/metrics`` answered by a seeded draw: a reading, a refusal, a 503, or text that
    holds no reading."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def __call__(self, request: Request) -> MockResponse:
        draw = self.rng.random()
        if draw < 0.1:
            raise ConnectFailed("refused")
        if draw < 0.15:
            return MockResponse(503, text="busy")
        if draw < 0.2:
            return MockResponse(200, text="# nothing of vLLM here\n")
        return MockResponse(200, text=_text(self.rng.randrange(8)))


def _change(rng: random.Random, fleet: FleetState, held: list[tuple[str, int]]) -> None:
    """One change of the fleet's state, drawn (a leg's success or break included)."""
    name = rng.choice(NAMES)
    draw = rng.randrange(9)
    if draw <= 2:
        backlog = rng.randrange(3000)
        fleet.enter(name, backlog)
        held.append((name, backlog))
    elif draw == 3 and held:
        gone, backlog = held.pop(rng.randrange(len(held)))
        fleet.answered(gone, backlog)
        held.append((gone, 0))
    elif draw == 4 and held:
        gone, backlog = held.pop(rng.randrange(len(held)))
        fleet.leave(gone, backlog)
    elif draw == 5:
        fleet.record_check(name, rng.random() < 0.5, late=rng.random() < 0.3)
    elif draw == 6:
        fleet.record_error(name, UpstreamStatusError(name, "decode", 500, "boom"))
    elif draw == 7 and rng.random() < 0.7:
        fleet.record_success(name)
    elif draw == 7:
        fleet.mark_unhealthy(name)
    else:
        others = {n: (rng.randrange(4), rng.randrange(5000)) for n in NAMES if rng.random() < 0.5}
        fleet.share(others if rng.random() < 0.8 else {})


@pytest.mark.anyio
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_the_kept_candidates_are_the_ones_made_afresh(seed: int) -> None:
    rng = random.Random(seed)
    clock = Clock(100.0)
    endpoints = _endpoints()
    outlier = OutlierConfig(consecutive_failures=2, max_ejection_percent=50.0,
                            base_ejection_time=1.0)  # fmt: skip
    fleet = FleetState(endpoints, unhealthy_after=2, outlier=outlier, clock=clock)
    held: list[tuple[str, int]] = []
    kinds: set[str] = set()
    async with upstream(MockTransport(Answers(rng))) as up:
        config = LoadConfig(unhealthy_after=2, stale_after=3.0)
        scraper = LoadScraper(fleet, up, config, clock=clock)
        for step in range(600):
            draw = rng.random()
            if draw < 0.5:
                _change(rng, fleet, held)
            elif draw < 0.75:
                await scraper.poll(rng.choice(endpoints))
            elif draw < 0.97:
                clock.now += rng.choice((0.0, 0.2, 0.9, 2.5))
            else:
                clock.now -= 1.0  # a clock that went back
            kept = scraper.current(clock.now)
            afresh = scraper.candidates(fleet.snapshot(), clock.now)
            assert kept == afresh, f"step {step}"
            for candidate in kept:
                kinds.add("fresh" if candidate.load is not None else "no reading")
                kinds.add("healthy" if candidate.healthy else "out of routing")
                kinds.add("busy" if candidate.in_flight else "idle")
    assert kinds == {"fresh", "no reading", "healthy", "out of routing", "busy", "idle"}


@pytest.mark.anyio
async def test_a_request_makes_again_only_the_candidate_it_changed() -> None:
    clock = Clock(100.0)
    endpoints = _endpoints()
    fleet = FleetState(endpoints)
    async with upstream(MockTransport(lambda request: MockResponse(200, text=_text(1)))) as up:
        scraper = LoadScraper(fleet, up, LoadConfig(stale_after=3.0), clock=clock)
        for endpoint in endpoints:
            await scraper.poll(endpoint)
        before = scraper.current(clock.now)
        assert scraper.current(clock.now) is before  # nothing changed: the same tuple
        fleet.enter("d1", 500)
        after = scraper.current(clock.now)
        changed = [b.endpoint.name for b, a in zip(before, after, strict=True) if b is not a]
        assert changed == ["d1"] and after[1].in_flight == 1 and after[1].backlog == 500
        await scraper.poll(endpoints[3])
        polled = scraper.current(clock.now)
        changed = [a.endpoint.name for a, p in zip(after, polled, strict=True) if a is not p]
        assert changed == ["p0"]
        clock.now += 3.5  # every reading stale: each candidate made again, without its load
        stale = scraper.current(clock.now)
        assert all(c.load is None for c in stale)
        assert stale == scraper.candidates(fleet.snapshot(), clock.now)
