"""Load polling: ``GET /metrics`` on every endpoint at a fixed interval.

Parsing is pure: :func:`parse_metrics` turns vLLM's Prometheus text into a
:class:`MetricsReading` (raw gauges and counters) and :func:`load_snapshot` turns a
reading, and the previous one of the same endpoint, into a
:class:`~pd_orchestrator.routing.types.LoadSnapshot` (counters become rates over
the window between the two; the prefix hit rate's window reaches further back,
until it holds ``hit_rate_tokens`` queried tokens: :mod:`~pd_orchestrator.model.hit_window`).

:class:`LoadScraper` polls (through :class:`~pd_orchestrator.upstream.client.Upstream`)
and keeps, per endpoint, the latest snapshot and its own count of failed polls.
A snapshot older than ``stale_after`` counts as absent. ``unhealthy_after`` failed
polls in a row (no answer within ``timeout``, or a status other than 200) mark the
endpoint unresponsive; one answered poll marks it responsive again. This verdict
is kept here rather than in :class:`~pd_orchestrator.fleet.state.FleetState`,
whose failure streak belongs to the ``/health`` monitor (a success of one would
reset the other's streak); :meth:`LoadScraper.candidates` combines both. A poll
answered with text that has no vLLM load series keeps the endpoint responsive but
leaves it without a reading.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import replace

import anyio
from anyio.abc import TaskStatus
from prometheus_client.parser import text_string_to_metric_families

from pd_orchestrator.config.load import LoadConfig
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.model.endpoints import Endpoint, EndpointStatus
from pd_orchestrator.model.hit_window import HitWindow
from pd_orchestrator.model.load import Candidate, LoadSnapshot
from pd_orchestrator.model.records import record
from pd_orchestrator.upstream.client import Upstream
from pd_orchestrator.upstream.errors import UpstreamError

__all__ = [
    "LOAD_SERIES",
    "LoadConfig",
    "LoadScraper",
    "MetricsError",
    "MetricsReading",
    "load_snapshot",
    "parse_metrics",
]

logger = logging.getLogger("pd_orchestrator.fleet")

# Sample names, current vLLM name first, then older ones.
_RUNNING = ("vllm:num_requests_running",)
_WAITING = ("vllm:num_requests_waiting",)
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
_PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
_HIT_RATE_GAUGE = ("vllm:gpu_prefix_cache_hit_rate",)
_PREEMPTIONS = ("vllm:num_preemptions_total",)
_ADMISSION_ONLY = ("vllm:cache_threshold_admission_only",)
_RESUMES = ("vllm:cache_threshold_resume",)
_WANTED = frozenset(
    [
        *_ADMISSION_ONLY,
        *_RESUMES,
        *_RUNNING,
        *_WAITING,
        *_KV_USAGE,
        *_PREFIX_QUERIES,
        *_PREFIX_HITS,
        *_HIT_RATE_GAUGE,
        *_PREEMPTIONS,
    ]
)


LOAD_SERIES = _WANTED
"""Every vLLM sample name the scraper reads (current and older names)."""


class MetricsError(ValueError):
    """Metrics text that is not Prometheus text or lacks the load series."""


@record
class MetricsReading:
    """Load series of one scrape, summed over the label sets read.

    ``kv_usage`` is the mean over label sets (one per engine of a data-parallel
    server), clamped to [0, 1]; counters are cumulative; ``prefix_hit_rate_gauge``
    is the hit-rate gauge older vLLM servers export. None: series absent.
    ``admission_only``: the threshold plugin's gauge says it honours
    ``cache_hit_admission_only``; ``resumes``: that it honours
    ``cache_hit_resume_tokens``.
    """

    running: float
    waiting: float
    kv_usage: float
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    prefix_hit_rate_gauge: float | None = None
    preemptions: float | None = None
    admission_only: bool = False
    resumes: bool = False


def _wanted_lines(text: str) -> str:
    """The sample lines of ``text`` whose metric name is wanted. A vLLM server's text
    runs to hundreds of lines (740 on the CPU pair, most of them histogram buckets),
    which the parser would build objects for on the event loop at every poll of every
    endpoint; the load series are a dozen of them."""
    wanted = [
        line for line in text.splitlines() if line.partition("{")[0].partition(" ")[0] in _WANTED
    ]
    return "\n".join(wanted) + "\n" if wanted else ""


def _samples(text: str) -> list[tuple[str, str | None, float]]:
    """``(name, model_name label, value)`` of every wanted sample (the whole text is
    parsed only when no line is wanted, to say what it is instead)."""
    try:
        return [
            (sample.name, sample.labels.get("model_name"), float(sample.value))
            for family in text_string_to_metric_families(_wanted_lines(text) or text)
            for sample in family.samples
            if sample.name in _WANTED
        ]
    except ValueError as exc:
        raise MetricsError(f"not Prometheus text: {exc}") from None


def _by_name(text: str, model: str | None) -> dict[str, list[float]]:
    """Values per sample name, of ``model``'s label sets when the text has any."""
    samples = _samples(text)
    if model is not None and any(label == model for _, label, _ in samples):
        samples = [s for s in samples if s[1] in (model, None)]
    values: defaultdict[str, list[float]] = defaultdict(list)
    for name, _, value in samples:
        if not math.isfinite(value):
            raise MetricsError(f"{name} is {value}")
        values[name].append(value)
    return values


def _first(values: dict[str, list[float]], names: tuple[str, ...]) -> list[float] | None:
    return next((values[n] for n in names if values.get(n)), None)


def _sum(values: dict[str, list[float]], names: tuple[str, ...]) -> float | None:
    found = _first(values, names)
    return None if found is None else sum(found)


def _required(
    values: dict[str, list[float]], names: tuple[str, ...], model: str | None
) -> list[float]:
    found = _first(values, names)
    if found is None:
        of = f" for model {model!r}" if model is not None else ""
        raise MetricsError(f"no {names[0]} sample{of}")
    return found


def _ratio(value: float) -> float:
    return min(1.0, max(0.0, value))


def parse_metrics(text: str, model: str | None = None) -> MetricsReading:
    """The load series in ``text`` (Prometheus text format, vLLM names).

    With ``model``, only label sets whose ``model_name`` is ``model`` (or that have
    no ``model_name``) are read, unless no label set names ``model`` (vLLM serves
    one model per process, possibly under another name): then all are. Raises
    :class:`MetricsError` when the text does not parse, a load series is not a
    finite number, or running, waiting or KV usage is missing.
    """
    values = _by_name(text, model)
    running = sum(_required(values, _RUNNING, model))
    waiting = sum(_required(values, _WAITING, model))
    kv_usages = _required(values, _KV_USAGE, model)
    gauge = _first(values, _HIT_RATE_GAUGE)
    return MetricsReading(
        running=max(0.0, running),
        waiting=max(0.0, waiting),
        kv_usage=_ratio(sum(kv_usages) / len(kv_usages)),
        prefix_queries=_sum(values, _PREFIX_QUERIES),
        prefix_hits=_sum(values, _PREFIX_HITS),
        prefix_hit_rate_gauge=None if gauge is None else _ratio(gauge[0]),
        preemptions=_sum(values, _PREEMPTIONS),
        admission_only=bool(_sum(values, _ADMISSION_ONLY)),
        resumes=bool(_sum(values, _RESUMES)),
    )


def _increase(current: float | None, before: float | None) -> float | None:
    """A counter's increase since ``before``; its whole value after a reset."""
    if current is None or before is None:
        return None
    return current if current < before else current - before


def _hit_rate(
    reading: MetricsReading, previous: MetricsReading | None, since: MetricsReading | None
) -> float | None:
    queries, hits = reading.prefix_queries, reading.prefix_hits
    if queries is not None and hits is not None:
        for start in (previous, since):
            if start is None:
                continue
            window_queries = _increase(queries, start.prefix_queries)
            window_hits = _increase(hits, start.prefix_hits)
            if window_queries and window_hits is not None:
                return _ratio(window_hits / window_queries)
        if since is not None:
            return None
        if queries > 0:
            return _ratio(hits / queries)
    return reading.prefix_hit_rate_gauge


def load_snapshot(
    reading: MetricsReading,
    observed_at: float,
    previous: MetricsReading | None = None,
    since: MetricsReading | None = None,
    *,
    start: MetricsReading | None = None,
    counted: int = 0,
) -> LoadSnapshot:
    """The snapshot of ``reading``, taken at ``observed_at`` while the gateways counted
    ``counted`` requests in flight at the endpoint.

    ``previous`` is the endpoint's reading before this one, ``start`` the one the hit
    rate's window starts at (:class:`~pd_orchestrator.model.hit_window.HitWindow`;
    default ``previous``). The prefix hit rate is hits over queries in the window
    between ``start`` and ``reading``; when the window saw no queries (or there is no
    start), since ``since`` (a reading taken after requests no client sent:
    :meth:`LoadScraper.rebase`; None when none was queried since), else since the
    server started; else the older servers' gauge; else None. Preemptions count the
    window since ``previous`` (0 without one).
    """
    before = previous.preemptions if previous is not None else None
    preempted = _increase(reading.preemptions, before) or 0.0
    return LoadSnapshot(
        running=round(reading.running),
        waiting=round(reading.waiting),
        kv_usage=reading.kv_usage,
        observed_at=observed_at,
        prefix_hit_rate=_hit_rate(reading, previous if start is None else start, since),
        preemptions=round(preempted),
        prefix_queries=reading.prefix_queries,
        admission_only=reading.admission_only,
        resumes=reading.resumes,
        counted=counted,
    )


class LoadScraper:
    """Polls every endpoint of ``fleet`` until cancelled; see the module docstring.

    ``clock`` stamps readings; requests must carry ``now`` from the same clock.
    """

    def __init__(
        self,
        fleet: FleetState,
        upstream: Upstream,
        config: LoadConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.upstream = upstream
        self.config = config
        self.clock = clock
        self.polled_once = False
        self._readings: dict[str, MetricsReading] = {}
        self._since: dict[str, MetricsReading] = {}
        self._windows: dict[str, HitWindow[MetricsReading]] = {}
        self._snapshots: dict[str, LoadSnapshot] = {}
        self._failures: dict[str, int] = {}
        self._unreadable_names: set[str] = set()
        self._changed: set[str] = set()
        self._kept: dict[str, Candidate] = {}
        self._kept_all: tuple[Candidate, ...] = ()
        self._kept_until = -math.inf
        self._kept_at = math.inf

    async def poll(self, endpoint: Endpoint) -> LoadSnapshot | None:
        """One poll of one endpoint; records and returns its snapshot (None: no reading),
        with the requests the gateways counted there meanwhile (``counted``). Whatever
        its outcome, the endpoint's candidate is made again (:meth:`current`)."""
        counted = self.fleet.counted(endpoint.name)
        try:
            response = await self.upstream.get(endpoint, "/metrics", limit=self.config.timeout)
        except UpstreamError as exc:
            self._failed(endpoint.name, str(exc))
            return None
        finally:
            self._changed.add(endpoint.name)
        if response.status_code != 200:
            self._failed(endpoint.name, f"/metrics answered {response.status_code}")
            return None
        self._answered(endpoint.name)
        try:
            reading = parse_metrics(response.text, endpoint.model)
        except MetricsError as exc:
            self._unreadable(endpoint.name, str(exc))
            return None
        self._unreadable_names.discard(endpoint.name)
        name = endpoint.name
        window, queries = self._window(name), reading.prefix_queries
        start = None if queries is None else window.start(queries)
        counted = max(counted, self.fleet.counted(name))
        snapshot = load_snapshot(
            reading, self.clock(), self._readings.get(name), self._since.get(name),
            start=start, counted=counted,
        )  # fmt: skip
        if queries is not None:
            window.moved(queries, reading)
        self._readings[endpoint.name] = reading
        self._snapshots[endpoint.name] = snapshot
        return snapshot

    async def rebase(self, endpoint: Endpoint) -> None:
        """Count ``endpoint``'s hit rate from now on, after requests of the gateway's own
        (the start-up timing's cold prompts) that no client's traffic is: one poll,
        whose snapshot keeps everything but the hit rate of a window that held them
        (None until the next poll), and whose reading stands for the server's start
        when a later window sees no queries (an idle server read since its start
        would give the probe's misses, a rate of 0, at every poll)."""
        snapshot = await self.poll(endpoint)
        if snapshot is not None:
            name, reading = endpoint.name, self._readings[endpoint.name]
            self._snapshots[name] = replace(snapshot, prefix_hit_rate=None)
            self._since[name] = reading
            if reading.prefix_queries is not None:
                self._window(name).restart(reading.prefix_queries, reading)

    def _window(self, name: str) -> HitWindow[MetricsReading]:
        """``name``'s hit-rate window starts (made on first use)."""
        window = self._windows.get(name)
        if window is None:
            window = self._windows[name] = HitWindow(self.config.hit_rate_tokens)
        return window

    async def poll_all(self) -> None:
        """Poll every endpoint of the fleet, concurrently."""
        async with anyio.create_task_group() as tg:
            for endpoint in self.fleet.endpoints():
                tg.start_soon(self.poll, endpoint)
        self.polled_once = True

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Poll now, report started, then poll every ``interval`` seconds."""
        await self.poll_all()
        task_status.started()
        while True:
            await anyio.sleep(self.config.interval)
            await self.poll_all()

    def _failed(self, name: str, why: str) -> None:
        failures = self._failures.get(name, 0) + 1
        self._failures[name] = failures
        if failures == self.config.unhealthy_after:
            logger.warning("%s unresponsive after %d failed load polls: %s", name, failures, why)

    def _unreadable(self, name: str, why: str) -> None:
        """An answer without a reading: forget the last one (it must not look fresh)."""
        self._readings.pop(name, None)
        self._snapshots.pop(name, None)
        if name not in self._unreadable_names:
            self._unreadable_names.add(name)
            logger.warning("no load reading from %s: %s", name, why)

    def _answered(self, name: str) -> None:
        if not self.is_responsive(name):
            logger.info("%s answers load polls again", name)
        self._failures[name] = 0

    def failures(self, name: str) -> int:
        """Failed polls of ``name`` in a row."""
        return self._failures.get(name, 0)

    def is_responsive(self, name: str) -> bool:
        """False once ``unhealthy_after`` polls in a row failed, until one is answered."""
        return self.failures(name) < self.config.unhealthy_after

    def snapshot(self, name: str, now: float | None = None) -> LoadSnapshot | None:
        """The latest snapshot of ``name`` unless older than ``stale_after`` at ``now``
        (default: the clock's now)."""
        snapshot = self._snapshots.get(name)
        if snapshot is None:
            return None
        now = self.clock() if now is None else now
        return None if snapshot.age(now) > self.config.stale_after else snapshot

    def candidates(
        self, statuses: Iterable[EndpointStatus], now: float | None = None
    ) -> tuple[Candidate, ...]:
        """Routing candidates for ``statuses`` (a fleet snapshot): healthy when both the
        health checks and the load polls say so, with the fresh snapshot if any and
        what the latest, fresh or not, says of the plugin's capabilities."""
        now = self.clock() if now is None else now
        return tuple([self._candidate(status, now) for status in statuses])

    def current(self, now: float) -> tuple[Candidate, ...]:
        """``candidates(fleet.snapshot(), now)``, kept current rather than rebuilt: only
        the endpoints whose status or reading changed since the last call are made
        again (what :meth:`FleetState.take_changed` and this poller's own changes
        name), and every one when a fresh reading may have gone stale since (the
        earliest fresh reading's ``stale_after`` passed) or the clock went back. The
        decision's cost per request then grows with what changed, not with the fleet.
        One reader: each call takes the fleet's changes."""
        fleet_changed = self.fleet.take_changed()
        if fleet_changed is None or not self._kept_at <= now <= self._kept_until:
            self._changed.clear()
            return self._keep_all(now)
        changed = self._changed
        if changed or fleet_changed:
            kept, status_of = self._kept, self.fleet.status_of
            made = [
                self._candidate(status_of(name), now)
                for name in changed | fleet_changed
                if name in kept
            ]
            for candidate in made:
                kept[candidate.endpoint.name] = candidate
            self._kept_until = min(self._kept_until, self._fresh_until(made))
            changed.clear()
            self._kept_all = tuple(kept.values())
        self._kept_at = now
        return self._kept_all

    def _keep_all(self, now: float) -> tuple[Candidate, ...]:
        """Every candidate made again (:meth:`current`)."""
        statuses = self.fleet.snapshot()
        self._kept = {status.endpoint.name: self._candidate(status, now) for status in statuses}
        self._kept_all = tuple(self._kept.values())
        self._kept_until = self._fresh_until(self._kept_all)
        self._kept_at = now
        return self._kept_all

    def _fresh_until(self, candidates: Iterable[Candidate]) -> float:
        """When the first of the fresh readings of ``candidates`` goes stale (never,
        with none)."""
        fresh = [c.load.observed_at for c in candidates if c.load is not None]
        return (min(fresh) if fresh else math.inf) + self.config.stale_after

    def _candidate(self, status: EndpointStatus, now: float) -> Candidate:
        """``status``'s endpoint as a candidate: what :meth:`snapshot` and
        :meth:`is_responsive` say of it, and its latest reading's capabilities."""
        name = status.endpoint.name
        return Candidate.from_status(
            status,
            self.snapshot(name, now),
            responsive=self.is_responsive(name),
            latest=self._snapshots.get(name),
        )
