"""The chaos suite's harness: a simulated fleet with a reference instance, the gateway
in front of it, a client that judges every answer against the reference, and the
checks that end each test.

Every test module injects one fault into real processes on loopback and asserts on
tokens. With a fixed seed and temperature 0 every request must end identical to the
reference instance's answer or with one clean error; anything else is lost,
duplicated or hung (no end within the request's bound): the verdicts of
:mod:`pd_orchestrator.bench.verdicts`, which the soak shares. After
the fault, every simulator still alive must report ``vllm:num_requests_running``
back to 0: no upstream request is left running.

Each test's figures go into :data:`REPORT`, printed at the end of the run (and
appended as JSON lines to ``$PDO_CHAOS_REPORT`` when it is set).
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import httpx

from pd_orchestrator.bench import verdicts
from pd_orchestrator.bench.soak import MODEL, NIXL
from pd_orchestrator.bench.verdicts import (
    CLEAN_ERROR,
    DUPLICATED,
    HUNG,
    IDENTICAL,
    Answer,
    Job,
    Progress,
    judge,
    send,
)
from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory, gateway_config
from ..gateway.helpers import metric

__all__ = [
    "DECODER",
    "MODEL",
    "PREFILLER",
    "REPORT",
    "Fleet",
    "Job",
    "Progress",
    "Tally",
    "chaos_gateway",
    "jobs",
    "judge",
    "running",
    "send",
    "settle",
    "start_fleet",
    "until",
]

DECODER = ("--profile", "h200-llama3-8b", "--time-scale", "4", *NIXL)
"""A decoder at about 26 ms per token: long enough to be caught mid-answer."""
PREFILLER = ("--profile", "instant", *NIXL)
BOUND = 45.0
"""Seconds a request may take before it counts as hung."""
REPORT: list[Tally] = []


# -- the fleet ----------------------------------------------------------------------------------
@dataclass
class Fleet:
    """Decoders, prefillers, a reference instance and the gateway in front of the first two."""

    decoders: list[Child]
    prefillers: list[Child]
    reference: Child
    gateway: Child
    config: dict[str, Any]

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def upstreams(self) -> list[Child]:
        return [*self.decoders, *self.prefillers]


def _merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = value
    return merged


def chaos_gateway(
    decoders: list[Child], prefillers: list[Child], **overrides: Any
) -> dict[str, Any]:
    """A gateway config over running simulators: every prompt cold (threshold 0.5, unique
    prompts), timeouts short enough for a test to see them, quick health checks."""
    base = gateway_config(decoders, prefillers)
    base |= {
        "threshold": {"policy": {"type": "static", "value": 0.5}},
        "timeouts": {"connect": 1.0, "decode_attempt": 4.0, "prefill": 4.0, "decode": 4.0},
        "health": {"interval": 0.5, "timeout": 1.0},
        "upstream": {"retry_backoff": 0.02, "prefill_budget": 12.0},
        "lifecycle": {"drain_seconds": 30.0},
    }
    return _merged(base, overrides)


def start_fleet(
    sims: SimFactory,
    gateways: GatewayFactory,
    reference: Child,
    *,
    decoders: Sequence[Sequence[str]] = (DECODER, DECODER),
    prefillers: Sequence[Sequence[str]] = (PREFILLER,),
    **overrides: Any,
) -> Fleet:
    """Start the simulators (one argument list each) and a gateway over them;
    ``reference`` answers the reference requests."""
    started_decoders = [sims(*args, name=f"decode-{i}") for i, args in enumerate(decoders)]
    started_prefillers = [sims(*args, name=f"prefill-{i}") for i, args in enumerate(prefillers)]
    config = chaos_gateway(started_decoders, started_prefillers, **overrides)
    gateway = gateways(config)
    return Fleet(started_decoders, started_prefillers, reference, gateway, config)


# -- requests -----------------------------------------------------------------------------------
def jobs(
    count: int,
    *,
    max_tokens: int = 48,
    stream: bool | None = None,
    chat_every: int = 3,
    tag: str = "",
) -> list[Job]:
    """``count`` requests with prompts no instance has seen (cold: each goes P/D), every
    ``chat_every``-th on the chat API; streamed or not as ``stream`` says (None: every
    other one)."""
    run = uuid.uuid4().hex[:8]
    made = []
    for i in range(count):
        prompt = f"{tag}{run}-{i}: " + "a request that travels through a faulty fleet. " * 6
        body: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "return_token_ids": True,
            "stream": (i % 2 == 0) if stream is None else stream,
        }
        chat = chat_every > 0 and i % chat_every == chat_every - 1
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        made.append(Job("chat" if chat else "completion", body))
    return made


# -- the tally ----------------------------------------------------------------------------------
@dataclass
class Tally:
    """One fault's figures."""

    fault: str
    requests: int = 0
    identical: int = 0
    clean_errors: int = 0
    lost: int = 0
    duplicated: int = 0
    hung: int = 0
    notes: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def add(self, verdict: str) -> None:
        self.requests += 1
        if verdict == IDENTICAL:
            self.identical += 1
        elif verdict == CLEAN_ERROR:
            self.clean_errors += 1
        elif verdict == DUPLICATED:
            self.duplicated += 1
        elif verdict == HUNG:
            self.hung += 1
        else:
            self.lost += 1

    def why(self, error: dict[str, Any]) -> None:
        """Note a clean error's status and message."""
        inner = error["error"]
        reasons = self.notes.setdefault("errors", {})
        key = f"{inner['code']} {inner['message']}"
        reasons[key] = reasons.get(key, 0) + 1

    def line(self) -> str:
        notes = "".join(f" {k}={v}" for k, v in self.notes.items())
        return (
            f"{self.fault}: requests={self.requests} identical={self.identical} "
            f"clean_errors={self.clean_errors} lost={self.lost} duplicated={self.duplicated} "
            f"hung={self.hung}{notes}"
        )

    def record(self) -> None:
        """Add this tally to the run's report."""
        REPORT.append(self)
        path = os.environ.get("PDO_CHAOS_REPORT")
        if path:
            with open(path, "a") as out:
                out.write(json.dumps(asdict(self)) + "\n")

    def check(self, *, max_clean_errors: int | None = None) -> None:
        """Record, then assert: nothing lost, duplicated or hung; at most
        ``max_clean_errors`` clean errors (None: any number)."""
        self.record()
        failures = "\n".join(self.failures[:5])
        assert (self.lost, self.duplicated, self.hung) == (0, 0, 0), f"{self.line()}\n{failures}"
        if max_clean_errors is not None:
            assert self.clean_errors <= max_clean_errors, self.line()


# -- running and checking -----------------------------------------------------------------------
class References:
    """The reference instance's tokens for each job (asked once)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._known: dict[str, list[int]] = {}

    async def of(self, client: httpx.AsyncClient, job: Job) -> list[int]:
        key = json.dumps(job.body, sort_keys=True)
        if key not in self._known:
            body = {k: v for k, v in job.body.items() if k not in ("stream", "stream_options")}
            response = await client.post(self.url + job.path, json=body)
            assert response.status_code == 200, response.text
            self._known[key] = list(response.json()["choices"][0]["token_ids"])
        return self._known[key]


def client(concurrency: int = 64, timeout: float = BOUND + 5) -> httpx.AsyncClient:
    """The test's client (:func:`~pd_orchestrator.bench.verdicts.client`)."""
    return verdicts.client(concurrency, timeout)


async def run_jobs(
    fleet: Fleet,
    work: Iterable[Job],
    tally: Tally,
    *,
    concurrency: int = 16,
    progress: Progress | None = None,
    bound: float = BOUND,
    gate: tuple[int, anyio.Event] | None = None,
) -> float:
    """Send every job (at most ``concurrency`` at once) and judge each answer into
    ``tally``; references are asked after the run (not while the fault is on).
    ``gate`` = ``(first, event)``: until ``event`` is set (a fault in place) at most
    ``first`` jobs are in flight -- each one that ends lets the next go -- then the
    rest go at once. Returns the seconds the requests took."""
    work = list(work)
    answers: list[Answer | None] = [None] * len(work)
    limiter = anyio.Semaphore(concurrency)
    async with client(concurrency) as http:
        ended = 0

        async def one(index: int, job: Job) -> None:
            nonlocal ended
            if gate is not None:
                first, event = gate
                while not event.is_set() and index >= first + ended:  # noqa: ASYNC110 - two conditions
                    await anyio.sleep(0.01)
            try:
                async with limiter:
                    with anyio.move_on_after(bound):
                        answers[index] = await _safely(send(http, fleet.url, job, progress))
            finally:
                ended += 1

        started = anyio.current_time()
        async with anyio.create_task_group() as tg:
            for index, job in enumerate(work):
                tg.start_soon(one, index, job)
        seconds = anyio.current_time() - started
        references = References(fleet.reference.url)
        for job, answer in zip(work, answers, strict=True):
            if answer is None:
                tally.add(HUNG)
                continue
            expected = await references.of(http, job)
            verdict = judge(answer, expected)
            tally.add(verdict)
            if verdict == CLEAN_ERROR:
                tally.why(answer.error)
            elif verdict != IDENTICAL:
                tally.failures.append(_describe(job, answer, expected))
    return seconds


def _describe(job: Job, answer: Answer, expected: list[int]) -> str:
    """What went wrong with one answer (for the failure message)."""
    pairs = enumerate(zip(answer.tokens, expected, strict=False))
    agree = next((i for i, (a, b) in pairs if a != b), None)
    return (
        f"{job.kind} stream={job.stream}: status {answer.status}, done={answer.done}, "
        f"{len(answer.tokens)}/{len(expected)} tokens, first difference at {agree}, "
        f"finishes={answer.finishes}, error={str(answer.error)[:300]}"
    )


async def _safely(sending: Any) -> Answer:
    """An answer even when the connection to the gateway failed (that is a lost one)."""
    started = anyio.current_time()
    try:
        answer: Answer = await sending
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        seconds = anyio.current_time() - started
        return Answer(0, error=f"{exc!r} after {seconds:.2f} s", done=False)
    return answer


async def until(condition: Callable[[], bool], bound: float, step: float = 0.05) -> None:
    """Wait until ``condition()`` holds (fails after ``bound`` seconds)."""

    async def holds() -> bool:
        return condition()

    await poll(holds, bound, step)


async def poll(probe: Callable[[], Awaitable[bool]], bound: float, step: float = 0.05) -> None:
    """Wait until ``await probe()`` is true (fails after ``bound`` seconds)."""
    with anyio.fail_after(bound):
        while not await probe():  # noqa: ASYNC110 - the state of other processes
            await anyio.sleep(step)


async def running(child: Child) -> float:
    """``vllm:num_requests_running`` of a simulator."""
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"{child.url}/metrics")).text
    return metric(text, "vllm:num_requests_running")


async def settle(children: Iterable[Child], bound: float = 15.0) -> None:
    """Every child back to 0 requests running (nothing left running upstream)."""
    children = list(children)

    async def idle() -> bool:
        return all([await running(child) == 0 for child in children])

    await poll(idle, bound, 0.1)


async def sim_metric(child: Child, name: str) -> float:
    """A simulator's series ``name`` summed over its labels (0 before any sample)."""
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"{child.url}/metrics")).text
    try:
        return metric(text, name)
    except AssertionError:
        return 0.0


async def wait_running(child: Child, at_least: int = 1, bound: float = 20.0) -> None:
    """Until ``child`` runs at least ``at_least`` requests."""

    async def busy() -> bool:
        return await running(child) >= at_least

    await poll(busy, bound, 0.02)


async def mid_answer(child: Child, requests: int = 2, tokens: int = 20) -> None:
    """Until ``child`` runs ``requests`` requests and generated ``tokens`` more tokens:
    answers are in the middle of being generated (and, streamed, relayed)."""
    start = await sim_metric(child, "vllm:generation_tokens_total")
    await wait_running(child, requests)

    async def generated() -> bool:
        return await sim_metric(child, "vllm:generation_tokens_total") >= start + tokens

    await poll(generated, 20.0, 0.02)


async def recoveries(fleet: Fleet) -> dict[str, float]:
    """How often the gateway retried (before the first byte) and recovered (after it)."""
    name = "pd_orchestrator_upstream_errors_total"
    return {
        kind: await gateway_metric(fleet, name, kind=kind)
        for kind in ("retried", "recovered", "fell_back")
    }


async def gateway_metric(fleet: Fleet, name: str, **labels: str) -> float:
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"{fleet.url}/metrics")).text
    try:
        return metric(text, name, **labels)
    except AssertionError:
        return 0.0


def kill(child: Child, sig: signal.Signals = signal.SIGKILL) -> None:
    """Send ``sig`` to ``child`` (the process itself, not its group)."""
    os.kill(child.process.pid, sig)
    if sig == signal.SIGKILL:
        child.process.wait(10)


# -- the prefill side ---------------------------------------------------------------------------
PEERS = ("with a healthy peer", "alone", "alone, no fallback")
"""How a faulty prefiller is deployed: beside a healthy prefiller; alone (the decoder
prefills when the prefill side fails, ``upstream.prefill_fallback: local``); alone with
the fallback off (the failure is the answer)."""


async def prefill_fault(
    sims: SimFactory,
    gateways: GatewayFactory,
    reference: Child,
    fault: str,
    peer: str,
    victim: Sequence[str],
    inject: Callable[[Fleet], Any] | None = None,
    count: int = 12,
    **overrides: Any,
) -> Tally:
    """Run ``count`` cold requests (each needs a prefill) while the first prefiller
    (started with ``victim``'s arguments) has ``fault``; ``inject(fleet)`` (awaited,
    run beside the requests, two at a time until it returned) injects it, if it is not
    in the arguments already.
    Returns the checked tally; every live upstream is settled."""
    prefillers = [victim, PREFILLER] if peer == PEERS[0] else [victim]
    fallback = "error" if peer == PEERS[2] else "local"
    upstream = {"prefill_fallback": fallback, **overrides.pop("upstream", {})}
    fleet = start_fleet(
        sims, gateways, reference, prefillers=prefillers, upstream=upstream, **overrides
    )
    tally = Tally(f"prefiller {fault}, {peer}")
    if inject is None:
        await run_jobs(fleet, jobs(count, max_tokens=16), tally)
    else:
        injected = anyio.Event()

        async def injecting() -> None:
            await inject(fleet)
            injected.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(injecting)
            # two requests at a time until the fault is in place (one of them must
            # reach the faulty prefiller first), then the rest: they meet the fault
            # however late a busy machine lets it land
            await run_jobs(fleet, jobs(count, max_tokens=16), tally, gate=(2, injected))
    tally.notes |= await recoveries(fleet)
    tally.notes["ejections"] = await gateway_metric(fleet, "pd_orchestrator_ejections_total")
    tally.check(max_clean_errors=None if peer == PEERS[2] else 0)
    return tally


async def wait_prefilled(child: Child, prompts: int = 1, bound: float = 20.0) -> None:
    """Until ``child`` prefilled ``prompts`` prompts (its prompt-token counter moved)."""

    async def prefilled() -> bool:
        return await sim_metric(child, "vllm:request_success_total") >= prompts

    await poll(prefilled, bound, 0.02)
