"""Live runs: the workload over HTTP against a gateway (ours or another) or a simulator.

:func:`run_target` sends a workload to one base URL: open-loop arrivals at the
workload's times (conversation turns ``think_time`` after the previous turn
finished), every request a streamed ``/v1/completions`` call with a token-id prompt,
``ignore_eos`` and the workload's ``max_tokens``, at most ``concurrency`` in
flight. It records TTFT, every inter-token gap and end-to-end latency from the
request's scheduled time (so a saturated client does not hide queueing), the
``x-pd-decision`` header, and -- from the simulators' ``/metrics`` read before and
after -- prefill tokens computed (``vllm:prefill_tokens_computed_total``), KV bytes
moved (``vllm:nixl_bytes_transferred_sum``) and preemptions.

Simulators run at a time scale (real seconds per simulated second); arrivals are
sent at that scale and every latency is divided by it, so results are in simulated
seconds like the virtual fleet's. A conversation's next prompt is its previous
prompt, the answer's token ids (the simulator's tokenizer is reversible, so the
streamed text re-encodes to them) and the new message.

:func:`run_fleet_strategy` starts a fresh simulated fleet and our gateway for one
strategy, runs the workload and stops everything; :func:`run_vllm_router` does the
same with vllm-router (PyPI ``vllm-router``, in P/D mode with the NIXL connector)
in front of the simulators, built into a cached venv outside the clone.
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import anyio
import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pd_orchestrator.bench.fleet import FleetSpec, InstanceSpec
from pd_orchestrator.bench.peers import VLLM_ROUTER, free_port, peer_executable, start_process
from pd_orchestrator.bench.results import RequestRecord, RunResult
from pd_orchestrator.bench.strategies import Mode, Strategy
from pd_orchestrator.bench.workloads import BenchRequest, Workload, materialize
from pd_orchestrator.children import (
    Child,
    ChildStartError,
    python_command,
    start_child,
    start_nats_server,
    stop_child,
)
from pd_orchestrator.model.endpoints import Role
from pd_orchestrator.model.records import record
from pd_orchestrator.sim.tokenizer import SimTokenizer

__all__ = [
    "VLLM_ROUTER_VERSION",
    "FleetCounters",
    "LiveOptions",
    "live_threshold",
    "read_counters",
    "read_decisions",
    "router_executable",
    "run_fleet_strategy",
    "run_target",
    "run_vllm_router",
    "start_fleet",
]

VLLM_ROUTER_VERSION = VLLM_ROUTER.version
_COUNTERS = {
    "vllm:prefill_tokens_computed": "prefill_tokens",
    "vllm:nixl_bytes_transferred": "kv_bytes",
    "vllm:num_preemptions": "preemptions",
}


@record
class LiveOptions:
    """``sim_time_scale``: real seconds per simulated second of the simulators (and of
    the arrivals). ``concurrency``: requests in flight at most. ``timeout``: seconds
    one request may take (real time). ``prefix_index``: the simulators publish KV
    events and the gateway keeps a precise prefix index of them (``prefix.precise``),
    which tells a policy that reads it how much of each prompt its decoder holds.
    ``gateways``: gateway processes on one port (``listen.workers``: ``SO_REUSEPORT``,
    the kernel spreads the client's connections over them), each with its own state.
    ``shared_state``: a NATS server is started for the run and the gateways share
    their load through it (``shared_state.url``)."""

    sim_time_scale: float = 1.0
    concurrency: int = 256
    timeout: float = 600.0
    prefix_index: bool = True
    gateways: int = 1
    shared_state: bool = False

    def __post_init__(self) -> None:
        if self.sim_time_scale <= 0 or self.concurrency < 1 or self.timeout <= 0:
            raise ValueError("time scale and timeout must be > 0, concurrency >= 1")
        if self.gateways < 1:
            raise ValueError("gateways must be >= 1")


@record
class FleetCounters:
    """Fleet-wide counters read from the simulators' ``/metrics``."""

    prefill_tokens: float = 0.0
    kv_bytes: float = 0.0
    preemptions: float = 0.0

    def __sub__(self, other: FleetCounters) -> FleetCounters:
        return FleetCounters(
            self.prefill_tokens - other.prefill_tokens,
            self.kv_bytes - other.kv_bytes,
            self.preemptions - other.preemptions,
        )


async def read_counters(client: httpx.AsyncClient, urls: Sequence[str]) -> FleetCounters:
    """Sum the counters of every ``urls``'s ``/metrics`` (an unreadable one counts 0)."""
    totals = dict.fromkeys(_COUNTERS.values(), 0.0)
    for url in urls:
        response = await client.get(f"{url}/metrics")
        if response.status_code != 200:
            continue
        for family in text_string_to_metric_families(response.text):
            field = _COUNTERS.get(family.name)
            if field is None:
                continue
            for sample in family.samples:
                if sample.name.endswith(("_total", "_sum")):
                    totals[field] += sample.value
    return FleetCounters(**totals)


# -- one target -------------------------------------------------------------------------------
@dataclass
class _Conversation:
    prompt: list[int]
    output: list[int]
    done: anyio.Event


class _Runner:
    """Sends one workload to one URL; see :func:`run_target`."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        workload: Workload,
        model: str,
        options: LiveOptions,
        default_decision: str,
        progress: Callable[[int], None] | None,
    ) -> None:
        self.client = client
        self.workload = workload
        self.model = model
        self.options = options
        self.default_decision = default_decision
        self.progress = progress
        self.tokenizer = SimTokenizer()
        self.records: list[RequestRecord | None] = [None] * len(workload)
        self.itl: list[float] = []
        self.limiter = anyio.CapacityLimiter(options.concurrency)
        self.turns = {r.index: _Conversation([], [], anyio.Event()) for r in workload.requests}
        self.started = 0.0

    def real(self, simulated: float) -> float:
        return simulated * self.options.sim_time_scale

    async def run(self) -> list[RequestRecord]:
        self.started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for request in self.workload.requests:
                tg.start_soon(self.one, request)
        return [r for r in self.records if r is not None]

    async def one(self, request: BenchRequest) -> None:
        previous = None if request.after is None else self.turns[request.after]
        if previous is None:
            due = self.real(request.arrival)
        else:
            await previous.done.wait()
            due = time.perf_counter() - self.started + self.real(request.think_time)
        await anyio.sleep(max(0.0, due - (time.perf_counter() - self.started)))
        prompt = materialize(request.segments)
        if request.extends and previous is not None:
            prompt = [*previous.prompt, *previous.output, *prompt]
        record = RequestRecord(
            request.index, request.session, due / self.options.sim_time_scale, len(prompt)
        )
        turn = self.turns[request.index]
        turn.prompt = prompt
        try:
            async with self.limiter:
                turn.output = await self.send(request, prompt, record, self.started + due)
        except (httpx.HTTPError, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.records[request.index] = record
            turn.done.set()
            if self.progress is not None:
                self.progress(1)

    async def send(
        self, request: BenchRequest, prompt: list[int], record: RequestRecord, due: float
    ) -> list[int]:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": request.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        scale = self.options.sim_time_scale
        pieces: list[str] = []
        first: float | None = None
        last = 0.0
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return []
            record.decision = response.headers.get("x-pd-decision", self.default_decision)
            record.decoder = response.headers.get("x-pd-decoder", "")
            record.prefiller = response.headers.get("x-pd-prefiller")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                record.cached_tokens = int(details.get("cached_tokens") or record.cached_tokens)
                text = "".join(str(c.get("text") or "") for c in chunk.get("choices") or [])
                if not text:
                    continue
                now = time.perf_counter()
                if first is None:
                    first = now
                    record.ttft = (now - due) / scale
                else:
                    self.itl.append((now - last) / scale)
                last = now
                pieces.append(text)
        output = self.tokenizer.encode("".join(pieces))
        record.output_tokens = len(output)
        record.e2e = (time.perf_counter() - due) / scale
        if first is not None and len(output) > 1:
            record.tpot = (last - first) / scale / (len(output) - 1)
        return output


async def run_target(
    url: str,
    workload: Workload,
    model: str,
    options: LiveOptions,
    *,
    strategy: str,
    mode: str,
    fleet: str,
    metrics_urls: Sequence[str] = (),
    default_decision: str = "",
    progress: Callable[[int], None] | None = None,
) -> RunResult:
    """Send ``workload`` to ``url``; see the module docstring."""
    limits = httpx.Limits(max_connections=options.concurrency, max_keepalive_connections=64)
    timeout = httpx.Timeout(options.timeout, connect=10.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        before = await read_counters(client, metrics_urls)
        runner = _Runner(client, workload, model, options, default_decision, progress)
        started = time.perf_counter()
        records = await runner.run()
        wall = time.perf_counter() - started
        counters = await read_counters(client, metrics_urls) - before
    result = RunResult(
        strategy=strategy,
        mode=mode,
        workload=workload.name,
        fleet=fleet,
        runner="live",
        records=records,
        prefill_tokens=int(counters.prefill_tokens),
        kv_bytes=int(counters.kv_bytes),
        preemptions=int(counters.preemptions),
        wall_seconds=wall,
    )
    result.itl_samples.extend(runner.itl)
    return result


# -- simulated fleets -----------------------------------------------------------------------
_Events = dict[str, tuple[str, str]]
"""Per instance name, the ZMQ addresses of its KV-event publisher and replay socket."""


def _kv_events(fleet: FleetSpec) -> _Events:
    """A publisher and a replay address on loopback for every instance."""
    return {
        i.name: (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
        for i in fleet.instances
    }


def _sim_argv(
    instance: InstanceSpec, fleet: FleetSpec, time_scale: float, events: _Events
) -> list[str]:
    published: tuple[str, ...] = ()
    if instance.name in events:
        publisher, replay = events[instance.name]
        published = ("--kv-events-endpoint", publisher, "--kv-events-replay-endpoint", replay)
    return python_command(
        "sim",
        "--host", "127.0.0.1",
        "--port", "0",
        "--profile", instance.profile,
        "--time-scale", str(time_scale),
        "--block-size", str(fleet.block_size),
        "--max-num-seqs", str(fleet.max_num_seqs),
        "--max-num-batched-tokens", str(fleet.max_num_batched_tokens),
        "--kv-connector", "nixl",
        "--engine-id", instance.name,
        "--model", fleet.model,
        "--num-kv-blocks", str(max(1, fleet.capacity(instance) // fleet.block_size)),
        *published,
    )  # fmt: skip


def start_fleet(
    fleet: FleetSpec, time_scale: float, stack: ExitStack, events: _Events | None = None
) -> dict[str, Child]:
    """Start one simulator per instance (stopped when ``stack`` closes), by name; those
    ``events`` names publish their KV events there."""
    children: dict[str, Child] = {}
    for instance in fleet.instances:
        argv = _sim_argv(instance, fleet, time_scale, events or {})
        child = start_child(instance.name, argv, timeout=60)
        stack.callback(stop_child, child)
        children[instance.name] = child
    return children


def _gateway_config(
    fleet: FleetSpec,
    urls: dict[str, str],
    threshold: dict[str, Any],
    events: _Events,
    gateways: int = 1,
    worker_port: int | None = None,
) -> dict[str, Any]:
    pools: dict[str, dict[str, Any]] = {}
    for instance in fleet.instances:
        endpoint = instance.endpoint(urls[instance.name])
        pool = pools.setdefault(
            endpoint.pool,
            {
                "name": endpoint.pool,
                "hardware": endpoint.hardware,
                "role": endpoint.role.value,
                "group": endpoint.group,
                "model": fleet.model,
                "spill": endpoint.spill,
                "profile": instance.profile if instance.known else None,
                "endpoints": [],
            },
        )
        pool["endpoints"].append({"name": instance.name, "url": endpoint.url})
    config: dict[str, Any] = {
        "version": 1,
        "listen": {
            "host": "127.0.0.1",
            "port": 0,
            "workers": gateways,
            "worker_metrics_port": worker_port,
        },
        "connector": "nixl",
        "pools": list(pools.values()),
        "threshold": threshold,
        "health": {"interval": 1.0},
        "upstream": {"max_connections": 4096},
    }
    if events:
        sources = {
            name: {"publisher": pub, "replay": replay} for name, (pub, replay) in events.items()
        }
        config["prefix"] = {
            "precise": {
                "block_size": fleet.block_size,
                "events": {"publisher": None, "endpoints": sources},
            }
        }
    return config


def _live_fleet(fleet: FleetSpec, strategy: Strategy) -> FleetSpec:
    """Decode-only runs every instance as ``both`` (the gateway wants a prefiller)."""
    if strategy.mode is not Mode.DECODE_ONLY:
        return fleet
    instances = tuple(replace(i, role=Role.BOTH, spill=False) for i in fleet.instances)
    return replace(fleet, instances=instances)


_SLO_SECONDS = {"goodput": ("ttft", "tpot"), "slo-feedback": ("ttft_p90", "itl_p99")}
"""Policy parameters that are latency targets, in seconds of the gateway's clock."""


def live_threshold(strategy: Strategy, time_scale: float = 1.0) -> dict[str, Any]:
    """The gateway's ``threshold`` block for ``strategy`` (client thresholds ignored).
    Prefill-first runs as threshold 1 (no prompt meets it: the gateway goes straight
    to P/D), decode-only as threshold 0, decode-first with the strategy's own block.

    The gateway measures latencies on its own clock, on which a simulated second lasts
    ``time_scale`` seconds; the latency targets a policy block sets (``goodput``'s,
    ``slo-feedback``'s, at any depth) are stretched by it, so the policy holds the
    simulated fleet to the targets the strategy names. ``goodput``'s knowledge (its
    hardware profile, hop and seeded rates) is in simulated seconds: its block gets
    ``time_scale``, which puts that knowledge on the gateway's clock."""
    if strategy.threshold is not None:
        block = strategy.threshold.model_dump(mode="json", exclude_unset=True)
        return cast(dict[str, Any], _stretched(block, time_scale))
    value = 1.0 if strategy.mode is Mode.PREFILL_FIRST else 0.0
    return {"policy": {"type": "static", "value": value}, "honour_client": False}


def _stretched(block: Any, scale: float) -> Any:
    """``block`` with every policy's latency targets (:data:`_SLO_SECONDS`) times ``scale``."""
    if isinstance(block, list):
        return [_stretched(item, scale) for item in block]
    if not isinstance(block, dict):
        return block
    out = {key: _stretched(value, scale) for key, value in block.items()}
    params = out.get("params")
    if isinstance(params, dict):
        for name in _SLO_SECONDS.get(str(out.get("type")), ()):
            if isinstance(params.get(name), int | float):
                params[name] = params[name] * scale
        if out.get("type") == "goodput" and scale != 1.0:
            params["time_scale"] = scale  # its knowledge is in simulated seconds
    return out


def run_fleet_strategy(
    fleet: FleetSpec,
    strategy: Strategy,
    workload: Workload,
    options: LiveOptions,
    progress: Callable[[int], None] | None = None,
) -> RunResult:
    """A fresh simulated fleet and gateway for ``strategy``."""
    served = _live_fleet(fleet, strategy)
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="pdo-bench-") as tmp:
        events = _kv_events(served) if options.prefix_index else {}
        sims = start_fleet(served, options.sim_time_scale, stack, events)
        urls = {name: child.url for name, child in sims.items()}
        path = Path(tmp) / "gateway.yaml"
        threshold = live_threshold(strategy, options.sim_time_scale)
        worker_port = _free_ports(options.gateways) if options.gateways > 1 else None
        config = _gateway_config(served, urls, threshold, events, options.gateways, worker_port)
        if options.shared_state:
            nats = start_nats_server(die_with_parent=True)
            stack.callback(stop_child, nats)
            config["shared_state"] = {"url": nats.url}
        path.write_text(yaml.safe_dump(config))
        gateway = start_child("gateway", python_command("serve", "--config", str(path)), timeout=60)
        stack.callback(stop_child, gateway)
        gateways = [gateway.url]
        if worker_port is not None:
            gateways = [f"http://127.0.0.1:{worker_port + i}" for i in range(options.gateways)]
        return anyio.run(
            _run_bound,
            gateway.url,
            workload,
            served,
            options,
            strategy,
            list(urls.values()),
            progress,
            gateways,
        )


def _free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on loopback now (each worker of
    a gateway serves its own ``/metrics`` on one)."""
    for _ in range(100):
        first = free_port()
        try:
            with ExitStack() as held:
                for port in range(first, first + count):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports on loopback")


async def read_decisions(client: httpx.AsyncClient, urls: Sequence[str]) -> dict[str, int]:
    """The threshold decisions by ``policy:reason`` that the gateways at ``urls`` made
    (``pd_orchestrator_threshold_decisions_total``, summed; an unreadable one counts
    none)."""
    counts: dict[str, int] = {}
    for url in urls:
        response = await client.get(f"{url}/metrics")
        if response.status_code != 200:
            continue
        for family in text_string_to_metric_families(response.text):
            if family.name != "pd_orchestrator_threshold_decisions":
                continue
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = f"{sample.labels['policy']}:{sample.labels['reason']}"
                    counts[key] = counts.get(key, 0) + int(sample.value)
    return counts


async def _run_bound(
    url: str,
    workload: Workload,
    fleet: FleetSpec,
    options: LiveOptions,
    strategy: Strategy,
    metrics_urls: list[str],
    progress: Callable[[int], None] | None,
    gateways: Sequence[str] = (),
) -> RunResult:
    await _wait_ready(url, "/ready")
    await _wait_timed(url)
    result = await run_target(
        url,
        workload,
        fleet.model,
        options,
        strategy=strategy.name,
        mode=strategy.mode.value,
        fleet=fleet.name,
        metrics_urls=metrics_urls,
        progress=progress,
    )
    async with httpx.AsyncClient(timeout=10.0) as client:
        result.reasons = await read_decisions(client, gateways)
    return result


async def _wait_timed(url: str, limit: float = 120.0) -> None:
    """Poll the gateway's ``/status`` until no pool is being timed (``goodput_timing``,
    :mod:`~pd_orchestrator.gateway.calibrate`) in :data:`_SETTLED_READS` reads in a row
    (its workers answer in turn), as the virtual bench runs the workload after the
    start-up timing (``TimeoutError`` after ``limit`` s)."""
    settled = 0
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
        with anyio.fail_after(limit):
            while settled < _SETTLED_READS:
                timing = (await client.get("/status")).json().get("goodput_timing", {})
                busy = any(str(v).startswith("timing") for v in timing.values())
                settled = 0 if busy else settled + 1
                await anyio.sleep(0.05)


_SETTLED_READS = 5


async def _wait_ready(url: str, path: str, limit: float = 30.0) -> None:
    """Poll ``url + path`` until it answers 200 (``TimeoutError`` after ``limit`` s)."""
    async with httpx.AsyncClient(base_url=url, timeout=2.0) as client:
        with anyio.fail_after(limit):
            while True:
                try:
                    if (await client.get(path)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await anyio.sleep(0.2)


# -- vllm-router ------------------------------------------------------------------------------
def router_executable(version: str = VLLM_ROUTER_VERSION, python: str = sys.executable) -> Path:
    """vllm-router's executable in a cached venv outside the clone (built on first use)."""
    return peer_executable(replace(VLLM_ROUTER, version=version), python)


@contextmanager
def _router(fleet: FleetSpec, urls: dict[str, str], policy: str) -> Iterator[Child]:
    """vllm-router in P/D mode over the fleet's prefillers and decoders."""
    port = free_port()
    argv = [str(router_executable()), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--vllm-pd-disaggregation", "--kv-connector", "nixl", "--policy", policy]
    for instance in fleet.prefillers:
        argv += ["--prefill", urls[instance.name]]
    for instance in fleet.decoders:
        argv += ["--decode", urls[instance.name]]
    child = start_process("vllm-router", argv, f"http://127.0.0.1:{port}")
    try:
        yield child
    finally:
        stop_child(child)


def run_vllm_router(
    fleet: FleetSpec,
    workload: Workload,
    options: LiveOptions,
    policy: str = "round_robin",
    progress: Callable[[int], None] | None = None,
) -> RunResult:
    """The workload through vllm-router (P/D, NIXL) in front of a fresh simulated fleet."""
    if not fleet.prefillers:
        raise ValueError("vllm-router's P/D mode needs prefillers")
    with ExitStack() as stack:
        sims = start_fleet(fleet, options.sim_time_scale, stack)
        urls = {name: child.url for name, child in sims.items()}
        router = stack.enter_context(_router(fleet, urls, policy))
        return anyio.run(
            _run_router, router, workload, fleet, options, list(urls.values()), policy, progress
        )


async def _run_router(
    router: Child,
    workload: Workload,
    fleet: FleetSpec,
    options: LiveOptions,
    metrics_urls: list[str],
    policy: str,
    progress: Callable[[int], None] | None,
) -> RunResult:
    try:
        await _wait_ready(router.url, "/health", limit=60.0)
    except TimeoutError:
        raise ChildStartError(f"vllm-router was not ready:\n{router.log_tail()}") from None
    return await run_target(
        router.url,
        workload,
        fleet.model,
        options,
        strategy=f"vllm-router ({policy})",
        mode=Mode.PREFILL_FIRST.value,
        fleet=fleet.name,
        metrics_urls=metrics_urls,
        default_decision="pd",
        progress=progress,
    )
