"""The soak: the embedded system under a steady load and recurring faults for an hour.

:func:`run_soak` starts simulated pools (two decoders, one of them short of KV
blocks so that it preempts; two prefillers), a
reference instance no fault touches, and the gateway in front of the pools, all on
loopback. It sends requests at ``rate`` per second (at most ``concurrency`` at once):
plain streamed and whole ones on both APIs, constrained ones (``json_schema``, a
named tool), ``n`` > 1, repeats of earlier prompts (warm: decode-first) and clients
that leave mid-stream. Each period (:data:`FAULTS`) a decoder is killed and
restarted on its port, a prefiller answers HTTP 500 to every request for a while, and
the other decoder breaks every answer after a few tokens for a while; while the first
decoder is down, a preemption round (:func:`preemption_round`) overflows the other's
KV cache so that it hands requests back mid-answer.

Every answer is judged against the reference's tokens
(:mod:`pd_orchestrator.bench.verdicts`). Every ``sample_every`` seconds the soak
reads the gateway's RSS and open descriptors (``/proc``) and probes its event loop
(the round trip of ``GET /health``, which does no I/O: the time the loop took to get
to it); it prints a table every ``report_every`` seconds and at the end.

Pass (:func:`judge_run`): nothing lost, duplicated or hung, every error one clean
error (an OpenAI error JSON or one SSE error event, never HTTP 500), the gateway
alive, the gateway's descriptors back within ``fd_slack`` of the reading before the
load once the load has stopped, and RSS and descriptors flat: the median of the
readings in the last ``flat_window`` seconds less than ``growth_limit`` above that of
the first ``flat_window`` seconds from ``flat_after`` on (a run too short for both
windows is held to the rest).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from statistics import median
from typing import Any

import anyio
import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from pd_orchestrator.bench.loadgen import percentile
from pd_orchestrator.bench.peers import free_port
from pd_orchestrator.bench.verdicts import (
    CLEAN_ERROR,
    DUPLICATED,
    HUNG,
    IDENTICAL,
    LEFT,
    LOST,
    Answer,
    Job,
    client,
    judge_job,
    send,
)
from pd_orchestrator.children import Child, RunDirectory, python_command, start_child, stop_child

__all__ = [
    "FAULTS",
    "MODEL",
    "NIXL",
    "Reading",
    "SoakOptions",
    "SoakResult",
    "Tally",
    "fault_times",
    "growth",
    "judge_run",
    "make_job",
    "preemption_round",
    "render",
    "run_soak",
    "verdict_table",
    "windows",
]

MODEL = "sim-model"
NIXL = ("--kv-connector", "nixl", "--model", MODEL)
"""The simulators' model and KV connector (the chaos harness runs the same)."""
DECODER = ("--profile", "h200-llama3-8b", "--time-scale", "2", *NIXL)
"""A decoder at about 13 ms per token: streams are caught mid-answer by the faults."""
PRESSURED = (*DECODER, "--num-kv-blocks", "64", "--max-num-seqs", "8")
"""A decoder that cannot hold many answers at once: it preempts, the gateway hands back."""
PREFILLER = ("--profile", "instant", *NIXL)
BOUND = 60.0
"""Seconds a request may take before it counts as hung."""
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
SCHEMA = {"name": "answer", "schema": {"type": "object"}}

FAULTS: tuple[tuple[float, str], ...] = (
    (5.0, "kill decode-0"),
    (6.0, "preempt decode-1"),
    (14.0, "restart decode-0"),
    (25.0, "failing prefill-0"),
    (40.0, "restart prefill-0"),
    (48.0, "dropping decode-1"),
    (56.0, "restart decode-1"),
)
"""Each period's faults: (seconds into the period, action). ``kill`` is SIGKILL;
``failing`` restarts the instance with ``--failure-rate 1`` (HTTP 500 to every
completion request, health checks answered); ``dropping`` restarts it with
``--drop-after-tokens 8`` (every answer breaks after 8 tokens: the gateway continues
it elsewhere from the tokens already sent, as it does a hand-back); ``preempt`` sends
a :func:`preemption_round` with the mix paused (decode-0 is down: every leg lands on
the pressured decoder, which serves the round alone, preempts and hands back);
``restart`` brings it back healthy."""


@dataclass(frozen=True)
class SoakOptions:
    """What one soak run does (see the module doc)."""

    duration: float = 3600.0
    rate: float = 20.0
    concurrency: int = 12
    report_every: float = 300.0
    sample_every: float = 10.0
    fault_period: float = 60.0
    flat_after: float = 600.0
    flat_window: float = 300.0
    growth_limit: float = 0.05
    fd_slack: int = 8
    max_tokens: int = 24
    seed: int = 0

    def __post_init__(self) -> None:
        if self.duration <= 0 or self.rate <= 0 or self.concurrency < 1:
            raise ValueError("the duration and the rate must be > 0, the concurrency >= 1")
        if self.max_tokens < 4 or self.sample_every <= 0 or self.fault_period <= 0:
            raise ValueError("max tokens must be >= 4, the periods > 0")


# -- the mix --------------------------------------------------------------------------------------
_SHAPES: tuple[str, ...] = (
    "completion-stream",
    "completion-whole",
    "chat-stream",
    "chat-whole",
    "warm",
    "json-schema",
    "named-tool",
    "warm",
    "n2-stream",
    "n3-whole",
    "leave",
    "warm",
)
"""One cycle of the mix. ``warm`` repeats a recent ``chat-stream`` or ``chat-whole``
prompt with a longer answer: the decoder that holds it admits it (decode-first)."""
_WARMED = (_SHAPES.index("chat-stream"), _SHAPES.index("chat-whole"))


def make_job(index: int, run: str, max_tokens: int, rng: random.Random) -> Job:
    """The ``index``-th request of a run: its shape from :data:`_SHAPES`, a prompt no
    instance has seen (``warm``: this or the last cycle's chat prompt, streamed, twice
    ``max_tokens``), ``max_tokens`` tokens and ``ignore_eos``."""
    cycle, place = divmod(index, len(_SHAPES))
    shape = _SHAPES[place]
    seen = index
    if shape == "warm":
        warm = _SHAPES[:place].count("warm")
        seen = max(cycle - warm // 2, 0) * len(_SHAPES) + _WARMED[warm % 2]
    prompt = f"{run}-{seen}: " + "a request of a long soak through a faulty fleet. " * 4
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": max_tokens * 2 if shape == "warm" else max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "return_token_ids": True,
        "stream": shape.endswith("stream") or shape in ("named-tool", "leave", "warm"),
    }
    chat = shape.startswith("chat") or shape in ("json-schema", "named-tool", "n3-whole", "warm")
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if shape == "json-schema":
        body["response_format"] = {"type": "json_schema", "json_schema": SCHEMA}
    elif shape == "named-tool":
        body["tools"] = [TOOL]
        body["tool_choice"] = {"type": "function", "function": {"name": "lookup"}}
    elif shape.startswith("n"):
        body["n"] = int(shape[1])
    leave = rng.randint(2, max_tokens // 2) if shape == "leave" else None
    return Job("chat" if chat else "completion", body, leave)


PREEMPTION_SHAPE = (4, 220, 150)
"""(prompts, prompt tokens, output tokens) of a :func:`preemption_round`: four prompts
of 14 blocks of 16 tokens growing to 24 blocks each overflow a decoder of 64 blocks."""


def preemption_round(index: int, run: str) -> tuple[list[Job], list[Job]]:
    """The ``index``-th preemption round of a run: (warm-ups, round). The round's
    requests are token prompts no instance has seen (exact sizes:
    :data:`PREEMPTION_SHAPE`), ``ignore_eos``, two streamed and two whole, with the
    client's ``cache_hit_threshold`` at 0.9: a preempted one whose blocks were
    evicted is handed back rather than recomputed. Each warm-up asks its prompt for
    one token (whole) first, so that the decoder holds it and admits the round."""
    count, prompt_tokens, output = PREEMPTION_SHAPE
    rng = random.Random(f"{run}-preempt-{index}")
    jobs = []
    for i in range(count):
        body = {
            "model": MODEL,
            "prompt": [rng.randrange(1000, 3000) for _ in range(prompt_tokens)],
            "max_tokens": output,
            "ignore_eos": True,
            "temperature": 0,
            "return_token_ids": True,
            "cache_hit_threshold": 0.9,
            "stream": i % 2 == 0,
        }
        jobs.append(Job("completion", body))
    warm = [Job("completion", job.body | {"max_tokens": 1, "stream": False}) for job in jobs]
    return warm, jobs


def _reference_body(job: Job) -> dict[str, Any]:
    """What the reference instance is asked: the request, whole, one choice, with no
    threshold (the reference's cache is cold)."""
    drop = ("stream", "stream_options", "n", "cache_hit_threshold")
    return {k: v for k, v in job.body.items() if k not in drop}


# -- the tally and the readings ------------------------------------------------------------------
@dataclass
class Tally:
    """Answers so far: verdicts, clean errors by kind, first-token times, failures."""

    verdicts: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    ttft: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(self.verdicts.values())

    @property
    def unclean(self) -> int:
        """Clean-looking errors that are not: HTTP 500 (the gateway's own failure)."""
        return sum(count for kind, count in self.errors.items() if kind.startswith("500 "))

    def add(self, job: Job, answer: Answer | None, expected: list[int]) -> None:
        verdict = HUNG if answer is None else judge_job(job, answer, expected)
        self.verdicts[verdict] += 1
        if answer is None:
            self.failures.append(f"{job.kind} {_shape(job)}: no end within {BOUND:.0f} s")
            return
        if answer.first_token is not None:
            self.ttft.append(answer.first_token)
        internal = False
        if verdict == CLEAN_ERROR:
            kind = _error_kind(answer.error)
            self.errors[kind] += 1
            internal = kind.startswith("500 ")
        if verdict in (LOST, DUPLICATED) or internal:
            self.failures.append(_describe(job, answer, expected))


def _shape(job: Job) -> str:
    extras = [k for k in ("response_format", "tool_choice", "n") if k in job.body]
    stream = "stream" if job.stream else "whole"
    return " ".join([stream, *extras] + (["leaves"] if job.leave_after else []))


def _error_kind(error: Any) -> str:
    inner = error["error"]
    return f"{inner['code']} {inner['type']}"


def _describe(job: Job, answer: Answer, expected: list[int]) -> str:
    return (
        f"{job.kind} {_shape(job)}: status {answer.status}, done={answer.done}, "
        f"{len(answer.tokens)} tokens for {len(expected)} x {job.choices}, "
        f"finishes={answer.finishes}, error={str(answer.error)[:300]}"
    )


@dataclass(frozen=True)
class Reading:
    """One sample of the gateway: seconds into the run, RSS (bytes), open descriptors,
    the event-loop probes' p99 (seconds) since the last reading, hand-backs and
    recoveries so far."""

    at: float
    rss: int
    fds: int
    lag_p99: float
    handbacks: float = 0.0
    recovered: float = 0.0


def growth(first: float, last: float) -> float:
    """The relative growth from ``first`` to ``last`` (0 when ``first`` is 0)."""
    return (last - first) / first if first > 0 else 0.0


def windows(
    readings: Sequence[Reading], after: float, width: float
) -> tuple[list[Reading], list[Reading]] | None:
    """The readings of the first ``width`` seconds from ``after`` on, and those of the
    run's last ``width`` seconds; None when the run ended before both windows fit
    apart. (Descriptors and RSS move with the requests in flight: a window's median,
    not one reading, is compared.)"""
    if not readings or readings[-1].at < after + 2 * width:
        return None
    end = readings[-1].at - width
    first = [r for r in readings if after <= r.at < after + width]
    last = [r for r in readings if r.at >= end]
    return (first, last) if first and last else None


@dataclass
class SoakResult:
    """A whole run: the tally, the readings, the descriptors before the load and after
    it stopped, whether the gateway was alive at the end, the checks and their
    outcome."""

    tally: Tally
    readings: list[Reading]
    fds_before: int = 0
    fds_after: int = 0
    alive: bool = True
    checks: list[tuple[str, bool, str]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(ok for _, ok, _ in self.checks)


def judge_run(result: SoakResult, options: SoakOptions) -> list[tuple[str, bool, str]]:
    """The pass criteria (module doc) on ``result``: (name, passed, figures) each."""
    tally = result.tally
    verdicts = tally.verdicts
    checks = [
        ("0 lost", verdicts[LOST] == 0, str(verdicts[LOST])),
        ("0 duplicated", verdicts[DUPLICATED] == 0, str(verdicts[DUPLICATED])),
        ("0 hung", verdicts[HUNG] == 0, str(verdicts[HUNG])),
        ("every error clean (no HTTP 500)", tally.unclean == 0, f"{tally.unclean} HTTP 500"),
        ("gateway alive", result.alive, "alive" if result.alive else "exited"),
        ("requests answered", verdicts[IDENTICAL] > 0, f"{verdicts[IDENTICAL]} identical"),
    ]
    pair = windows(result.readings, options.flat_after, options.flat_window)
    if pair is not None:
        first, last = pair
        for name, unit, value in (
            ("RSS flat", "MiB", lambda r: r.rss / 2**20),
            ("descriptors flat", "", lambda r: float(r.fds)),
        ):
            begin, end = median(map(value, first)), median(map(value, last))
            change = growth(begin, end)
            figures = (
                f"median {begin:.1f}{unit} from {first[0].at:.0f} s -> {end:.1f}{unit} "
                f"in the last {options.flat_window:.0f} s "
                f"({change:+.1%}, limit {options.growth_limit:.0%})"
            )
            checks.append((name, change < options.growth_limit, figures))
    too_short = "" if pair else "; the run is too short for the flatness windows"
    back = result.fds_after <= result.fds_before + options.fd_slack
    figures = (
        f"{result.fds_before} before the load, {result.fds_after} after "
        f"(slack {options.fd_slack}{too_short})"
    )
    checks.append(("descriptors back after the load", back, figures))
    return checks


# -- the report -----------------------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def render(tally: Tally, readings: Sequence[Reading], elapsed: float) -> Table:
    """The table printed every ``report_every`` seconds and at the end."""
    verdicts = tally.verdicts
    last = readings[-1] if readings else Reading(0.0, 0, 0, 0.0)
    lag = percentile([r.lag_p99 for r in readings], 99) if readings else 0.0
    errors = ", ".join(f"{kind}: {n}" for kind, n in sorted(tally.errors.items())) or "none"
    table = Table(title=f"soak at {elapsed / 60:.1f} min", show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    rows = (
        ("requests", str(tally.requests)),
        ("identical", str(verdicts[IDENTICAL])),
        ("client left mid-stream (prefix checked)", str(verdicts[LEFT])),
        ("clean errors", str(verdicts[CLEAN_ERROR])),
        ("errors by kind", errors),
        ("lost", str(verdicts[LOST])),
        ("duplicated", str(verdicts[DUPLICATED])),
        ("hung", str(verdicts[HUNG])),
        ("hand-backs / recoveries (gateway)", f"{last.handbacks:.0f} / {last.recovered:.0f}"),
        ("gateway RSS (MiB)", f"{last.rss / 2**20:.1f}"),
        ("gateway open descriptors", str(last.fds)),
        ("event-loop lag p99 (ms, /health probe)", _ms(lag)),
        ("TTFT p50 (ms, streams)", _ms(percentile(tally.ttft, 50))),
        ("TTFT p99 (ms, streams)", _ms(percentile(tally.ttft, 99))),
    )
    for row in rows:
        table.add_row(*row)
    return table


def verdict_table(checks: Sequence[tuple[str, bool, str]]) -> Table:
    """The pass criteria, one row each."""
    table = Table(title="soak: pass criteria")
    table.add_column("criterion")
    table.add_column("result")
    table.add_column("figures")
    for name, ok, figures in checks:
        table.add_row(name, "pass" if ok else "FAIL", figures)
    return table


# -- the fleet ------------------------------------------------------------------------------------
REFERENCE_TRIES = 3
"""Sends of a reference request: no fault touches the reference, but a keep-alive
connection it closed while idle can break the next send (the soak's own client, not
the system under test)."""


async def _post_again(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> httpx.Response:
    """POST ``body`` to ``url``, sent again on a transport error (at most
    :data:`REFERENCE_TRIES` sends); a status of 400 or more raises."""
    for attempt in range(1, REFERENCE_TRIES + 1):
        try:
            response = await http.post(url, json=body)
        except httpx.TransportError:
            if attempt == REFERENCE_TRIES:
                raise
            continue
        return response.raise_for_status()
    raise AssertionError("unreachable")


class _Fleet:
    """The simulators on fixed ports (a restart reuses its port), the reference and the
    gateway; every child is stopped when the run's stack closes."""

    def __init__(self, stack: ExitStack, logs: Path) -> None:
        self._stack = stack
        self._logs = logs
        self.ports = {
            name: free_port() for name in ("decode-0", "decode-1", "prefill-0", "prefill-1")
        }
        self.args = {
            "decode-0": DECODER,
            "decode-1": PRESSURED,
            "prefill-0": PREFILLER,
            "prefill-1": PREFILLER,
        }
        self.children: dict[str, Child] = {}
        self.flagged: dict[str, bool] = {}
        for name in self.ports:
            self.start(name)
        self.reference = self._start("reference", python_command(
            "sim", "--host", "127.0.0.1", "--port", "0", "--profile", "instant", "--model", MODEL
        ))  # fmt: skip
        path = logs.parent / "gateway.yaml"
        path.write_text(yaml.safe_dump(self.gateway_config()))
        self.gateway = self._start(
            "gateway", python_command("serve", "--config", str(path), "--port", "0")
        )

    def _start(self, name: str, argv: list[str]) -> Child:
        child = start_child(name, argv, timeout=60, log_dir=self._logs, die_with_parent=True)
        self._stack.callback(stop_child, child)
        return child

    def start(self, name: str, *extra: str) -> None:
        """Start (or restart) simulator ``name`` on its port, with ``extra`` flags."""
        port = str(self.ports[name])
        argv = python_command("sim", "--host", "127.0.0.1", "--port", port, *self.args[name])
        self.children[name] = self._start(name, [*argv, "--engine-id", name, *extra])
        self.flagged[name] = bool(extra)

    def faulty(self) -> list[str]:
        """The simulators a fault left down or misbehaving."""
        return [
            name
            for name, child in self.children.items()
            if self.flagged[name] or child.process.poll() is not None
        ]

    def kill(self, name: str) -> None:
        """SIGKILL simulator ``name`` (no goodbye to anyone)."""
        child = self.children[name]
        if child.process.poll() is None:
            os.kill(child.process.pid, signal.SIGKILL)
            child.process.wait(10)

    def gateway_config(self) -> dict[str, Any]:
        def endpoints(prefix: str) -> list[dict[str, str]]:
            return [
                {"name": n, "url": f"http://127.0.0.1:{p}", "hardware": "h200", "model": MODEL}
                for n, p in self.ports.items()
                if n.startswith(prefix)
            ]

        return {
            "decoders": endpoints("decode"),
            "prefillers": endpoints("prefill"),
            "threshold": {"policy": {"type": "static", "value": 0.5}},
            "timeouts": {"connect": 1.0, "decode_attempt": 4.0, "prefill": 4.0, "decode": 8.0},
            "health": {"interval": 0.5, "timeout": 1.0},
            "upstream": {
                "retry_backoff": 0.02,
                "prefill_budget": 12.0,
                "prefill_fallback": "local",
            },
            "outlier": {"consecutive_failures": 3, "base_ejection_time": 2.0},
        }


_FLAGS = {"failing": ("--failure-rate", "1.0"), "dropping": ("--drop-after-tokens", "8")}


async def _apply(fleet: _Fleet, action: str) -> None:
    """One action of :data:`FAULTS`; a start waits for the simulator off the loop."""
    verb, name = action.split()
    fleet.kill(name)
    if verb == "restart":
        await anyio.to_thread.run_sync(fleet.start, name)
    elif verb in _FLAGS:
        await anyio.to_thread.run_sync(partial(fleet.start, name, *_FLAGS[verb]))


def fault_times(duration: float, period: float) -> Iterator[tuple[float, str]]:
    """Every fault of a run of ``duration`` seconds: (seconds into the run, action)."""
    start = 0.0
    while start < duration:
        for offset, action in FAULTS:
            if start + offset < duration:
                yield start + offset, action
        start += period


# -- the run --------------------------------------------------------------------------------------
def _rss(pid: int) -> int:
    """The resident set of process ``pid`` in bytes (0: it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            lines = [line for line in status if line.startswith("VmRSS:")]
    except OSError:
        return 0
    return int(lines[0].split()[1]) * 1024 if lines else 0


def _fds(pid: int) -> int:
    """The open descriptors of process ``pid`` (0: it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


async def _continuations(http: httpx.AsyncClient, url: str) -> tuple[float, float]:
    """The gateway's hand-backs and recoveries (streams continued after a break) so far."""
    handbacks = recovered = 0.0
    for family in text_string_to_metric_families((await http.get(f"{url}/metrics")).text):
        for sample in family.samples:
            if sample.name == "pd_orchestrator_handbacks_total":
                handbacks += sample.value
            elif sample.name == "pd_orchestrator_upstream_errors_total":
                recovered += sample.value if sample.labels.get("kind") == "recovered" else 0.0
    return handbacks, recovered


class _Run:
    """One run's state: the fleet, the tally, the readings and the lag probes."""

    def __init__(self, fleet: _Fleet, options: SoakOptions, out: Callable[[Table], None]) -> None:
        self.fleet = fleet
        self.options = options
        self.out = out
        self.tally = Tally()
        self.readings: list[Reading] = []
        self.probes: list[float] = []
        self.references: dict[str, list[int]] = {}
        self.slots = anyio.Semaphore(options.concurrency)
        """The mix's slots (a preemption round holds them all)."""
        self.started = 0.0
        self.run = f"soak{random.Random(options.seed).getrandbits(32):08x}"

    @property
    def pid(self) -> int:
        return self.fleet.gateway.process.pid

    def elapsed(self) -> float:
        return anyio.current_time() - self.started

    async def reference(self, http: httpx.AsyncClient, job: Job) -> list[int]:
        body = _reference_body(job)
        key = json.dumps(body, sort_keys=True)
        if key not in self.references:
            response = await _post_again(http, self.fleet.reference.url + job.path, body)
            self.references[key] = list(response.json()["choices"][0]["token_ids"])
        return self.references[key]

    async def one(self, http: httpx.AsyncClient, ref: httpx.AsyncClient, job: Job) -> None:
        answer: Answer | None = None
        with anyio.move_on_after(BOUND):
            try:
                answer = await send(http, self.fleet.gateway.url, job)
            except (httpx.HTTPError, json.JSONDecodeError) as exc:
                answer = Answer(0, error=repr(exc), done=False)
        self.tally.add(job, answer, await self.reference(ref, job))

    async def load(self, http: httpx.AsyncClient, ref: httpx.AsyncClient) -> None:
        rng = random.Random(self.options.seed)
        slots = self.slots

        async def slot(job: Job) -> None:
            try:
                await self.one(http, ref, job)
            finally:
                slots.release()

        async with anyio.create_task_group() as tg:
            index = 0
            # arrivals on the rate's schedule, later when every slot is taken; none
            # after the duration however far behind the schedule
            while (due := index / self.options.rate) < self.options.duration and (
                self.elapsed() < self.options.duration
            ):
                await anyio.sleep(max(0.0, due - self.elapsed()))
                await slots.acquire()
                if self.elapsed() >= self.options.duration:  # waited past the end
                    slots.release()
                    break
                tg.start_soon(slot, make_job(index, self.run, self.options.max_tokens, rng))
                index += 1

    async def preempt(self, http: httpx.AsyncClient, ref: httpx.AsyncClient, index: int) -> None:
        """One :func:`preemption_round`, every answer judged: the warm-ups one after
        another, then the round at once, with the mix paused (its slots all held, its
        requests in flight done): other answers would evict the warm prompts before
        the round reaches them, and the round would go P/D instead."""
        warm, jobs = preemption_round(index, self.run)
        held = 0
        try:
            for _ in range(self.options.concurrency):
                await self.slots.acquire()
                held += 1
            for job in warm:
                await self.one(http, ref, job)
            async with anyio.create_task_group() as tg:
                for job in jobs:
                    tg.start_soon(self.one, http, ref, job)
        finally:
            for _ in range(held):
                self.slots.release()

    async def faults(self, ref: httpx.AsyncClient) -> None:
        """The faults of :func:`fault_times` on time; the preemption rounds on a client
        of their own (the mix's may have every connection taken)."""
        rounds = 0
        own = client(PREEMPTION_SHAPE[0], BOUND + 5)
        async with own as http, anyio.create_task_group() as tg:
            for at, action in fault_times(self.options.duration, self.options.fault_period):
                await anyio.sleep(max(0.0, at - self.elapsed()))
                if action.startswith("preempt "):
                    tg.start_soon(self.preempt, http, ref, rounds)
                    rounds += 1
                else:
                    await _apply(self.fleet, action)

    async def probe(self, http: httpx.AsyncClient) -> None:
        while True:
            started = time.perf_counter()
            try:
                await http.get(f"{self.fleet.gateway.url}/health")
                self.probes.append(time.perf_counter() - started)
            except httpx.HTTPError:
                self.probes.append(time.perf_counter() - started)
            await anyio.sleep(0.25)

    async def sample(self, http: httpx.AsyncClient) -> None:
        probes, self.probes = self.probes, []
        try:
            handbacks, recovered = await _continuations(http, self.fleet.gateway.url)
        except httpx.HTTPError:
            last = self.readings[-1] if self.readings else Reading(0.0, 0, 0, 0.0)
            handbacks, recovered = last.handbacks, last.recovered
        self.readings.append(
            Reading(
                self.elapsed(),
                _rss(self.pid),
                _fds(self.pid),
                percentile(probes, 99),
                handbacks,
                recovered,
            )
        )

    async def watch(self, http: httpx.AsyncClient) -> None:
        next_report = self.options.report_every
        while True:
            await anyio.sleep(self.options.sample_every)
            await self.sample(http)
            if self.elapsed() >= next_report:
                self.out(render(self.tally, self.readings, self.elapsed()))
                next_report += self.options.report_every


async def _fds_settled(run: _Run, target: int, bound: float = 30.0) -> int:
    """The gateway's descriptors once back to ``target`` (or after ``bound`` seconds)."""
    deadline = anyio.current_time() + bound
    while (count := _fds(run.pid)) > target and anyio.current_time() < deadline:  # noqa: ASYNC110 - another process
        await anyio.sleep(0.5)
    return count


async def _soak(fleet: _Fleet, options: SoakOptions, out: Callable[[Table], None]) -> SoakResult:
    run = _Run(fleet, options, out)
    async with client(options.concurrency, BOUND + 5) as http, client(8, BOUND + 5) as side:
        await anyio.sleep(2.0)  # the first health checks
        fds_before = _fds(run.pid)
        run.started = anyio.current_time()
        async with anyio.create_task_group() as background:
            background.start_soon(run.probe, side)
            background.start_soon(run.watch, side)
            async with anyio.create_task_group() as faults:
                faults.start_soon(run.faults, side)
                await run.load(http, side)
                faults.cancel_scope.cancel()  # once a restart under way is done
            background.cancel_scope.cancel()
        await run.sample(side)
    # every fault undone, the clients gone: what the gateway holds now is its own
    async with anyio.create_task_group() as restarts:
        for name in fleet.faulty():
            fleet.kill(name)
            restarts.start_soon(anyio.to_thread.run_sync, fleet.start, name)
    await anyio.sleep(2.0)
    fds_after = await _fds_settled(run, fds_before + options.fd_slack)
    result = SoakResult(run.tally, run.readings, fds_before, fds_after)
    result.alive = fleet.gateway.process.poll() is None
    result.checks = judge_run(result, options)
    return result


def run_soak(options: SoakOptions, console: Console | None = None) -> SoakResult:
    """Run the soak (module doc); prints its tables on ``console``. The children's logs
    are kept (and named) when the run fails."""
    console = console or Console()
    with RunDirectory("pdo-soak-") as directory, ExitStack() as stack:
        try:
            fleet = _Fleet(stack, directory.logs)
            result = anyio.run(_soak, fleet, options, console.print)
        except BaseException:
            console.print(f"logs: {directory.keep_logs()}")
            raise
        console.print(render(result.tally, result.readings, options.duration))
        console.print(verdict_table(result.checks))
        for failure in result.tally.failures[:10]:
            console.print(f"failure: {failure}")
        if not result.passed:
            console.print(f"logs: {directory.keep_logs()}")
    return result
