"""Load polling: parsing tables, then the poller against simulators and mock transports."""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

import anyio
import httpx
import pytest
from pydantic import ValidationError

from pd_orchestrator.children import Child, stop_child
from pd_orchestrator.config.settings import TimeoutConfig, UpstreamConfig
from pd_orchestrator.fleet.scraper import (
    LoadConfig,
    LoadScraper,
    MetricsError,
    MetricsReading,
    load_snapshot,
    parse_metrics,
)
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.load import LoadSnapshot
from pd_orchestrator.upstream.client import Upstream
from pd_orchestrator.upstream.mock import MockResponse, MockTransport
from pd_orchestrator.upstream.transport import ConnectFailed, Request, Transport
from tests.conftest import SimFactory

MODEL = "sim-model"


def exposition(values: Mapping[str, float], model: str = "m", engine: str = "0") -> str:
    """Prometheus text with one sample per name, labelled with ``model`` and ``engine``."""
    labels = f'{{model_name="{model}",engine="{engine}"}}'
    return "".join(f"{name}{labels} {value}\n" for name, value in values.items())


BASE = {
    "vllm:num_requests_running": 2.0,
    "vllm:num_requests_waiting": 1.0,
    "vllm:kv_cache_usage_perc": 0.25,
}
COUNTERS = {
    "vllm:prefix_cache_queries_total": 100.0,
    "vllm:prefix_cache_hits_total": 40.0,
    "vllm:num_preemptions_total": 3.0,
}
OLD_NAMES = {
    "vllm:num_requests_running": 4.0,
    "vllm:num_requests_waiting": 0.0,
    "vllm:gpu_cache_usage_perc": 0.5,
    "vllm:gpu_prefix_cache_queries_total": 10.0,
    "vllm:gpu_prefix_cache_hits_total": 5.0,
}
TYPED = """# HELP vllm:num_requests_running Requests running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.1
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{model_name="m"} 8.0
vllm:prefix_cache_queries_created{model_name="m"} 1.7e9
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 2.0
vllm:e2e_request_latency_seconds_count{model_name="m"} 2.0
"""


@pytest.mark.parametrize(
    ("text", "model", "reading"),
    [
        (exposition(BASE), "m", MetricsReading(2.0, 1.0, 0.25)),
        (
            exposition({**BASE, **COUNTERS}),
            None,
            MetricsReading(2.0, 1.0, 0.25, 100.0, 40.0, None, 3.0),
        ),
        (exposition(OLD_NAMES), "m", MetricsReading(4.0, 0.0, 0.5, 10.0, 5.0)),
        (
            exposition({**BASE, "vllm:gpu_cache_usage_perc": 0.9}),
            None,
            MetricsReading(2.0, 1.0, 0.25),
        ),
        (
            exposition({**BASE, "vllm:gpu_prefix_cache_hit_rate": 0.3}),
            None,
            MetricsReading(2.0, 1.0, 0.25, prefix_hit_rate_gauge=0.3),
        ),
        (
            exposition(BASE, "a") + exposition({**BASE, "vllm:kv_cache_usage_perc": 0.75}, "b"),
            "b",
            MetricsReading(2.0, 1.0, 0.75),
        ),
        (
            exposition(BASE, "a") + exposition({**BASE, "vllm:kv_cache_usage_perc": 0.75}, "b"),
            None,
            MetricsReading(4.0, 2.0, 0.5),
        ),
        (
            exposition(BASE, engine="0") + exposition({**BASE, **COUNTERS}, engine="1"),
            "m",
            MetricsReading(4.0, 2.0, 0.25, 100.0, 40.0, None, 3.0),
        ),
        (exposition(BASE, "served-as"), "configured-as", MetricsReading(2.0, 1.0, 0.25)),
        (
            exposition({**BASE, "vllm:kv_cache_usage_perc": 1.5}),
            None,
            MetricsReading(2.0, 1.0, 1.0),
        ),
        (TYPED, "m", MetricsReading(3.0, 0.0, 0.1, prefix_queries=8.0)),
    ],
    ids=[
        "gauges",
        "counters",
        "older-gpu-names",
        "current-name-wins",
        "older-hit-rate-gauge",
        "one-model-of-two",
        "no-model-sums-all",
        "engines-sum-kv-mean",
        "model-label-differs",
        "kv-clamped",
        "typed-text-created-and-histograms-ignored",
    ],
)
def test_parse_metrics(text: str, model: str | None, reading: MetricsReading) -> None:
    assert parse_metrics(text, model) == reading


def _histogram(name: str, buckets: int) -> str:
    """A vLLM-shaped histogram family: HELP, TYPE, buckets, sum and count."""
    labels = 'engine="0",model_name="m"'
    lines = [f"# HELP {name} A histogram.", f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{{labels},le="{2**i}"}} {i}.0' for i in range(buckets)]
    lines += [f"{name}_sum{{{labels}}} 1.0", f"{name}_count{{{labels}}} 2.0"]
    return "\n".join(lines) + "\n"


def test_the_load_series_read_among_a_server_s_other_series() -> None:
    # what a vLLM server also exposes, and names that begin like the load series
    decoys = {"vllm:num_requests_running_max": 99.0, "vllm:kv_cache_usage": 0.99}
    other = _histogram("vllm:time_to_first_token_seconds", 400)
    text = other + exposition({**BASE, **COUNTERS}) + exposition(decoys) + other
    reading = parse_metrics(text, "m")
    alone = parse_metrics(exposition({**BASE, **COUNTERS}), "m")
    assert reading == alone
    assert (reading.running, reading.waiting, reading.kv_usage) == (2.0, 1.0, 0.25)
    assert (reading.prefix_queries, reading.prefix_hits, reading.preemptions) == (100.0, 40.0, 3.0)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "no vllm:num_requests_running sample"),
        (exposition({"vllm:num_requests_running": 1, "vllm:kv_cache_usage_perc": 0}), "waiting"),
        (
            exposition({"vllm:num_requests_running": 1, "vllm:num_requests_waiting": 0}),
            "no vllm:kv_cache_usage_perc sample for model 'm'",
        ),
        ("vllm:num_requests_running{model_name= 1\n", "not Prometheus text"),
        ("<html>busy</html>", "not Prometheus text"),
        (
            exposition({**BASE, "vllm:kv_cache_usage_perc": math.nan}),
            "kv_cache_usage_perc is nan",
        ),
        (exposition({**BASE, "vllm:num_requests_waiting": math.inf}), "waiting is inf"),
    ],
    ids=["empty", "no-waiting", "no-kv-usage", "broken-labels", "html", "nan", "inf"],
)
def test_parse_metrics_errors(text: str, fragment: str) -> None:
    with pytest.raises(MetricsError, match=fragment):
        parse_metrics(text, "m")


@pytest.mark.parametrize(
    ("reading", "previous", "rate", "preemptions"),
    [
        (MetricsReading(1, 0, 0, 100, 40, None, 3), None, 0.4, 0),
        (
            MetricsReading(1, 0, 0, 200, 120, None, 5),
            MetricsReading(0, 0, 0, 100, 40, None, 3),
            0.8,
            2,
        ),
        (
            MetricsReading(1, 0, 0, 100, 40, None, 3),
            MetricsReading(0, 0, 0, 100, 40, None, 3),
            0.4,
            0,
        ),
        (
            MetricsReading(1, 0, 0, 10, 9, None, 1),
            MetricsReading(0, 0, 0, 100, 40, None, 3),
            0.9,
            1,
        ),
        (MetricsReading(1, 0, 0, 0, 0, None, 0), None, None, 0),
        (MetricsReading(1, 0, 0, prefix_hit_rate_gauge=0.3), None, 0.3, 0),
        (MetricsReading(1, 0, 0), MetricsReading(1, 0, 0), None, 0),
    ],
    ids=[
        "first-reading-lifetime",
        "window",
        "quiet-window-lifetime",
        "counter-reset",
        "no-queries-yet",
        "older-gauge",
        "no-prefix-series",
    ],
)
def test_load_snapshot_rates(
    reading: MetricsReading,
    previous: MetricsReading | None,
    rate: float | None,
    preemptions: int,
) -> None:
    snapshot = load_snapshot(reading, 12.5, previous)
    assert snapshot.prefix_hit_rate == (None if rate is None else pytest.approx(rate))
    assert snapshot.preemptions == preemptions and snapshot.observed_at == 12.5


def test_a_quiet_window_after_a_rebase_counts_from_it_not_from_the_start() -> None:
    """Since a rebase reading (100 queries, 0 hits: the gateway's own cold prompts), a
    window with no queries gives no rate (the server's lifetime would give 0), and a
    longer stretch with queries gives theirs alone."""
    since = MetricsReading(0, 0, 0, 100, 0)
    quiet = load_snapshot(MetricsReading(0, 0, 0, 100, 0), 1.0, since, since)
    assert quiet.prefix_hit_rate is None
    later = load_snapshot(
        MetricsReading(0, 0, 0, 140, 30), 2.0, MetricsReading(0, 0, 0, 140, 30), since
    )
    assert later.prefix_hit_rate == pytest.approx(0.75)
    assert load_snapshot(MetricsReading(0, 0, 0, 100, 0), 1.0, since).prefix_hit_rate == 0.0


def test_load_snapshot_counts() -> None:
    snapshot = load_snapshot(MetricsReading(2.0, 3.0, 0.4), 1.0)
    assert (snapshot.running, snapshot.waiting, snapshot.queue_depth) == (2, 3, 5)
    assert snapshot.kv_usage == 0.4 and snapshot.age(3.5) == 2.5 and snapshot.age(0.0) == 0.0


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"interval": 2.0, "stale_after": 1.0}, "stale_after (1.0s) must be at least interval"),
        ({"interval": 0}, "interval"),
        ({"unhealthy_after": 0}, "unhealthy_after"),
        ({"intervall": 1}, "intervall"),
    ],
    ids=["stale-before-next-poll", "zero-interval", "zero-failures", "unknown-key"],
)
def test_load_config_is_checked(data: dict[str, float], fragment: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(fragment)):
        LoadConfig.model_validate(data)


# -- the poller ---------------------------------------------------------------------


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def upstream(transport: Transport | None = None) -> AsyncIterator[Upstream]:
    client = Upstream(UpstreamConfig(), TimeoutConfig(), transport=transport)
    try:
        yield client
    finally:
        await client.aclose()


def _endpoint(name: str, url: str, model: str | None = MODEL) -> Endpoint:
    return Endpoint(name, url, Role.DECODE, "h200", model)


SIM_ARGS = ("--model", MODEL, "--profile", "h200-llama3-8b", "--time-scale", "3")


async def _stream_forever(base_url: str, client: httpx.AsyncClient, index: int) -> None:
    body = {
        "model": MODEL,
        "prompt": [300 + index * 97 + i for i in range(96)],
        "max_tokens": 4000,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for _ in response.aiter_lines():
            pass


async def _poll_until(
    scraper: LoadScraper, endpoint: Endpoint, done: Callable[[LoadSnapshot], bool]
) -> LoadSnapshot:
    with anyio.fail_after(15):
        while True:
            snapshot = await scraper.poll(endpoint)
            if snapshot is not None and done(snapshot):
                return snapshot
            await anyio.sleep(0.05)


@pytest.mark.anyio
async def test_readings_follow_the_requests_a_simulator_runs(sim_factory: SimFactory) -> None:
    sim = sim_factory(*SIM_ARGS, "--max-num-seqs", "2", "--num-kv-blocks", "1024")
    endpoint = _endpoint("d0", sim.url)
    async with upstream() as up, httpx.AsyncClient(timeout=30) as client:
        scraper = LoadScraper(FleetState([endpoint]), up, LoadConfig())
        idle = await scraper.poll(endpoint)
        assert idle is not None and (idle.running, idle.waiting, idle.kv_usage) == (0, 0, 0.0)
        async with anyio.create_task_group() as tg:
            for index in range(3):
                tg.start_soon(_stream_forever, sim.url, client, index)
            busy = await _poll_until(scraper, endpoint, lambda s: s.queue_depth == 3)
            assert (busy.running, busy.waiting) == (2, 1)  # max-num-seqs 2
            assert busy.kv_usage > 0.0
            tg.cancel_scope.cancel()  # closing the streams aborts the requests
        drained = await _poll_until(scraper, endpoint, lambda s: s.queue_depth == 0)
        assert drained.kv_usage < busy.kv_usage
        assert scraper.snapshot("d0") == drained and scraper.is_responsive("d0")


@pytest.mark.anyio
async def test_the_prefix_hit_rate_covers_the_last_window(sim_factory: SimFactory) -> None:
    sim = sim_factory("--model", MODEL, "--profile", "instant")
    endpoint = _endpoint("d0", sim.url)
    body = {"model": MODEL, "prompt": list(range(300, 364)), "max_tokens": 1}
    async with upstream() as up, httpx.AsyncClient(timeout=10) as client:
        scraper = LoadScraper(FleetState([endpoint]), up, LoadConfig())
        assert (await client.post(f"{sim.url}/v1/completions", json=body)).status_code == 200
        first = await scraper.poll(endpoint)
        assert first is not None and first.prefix_hit_rate == 0.0  # a cold cache
        assert (await client.post(f"{sim.url}/v1/completions", json=body)).status_code == 200
        second = await scraper.poll(endpoint)
        assert second is not None and second.prefix_hit_rate is not None
        # The same prompt again: 3 of its 4 blocks hit (the last block is always computed).
        assert second.prefix_hit_rate == 0.75


@pytest.mark.anyio
async def test_the_hit_rate_window_reaches_back_until_it_holds_enough_tokens(
    sim_factory: SimFactory,
) -> None:
    """A cold prompt alone in its window reads 0; with ``hit_rate_tokens`` of two
    prompts' worth the window takes the warm one before it too (3 of its 8 blocks),
    and with 0 the cold one alone."""
    sim = sim_factory("--model", MODEL, "--profile", "instant")
    endpoint = _endpoint("d0", sim.url)
    warm = {"model": MODEL, "prompt": list(range(300, 364)), "max_tokens": 1}
    cold = {"model": MODEL, "prompt": list(range(500, 564)), "max_tokens": 1}
    async with upstream() as up, httpx.AsyncClient(timeout=10) as client:
        reaching = LoadScraper(FleetState([endpoint]), up, LoadConfig(hit_rate_tokens=128))
        alone = LoadScraper(FleetState([endpoint]), up, LoadConfig(hit_rate_tokens=0))
        rates = []
        for body in (warm, warm, cold):
            assert (await client.post(f"{sim.url}/v1/completions", json=body)).status_code == 200
            snapshots = [await reaching.poll(endpoint), await alone.poll(endpoint)]
            rates.append(tuple(s.prefix_hit_rate for s in snapshots if s is not None))
        assert rates == [(0.0, 0.0), (0.75, 0.75), (0.375, 0.0)]
        # a poll with no queries since the last: the server's lifetime, as before
        idle = await reaching.poll(endpoint)
        assert idle is not None and idle.prefix_hit_rate == pytest.approx(0.25)


@pytest.mark.anyio
async def test_a_stopped_simulator_turns_unresponsive_and_its_reading_ages_out(
    sim_factory: SimFactory,
) -> None:
    sim: Child = sim_factory("--model", MODEL, "--profile", "instant")
    endpoint = _endpoint("d0", sim.url)
    fleet = FleetState([endpoint])
    clock = Clock()
    config = LoadConfig(interval=1.0, timeout=0.5, stale_after=5.0, unhealthy_after=3)
    async with upstream() as up:
        scraper = LoadScraper(fleet, up, config, clock=clock)
        await scraper.poll_all()
        reading = scraper.snapshot("d0")
        assert reading is not None and reading.observed_at == clock.now
        stop_child(sim)
        for failures in (1, 2):
            clock.now += 1.0
            assert await scraper.poll(endpoint) is None
            assert scraper.failures("d0") == failures and scraper.is_responsive("d0")
        [candidate] = scraper.candidates(fleet.snapshot())
        assert candidate.healthy and candidate.load == reading  # 2 s old: still fresh
        clock.now += 1.0
        await scraper.poll_all()
        [candidate] = scraper.candidates(fleet.snapshot())
        assert not scraper.is_responsive("d0") and not candidate.healthy
        assert fleet.is_healthy("d0")  # the /health monitor's verdict is its own
        assert scraper.snapshot("d0", now=reading.observed_at + 5.0) == reading
        clock.now = reading.observed_at + 5.01
        assert (
            scraper.snapshot("d0") is None and scraper.candidates(fleet.snapshot())[0].load is None
        )


class Scripted:
    """A mock transport answering ``/metrics`` with the next scripted outcome."""

    def __init__(self, outcomes: list[str | int | None]) -> None:
        self.outcomes = outcomes
        self.calls = 0

    def __call__(self, request: Request) -> MockResponse:
        assert request.path == "/metrics"
        outcome = self.outcomes[min(self.calls, len(self.outcomes) - 1)]
        self.calls += 1
        if outcome is None:
            raise ConnectFailed("refused")
        if isinstance(outcome, int):
            return MockResponse(outcome, text="down")
        return MockResponse(200, text=outcome)


def _text(running: float) -> str:
    return exposition({**BASE, "vllm:num_requests_running": running}, MODEL)


@pytest.mark.anyio
async def test_one_answered_poll_recovers_an_unresponsive_endpoint() -> None:
    endpoint = _endpoint("d0", "http://d0.test")
    script = Scripted([_text(1), None, 503, None, _text(5)])
    config = LoadConfig(unhealthy_after=2)
    async with upstream(MockTransport(script)) as up:
        scraper = LoadScraper(FleetState([endpoint]), up, config, clock=Clock())
        verdicts = []
        for _ in range(5):
            await scraper.poll(endpoint)
            verdicts.append((scraper.is_responsive("d0"), scraper.failures("d0")))
        assert verdicts == [(True, 0), (True, 1), (False, 2), (False, 3), (True, 0)]
        snapshot = scraper.snapshot("d0")
        assert snapshot is not None and snapshot.running == 5


@pytest.mark.anyio
async def test_an_answer_without_load_series_is_no_reading_but_not_a_failure() -> None:
    endpoint = _endpoint("d0", "http://d0.test")
    script = Scripted([_text(2), "# nothing here\n", "not metrics at all {", _text(3)])
    async with upstream(MockTransport(script)) as up:
        scraper = LoadScraper(FleetState([endpoint]), up, LoadConfig(unhealthy_after=1))
        assert await scraper.poll(endpoint) is not None
        for _ in range(2):
            assert await scraper.poll(endpoint) is None
            assert scraper.is_responsive("d0") and scraper.snapshot("d0") is None
        recovered = await scraper.poll(endpoint)
        assert recovered is not None and recovered.running == 3


class _Moving(Scripted):
    """:class:`Scripted`, with ``move`` run on the fleet while each poll is in flight."""

    def __init__(self, outcomes: list[str | int | None], move: Callable[[], None]) -> None:
        super().__init__(outcomes)
        self.move = move

    def __call__(self, request: Request) -> MockResponse:
        self.move()
        return super().__call__(request)


@pytest.mark.anyio
async def test_a_reading_holds_the_requests_the_gateways_counted_while_it_was_taken() -> None:
    """``counted``: the gateways' count of requests in flight at the endpoint (the
    other gateways' shared ones too), the larger of the counts at the poll's send and
    at its answer: a request that came or left during the poll may be in the reading."""
    endpoint = _endpoint("d0", "http://d0.test")
    fleet = FleetState([endpoint])
    moves = iter(
        [lambda: fleet.enter("d0"), lambda: fleet.leave("d0"), lambda: None,
         lambda: fleet.enter("d0")]
    )  # fmt: skip
    async with upstream(MockTransport(_Moving([_text(1)], lambda: next(moves)()))) as up:
        scraper = LoadScraper(fleet, up, LoadConfig())
        seen = []
        for share in ({}, {}, {}, {"d0": (2, 0)}):  # the last: two of another gateway's
            fleet.share(share)
            snapshot = await scraper.poll(endpoint)
            assert snapshot is not None and snapshot.running == 1
            seen.append(snapshot.counted)
    assert seen == [1, 1, 0, 3]  # came during; left during; none; one came, two others'


@pytest.mark.anyio
async def test_run_polls_before_it_reports_started_then_every_interval() -> None:
    endpoints = [_endpoint("d0", "http://d0.test"), _endpoint("d1", "http://d1.test")]
    script = Scripted([_text(1)])
    async with upstream(MockTransport(script)) as up:
        scraper = LoadScraper(FleetState(endpoints), up, LoadConfig(interval=0.05))
        async with anyio.create_task_group() as tg:
            await tg.start(scraper.run)
            assert scraper.polled_once and script.calls == 2
            assert all(scraper.snapshot(e.name) is not None for e in endpoints)
            await anyio.sleep(0.5)  # about ten intervals
            tg.cancel_scope.cancel()
        assert 6 <= script.calls <= 24


@pytest.mark.anyio
async def test_candidates_combine_fleet_health_and_load() -> None:
    endpoints = [_endpoint(name, f"http://{name}.test") for name in ("up", "sick", "mute")]
    fleet = FleetState(endpoints, unhealthy_after=1)
    fleet.record_failure("sick")
    script = Scripted([_text(4), None])  # "up" answers; "mute" is refused
    async with upstream(MockTransport(script)) as up:
        scraper = LoadScraper(fleet, up, LoadConfig(unhealthy_after=1), clock=Clock(50.0))
        await scraper.poll(endpoints[0])
        await scraper.poll(endpoints[2])
        with fleet.in_flight("up"):
            candidates = scraper.candidates(fleet.snapshot(), now=51.0)
    reading = scraper.snapshot("up", now=51.0)
    assert reading is not None and reading.running == 4
    assert [(c.endpoint.name, c.healthy, c.in_flight, c.load) for c in candidates] == [
        ("up", True, 1, reading),
        ("sick", False, 0, None),
        ("mute", False, 0, None),
    ]


def test_the_admission_only_gauge_marks_the_reading_and_its_snapshot() -> None:
    base = (
        'vllm:num_requests_running{model_name="m"} 0\n'
        'vllm:num_requests_waiting{model_name="m"} 0\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.1\n'
    )
    gauge = 'vllm:cache_threshold_admission_only{model_name="m",engine="0"} 1\n'
    assert not parse_metrics(base, "m").admission_only  # an older plugin, or none
    reading = parse_metrics(base + gauge, "m")
    assert reading.admission_only and load_snapshot(reading, 1.0).admission_only


@pytest.mark.anyio
async def test_a_stale_reading_keeps_what_it_said_of_admission_only() -> None:
    endpoint = _endpoint("d0", "http://d0.test")
    gauge = exposition({**BASE, "vllm:cache_threshold_admission_only": 1}, MODEL)
    fleet = FleetState([endpoint])
    async with upstream(MockTransport(Scripted([gauge, _text(1)]))) as up:
        scraper = LoadScraper(fleet, up, LoadConfig(stale_after=5.0), clock=Clock(50.0))
        await scraper.poll(endpoint)
        [fresh] = scraper.candidates(fleet.snapshot(), now=51.0)
        [stale] = scraper.candidates(fleet.snapshot(), now=60.0)  # too old to route on
        assert fresh.load is not None and fresh.admission_only
        assert stale.load is None and stale.admission_only
        await scraper.poll(endpoint)  # restarted with an older plugin: it says so
        [older] = scraper.candidates(fleet.snapshot(), now=51.0)
        assert older.load is not None and not older.admission_only


@pytest.mark.anyio
async def test_a_rebase_starts_the_hit_rate_window_after_the_gateways_own_prompts(
    sim_factory: SimFactory,
) -> None:
    """Cold prompts of the gateway's own (the start-up timing's) miss every block: after
    a rebase the snapshot gives no hit rate, a poll of the idle server none either (not
    0 of 12 since it started), and the next window counts only what came after them (a
    warm prompt's 3 of 4 blocks), not 3 of 12."""
    sim = sim_factory("--model", MODEL, "--profile", "instant")
    endpoint = _endpoint("d0", sim.url)
    warm = {"model": MODEL, "prompt": list(range(300, 364)), "max_tokens": 1}
    cold = [{"model": MODEL, "prompt": list(range(b, b + 64)), "max_tokens": 1} for b in (500, 600)]
    async with upstream() as up, httpx.AsyncClient(timeout=10) as client:
        scraper = LoadScraper(FleetState([endpoint]), up, LoadConfig())
        assert (await client.post(f"{sim.url}/v1/completions", json=warm)).status_code == 200
        assert await scraper.poll(endpoint) is not None
        for body in cold:
            assert (await client.post(f"{sim.url}/v1/completions", json=body)).status_code == 200
        await scraper.rebase(endpoint)
        rebased = scraper.snapshot("d0")
        assert rebased is not None and rebased.prefix_hit_rate is None
        idle = await scraper.poll(endpoint)
        assert idle is not None and idle.prefix_hit_rate is None
        assert (await client.post(f"{sim.url}/v1/completions", json=warm)).status_code == 200
        after = await scraper.poll(endpoint)
        assert after is not None and after.prefix_hit_rate == 0.75
