"""What a relay adds per request: the gateway against vllm-router and SMG, with wrk.

One invocation starts a minimal OpenAI backend (``minimal_backend.py``: 16 tokens
at once), then in front of it the gateway (``pd-orchestrator serve`` with a
generated config: one decode pool and one prefill pool, both the backend, which
admits every request, so the gateway's path is decode-only), vllm-router and SMG
(each from PyPI in a cached venv outside the clone, plain routing with the backend
as their one worker, policy round_robin, logging at warning level), all on
free loopback ports. wrk (installed with apt-get when missing) then drives every
target -- the backend straight ("direct") as the baseline -- at each concurrency,
whole and streamed (``/v1/completions``, a short prompt, ``max_tokens`` 16), in
interleaved rounds (within a round, every case and every target; the target order
rotates each round). Each figure is the median over the rounds; "added" is the
target's figure minus the backend's. "CPU µs/req" is the CPU time (user and
system, every process of the target's) each request cost the target during its
wrk run: on a busy machine, where a relay shares its cores and its req/s say
little, this is what one core's req/s would be bound by (1 s / CPU per request).
Everything started is stopped at the end, on errors and on Ctrl-C.

    .venv/bin/python benchmarks/overhead_bench.py [--rounds 3] [--duration 5]
        [--targets direct,gateway,vllm-router,smg] [--concurrency 1,16]
        [--gateway-config FILE] [--baseline DIR] [--compiled DIR] [--pin CPU] [--workers 1,2]
        [--json FILE]

``--baseline DIR`` adds the gateway of another checkout (built there with ``make``),
or of a build of another version (``pip install --target DIR``, as ``make compiled``
builds ``.compiled``: the whole package, run on this interpreter with ``DIR`` first
on its ``PYTHONPATH``), as the target ``gateway-baseline``, with the same config, and
the ratios table sets this gateway against it: a change's before and after in one
invocation.
``--compiled DIR`` adds this checkout's gateway on the compiled build in ``DIR``
(``make compiled``: ``.compiled``, first on its ``PYTHONPATH``) as the target
``gateway-compiled``, set against the gateway the same way.
``--pin CPU`` compares core for core: every relay (the gateways, vllm-router, SMG)
runs on CPU alone (``taskset``), the backend and wrk on the other CPUs, so no relay
gets more cores than another and none competes with the load it serves.
``--workers 1,2`` adds, for each count above 1, the target ``gateway-wN``: this
gateway served by ``serve --workers N`` (pinned, it gets N CPUs from CPU on), and
the ratios table sets its req/s against one worker's. The load average is printed
before and after: the figures of a busy machine are compared within one invocation.
``--gateway-config FILE`` replaces the generated gateway config; ``${BACKEND_URL}``
and ``${MODEL}`` in it are replaced by the backend's URL and model name (the
listen address always comes from the command line).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from string import Template
from typing import Any

import httpx
import yaml
from rich.console import Console
from rich.table import Table

from pd_orchestrator.bench.peers import (
    SMG,
    VLLM_ROUTER,
    Peer,
    cache_root,
    free_port,
    peer_executable,
    start_process,
)
from pd_orchestrator.bench.wrk import WrkResult, lua_script, parse_output, wrk_command
from pd_orchestrator.children import Child, start_child, stop_child
from pd_orchestrator.cli.signals import exit_on_sigterm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from minimal_backend import COMPLETION_TOKENS, MODEL  # noqa: E402

TARGETS = ("direct", "gateway", "vllm-router", "smg")
FLOORS = ("floor-asgi", "floor-raw", "floor-decode", "floor-plan")
"""The Python floor of a relay (``floor_relay.py``): measured only when named."""
BASELINE = "gateway-baseline"
"""The gateway of another checkout (``--baseline DIR``), measured like a peer."""
COMPILED = "gateway-compiled"
"""This gateway on the compiled build (``--compiled DIR``), measured like a peer."""
PEERS = ("smg", "vllm-router")
WORKERS_PREFIX = "gateway-w"
"""``gateway-wN``: this gateway with ``serve --workers N`` (``--workers``)."""
PROMPT = "Explain in one sentence what a reverse proxy adds to each request."
READY_TIMEOUT = 90.0
console = Console(width=160)


@dataclass(frozen=True, slots=True)
class Case:
    """One load shape: wrk connections and whole or streamed answers."""

    concurrency: int
    stream: bool

    @property
    def label(self) -> str:
        return f"c{self.concurrency} {'stream' if self.stream else 'whole'}"


@dataclass(frozen=True, slots=True)
class Run:
    """One wrk run of one target and case in one round; ``cpu``: the target's CPU
    seconds during it."""

    target: str
    case: Case
    round: int
    result: WrkResult
    cpu: float = 0.0

    @property
    def cpu_per_request(self) -> float:
        return self.cpu / self.result.requests if self.result.requests else 0.0


@dataclass(frozen=True, slots=True)
class Figures:
    """Medians over the rounds of one target and case; ``added_*`` against direct."""

    target: str
    case: Case
    p50: float
    p99: float
    rps: float
    errors: int
    runs: int
    cpu_per_request: float = 0.0
    added_p50: float | None = None
    added_p99: float | None = None


# -- wrk ---------------------------------------------------------------------------------------
def ensure_wrk() -> str:
    """wrk's path; installs the Debian package ``wrk`` with apt-get when it is missing."""
    found = shutil.which("wrk")
    if found:
        return found
    if shutil.which("apt-get") is None:
        raise SystemExit("wrk is not installed and apt-get is not available: install wrk first")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "wrk"]):
        console.print(f"wrk is missing: running `{' '.join(sudo + command)}`")
        done = subprocess.run(sudo + command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"`{' '.join(command)}` failed:\n{done.stderr[-2000:]}")
    found = shutil.which("wrk")
    if found is None:
        raise SystemExit("apt-get installed wrk but it is not on PATH")
    return found


def wrk_version(wrk: str) -> str:
    done = subprocess.run([wrk, "-v"], capture_output=True, text=True, check=False)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return lines[0] if lines else ""


def request_body(stream: bool, prompt: str, model: str = MODEL) -> str:
    """The completions request wrk sends (``max_tokens`` 16; usage chunk when streamed)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": COMPLETION_TOKENS}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(body, separators=(",", ":"))


_TICK = os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(group: int) -> float:
    """CPU seconds (user and system) used so far by the live processes of process
    group ``group`` (a target and its workers: each starts in a session of its own)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                fields = stat.read().rpartition(b")")[2].split()
        except OSError:  # it ended meanwhile
            continue
        if int(fields[2]) == group:  # pgrp; utime and stime follow at 11 and 12
            total += int(fields[11]) + int(fields[12])
    return total / _TICK


def pinned(argv: list[str], cpus: str | None) -> list[str]:
    """``argv`` run on ``cpus`` only (``taskset -c``; threads and children inherit
    it), or as it is when ``cpus`` is None."""
    return argv if cpus is None else ["taskset", "-c", cpus, *argv]


def cpu_sets(pin: int | None, workers: int = 1) -> tuple[str | None, str | None]:
    """The CPUs of a relay of ``workers`` processes and those of the load (backend
    and wrk) under ``--pin``: the relay's from ``pin`` on, the load's the rest (all
    of this process's CPUs when the relay takes every one). (None, None) unpinned."""
    if pin is None:
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if pin not in cpus:
        raise SystemExit(f"--pin {pin}: this process may run on CPUs {cpus} only")
    start = cpus.index(pin)
    relay = [cpus[(start + i) % len(cpus)] for i in range(min(workers, len(cpus)))]
    load = [c for c in cpus if c not in relay] or cpus
    return ",".join(map(str, relay)), ",".join(map(str, load))


def run_wrk(
    wrk: str,
    url: str,
    script: Path,
    case: Case,
    duration: float,
    threads: int,
    cpus: str | None = None,
) -> WrkResult:
    """One wrk run of ``case`` against ``url`` for ``duration`` seconds (on ``cpus``)."""
    command = wrk_command(
        wrk,
        f"{url}/v1/completions",
        str(script),
        connections=case.concurrency,
        duration=duration,
        threads=threads,
    )
    done = subprocess.run(
        pinned(command, cpus), capture_output=True, text=True, timeout=duration + 60, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"wrk failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return parse_output(done.stdout)


# -- targets -----------------------------------------------------------------------------------
def _stopped_with(stack: ExitStack, child: Child) -> Child:
    stack.callback(stop_child, child)
    return child


def start_backend(stack: ExitStack, cpus: str | None = None) -> Child:
    argv = [sys.executable, str(HERE / "minimal_backend.py"), "--port", "0", "--model", MODEL]
    return _stopped_with(stack, start_child("backend", pinned(argv, cpus), timeout=30))


def gateway_config(backend_url: str, model: str = MODEL) -> dict[str, Any]:
    """One decode pool and one prefill pool, both the backend; defaults elsewhere."""

    def pool(role: str) -> dict[str, Any]:
        return {
            "name": role,
            "role": role,
            "hardware": "cpu",
            "group": "bench",
            "model": model,
            "endpoints": [{"name": f"backend-{role}", "url": backend_url}],
        }

    return {"version": 1, "connector": "nixl", "pools": [pool("decode"), pool("prefill")]}


def _gateway_config_file(backend_url: str, source: Path | None, directory: Path) -> Path:
    path = directory / "gateway.yaml"
    if source is None:
        path.write_text(yaml.safe_dump(gateway_config(backend_url), sort_keys=False))
    else:
        text = Template(source.read_text()).safe_substitute(BACKEND_URL=backend_url, MODEL=MODEL)
        path.write_text(text)
    return path


def start_gateway(
    stack: ExitStack,
    backend_url: str,
    source: Path | None,
    checkout: Path | None = None,
    name: str = "gateway",
    workers: int = 1,
    cpus: str | None = None,
    compiled: Path | None = None,
) -> Child:
    """The gateway of this checkout, or of ``checkout`` (its own ``.venv``, as ``make``
    builds it: ``--baseline``), serving ``source`` or the generated config with
    ``workers`` processes, on ``cpus``; with ``compiled`` (``--compiled``) first on its
    ``PYTHONPATH``."""
    directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pdo-overhead-")))
    config = _gateway_config_file(backend_url, source, directory)
    executable = Path(sys.executable).with_name("pd-orchestrator")
    if checkout is not None and (checkout / ".venv" / "bin" / "pd-orchestrator").exists():
        executable = checkout / ".venv" / "bin" / "pd-orchestrator"
    elif checkout is not None:  # a build of another version (parse_args checked it)
        compiled = checkout  # the whole package, run from there
    command = (
        [str(executable)] if executable.exists() else [sys.executable, "-m", "pd_orchestrator"]
    )
    port = free_port()
    argv = [*command, "serve", "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--workers", str(workers)] if workers > 1 else []
    if compiled is not None:
        argv = ["env", f"PYTHONPATH={compiled.resolve()}", *argv]
    child = start_process(name, pinned(argv, cpus), f"http://127.0.0.1:{port}")
    return _stopped_with(stack, child)


def start_floor(stack: ExitStack, backend_url: str, name: str, cpus: str | None) -> Child:
    """A floor relay (``floor_relay.py``, ``name`` is ``floor-MODE``) to the backend."""
    mode = name.removeprefix("floor-")
    argv = [sys.executable, str(HERE / "floor_relay.py"), "--mode", mode, "--upstream", backend_url]
    return _stopped_with(stack, start_child(name, pinned(argv, cpus), timeout=30))


def _executable(peer: Peer) -> str:
    """``peer``'s script from its cached venv, saying so when it is built first."""
    if not (cache_root() / peer.venv_name / "bin" / peer.script).exists():
        console.print(f"installing {peer.package} {peer.version} into {cache_root()} (first use)")
    return str(peer_executable(peer))


def start_vllm_router(
    stack: ExitStack, backend_url: str, policy: str, cpus: str | None = None
) -> Child:
    port, metrics = free_port(), free_port()
    argv = [_executable(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--worker-urls", backend_url, "--log-level", "warning"]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)]
    argv += ["--policy", policy] if policy != "default" else []
    child = start_process("vllm-router", pinned(argv, cpus), f"http://127.0.0.1:{port}")
    return _stopped_with(stack, child)


def start_smg(stack: ExitStack, backend_url: str, policy: str, cpus: str | None = None) -> Child:
    port, metrics = free_port(), free_port()
    argv = [_executable(SMG), "launch", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--worker-urls", backend_url, "--log-level", "warn", "--disable-tokenizer-autoload"]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics)]
    argv += ["--policy", policy] if policy != "default" else []
    child = start_process("smg", pinned(argv, cpus), f"http://127.0.0.1:{port}")
    return _stopped_with(stack, child)


def wait_serving(child: Child, prompt: str, limit: float = READY_TIMEOUT) -> None:
    """Wait until ``child`` answers a whole and a streamed completion with 200, then
    check both answers (:func:`check_answer`): a broken relay is not measured."""
    deadline = time.monotonic() + limit
    pending = [False, True]
    with httpx.Client(base_url=child.url, timeout=5.0) as client:
        while pending:
            if child.process.poll() is not None:
                raise RuntimeError(f"{child.name} exited:\n{child.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{child.name} did not serve within {limit:.0f}s:\n{child.log_tail()}"
                )
            try:
                response = client.post(
                    "/v1/completions",
                    content=request_body(pending[0], prompt),
                    headers={"content-type": "application/json"},
                )
            except httpx.HTTPError:
                response = None
            if response is not None and response.status_code == 200:
                problem = check_answer(response, stream=pending.pop(0))
                if problem:
                    raise RuntimeError(f"{child.name} answers wrongly: {problem}")
                continue
            time.sleep(0.25)


def check_answer(response: httpx.Response, *, stream: bool) -> str | None:
    """What is wrong with an answer to :func:`request_body` (None: nothing): the
    backend's 16 tokens, no token ids (the client did not ask), finish ``length``;
    streamed, as SSE with one chunk per token, the usage chunk and ``[DONE]``."""
    chunks: list[dict[str, Any]]
    if not stream:
        chunks = [response.json()]
    elif not response.headers.get("content-type", "").startswith("text/event-stream"):
        return f"a streamed answer with content-type {response.headers.get('content-type')}"
    else:
        events = [e[6:] for e in response.text.split("\n\n") if e.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return "a stream that does not end with data: [DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
    texts: list[dict[str, Any]] = [c["choices"][0] for c in chunks if c.get("choices")]
    usage: list[dict[str, Any]] = [c["usage"] for c in chunks if c.get("usage")]
    if not texts:
        return "no choices"
    if stream and len(texts) != COMPLETION_TOKENS:
        return f"{len(texts)} token chunks instead of {COMPLETION_TOKENS}"
    if any("token_ids" in t or "prompt_token_ids" in t for t in texts):
        return "token ids the client did not ask for"
    if texts[-1].get("finish_reason") != "length":
        return f"finish_reason {texts[-1].get('finish_reason')!r} instead of 'length'"
    if [u.get("completion_tokens") for u in usage] != [COMPLETION_TOKENS]:
        return f"usage {usage} instead of one with {COMPLETION_TOKENS} completion tokens"
    return None


def start_targets(stack: ExitStack, args: argparse.Namespace) -> dict[str, Child]:
    """Start the backend and every selected relay (each on its CPUs under ``--pin``);
    them by target name (``direct``: the backend)."""
    relay, load = cpu_sets(args.pin)
    backend = start_backend(stack, load)
    wait_serving(backend, args.prompt)
    started = {"direct": backend}
    config = args.gateway_config
    starters = {
        "gateway": lambda: start_gateway(stack, backend.url, config, cpus=relay),
        "vllm-router": lambda: start_vllm_router(stack, backend.url, args.peer_policy, relay),
        "smg": lambda: start_smg(stack, backend.url, args.peer_policy, relay),
        BASELINE: lambda: start_gateway(
            stack, backend.url, config, args.baseline, BASELINE, cpus=relay
        ),
        COMPILED: lambda: start_gateway(
            stack, backend.url, config, None, COMPILED, cpus=relay, compiled=args.compiled
        ),
    }
    for floor in FLOORS:
        starters[floor] = partial(start_floor, stack, backend.url, floor, relay)
    for count in args.workers:
        if count > 1:
            cpus = cpu_sets(args.pin, count)[0]
            starters[f"{WORKERS_PREFIX}{count}"] = partial(
                start_gateway, stack, backend.url, config, None, f"{WORKERS_PREFIX}{count}",
                count, cpus,
            )  # fmt: skip
    children = [starters[name]() for name in args.targets if name != "direct"]
    for child in children:
        wait_serving(child, args.prompt)
        console.print(f"{child.name} serves at {child.url} (log: {child.log_path})")
        started[child.name] = child
    return {name: started[name] for name in args.targets}


# -- measurement -------------------------------------------------------------------------------
def measure(
    wrk: str,
    targets: dict[str, Child],
    cases: list[Case],
    scripts: dict[bool, Path],
    args: argparse.Namespace,
) -> list[Run]:
    """Warm-up runs (discarded), then ``args.rounds`` interleaved rounds."""
    names = list(targets)
    urls = {name: child.url for name, child in targets.items()}
    load = cpu_sets(args.pin)[1]
    if args.warmup > 0:
        for case in cases:
            for name in names:
                script = scripts[case.stream]
                run_wrk(wrk, urls[name], script, case, args.warmup, args.wrk_threads, load)
    runs: list[Run] = []
    for round_ in range(args.rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for case in cases:
            for name in order:
                script = scripts[case.stream]
                group = targets[name].process.pid
                before = group_cpu_seconds(group)
                result = run_wrk(
                    wrk, urls[name], script, case, args.duration, args.wrk_threads, load
                )
                run = Run(name, case, round_, result, group_cpu_seconds(group) - before)
                runs.append(run)
                console.print(
                    f"round {round_ + 1}/{args.rounds} {case.label:10} {name:12} "
                    f"p50 {result.p50 * 1e3:7.3f} ms  p99 {result.p99 * 1e3:7.3f} ms  "
                    f"{result.rps:9.0f} req/s  cpu {run.cpu_per_request * 1e6:6.0f} us/req  "
                    f"errors {result.errors}",
                    highlight=False,
                )
    return runs


def summarize(runs: Sequence[Run]) -> list[Figures]:
    """Medians per target and case, with the added latency against ``direct``."""
    keys = list(dict.fromkeys((run.target, run.case) for run in runs))
    figures: dict[tuple[str, Case], Figures] = {}
    for target, case in keys:
        mine = [run.result for run in runs if run.target == target and run.case == case]
        figures[(target, case)] = Figures(
            target=target,
            case=case,
            p50=statistics.median(r.p50 for r in mine),
            p99=statistics.median(r.p99 for r in mine),
            rps=statistics.median(r.rps for r in mine),
            errors=sum(r.errors for r in mine),
            runs=len(mine),
            cpu_per_request=statistics.median(
                run.cpu_per_request for run in runs if run.target == target and run.case == case
            ),
        )
    for (target, case), figure in figures.items():
        direct = figures.get(("direct", case))
        if direct is not None:
            figures[(target, case)] = replace(
                figure, added_p50=figure.p50 - direct.p50, added_p99=figure.p99 - direct.p99
            )
    return list(figures.values())


@dataclass(frozen=True, slots=True)
class Ratio:
    """The gateway's figure against one peer's, for one metric."""

    metric: str
    peer: str
    gateway: float
    other: float
    goal: str

    @property
    def ratio(self) -> float | None:
        return self.gateway / self.other if self.other else None


def ratios(figures: Sequence[Figures], cases: Sequence[Case]) -> list[Ratio]:
    """Added p50 at the lowest concurrency and req/s at the highest, gateway vs peers
    (goals: the Rust peers' figures on the same core); and each ``gateway-wN``'s req/s
    at the highest against one worker's (goal: 0.9 N times)."""
    table = {(f.target, f.case): f for f in figures}
    low, high = min(c.concurrency for c in cases), max(c.concurrency for c in cases)
    found: list[Ratio] = []
    for peer in (*PEERS, BASELINE, COMPILED, *FLOORS):
        for case in cases:
            gateway, other = table.get(("gateway", case)), table.get((peer, case))
            if gateway is None or other is None:
                continue
            if (
                case.concurrency == low
                and gateway.added_p50 is not None
                and other.added_p50 is not None
            ):
                goal = "<= 1x" if peer == "smg" else ""
                found.append(
                    Ratio(
                        f"added p50 ms, {case.label}",
                        peer,
                        gateway.added_p50 * 1e3,
                        other.added_p50 * 1e3,
                        goal,
                    )
                )
            if case.concurrency == high:
                goal = ">= 1x" if peer == "smg" else ""
                found.append(Ratio(f"req/s, {case.label}", peer, gateway.rps, other.rps, goal))
                goal = "<= 1x" if peer == "smg" else ""
                found.append(
                    Ratio(
                        f"CPU us/req, {case.label}",
                        peer,
                        gateway.cpu_per_request * 1e6,
                        other.cpu_per_request * 1e6,
                        goal,
                    )
                )
    for (target, case), figure in table.items():
        one = table.get(("gateway", case))
        if not target.startswith(WORKERS_PREFIX) or case.concurrency != high or one is None:
            continue
        count = int(target.removeprefix(WORKERS_PREFIX))
        metric = f"req/s, {case.label}, {count} workers"
        found.append(Ratio(metric, "gateway", figure.rps, one.rps, f">= {0.9 * count:g}x"))
    return found


# -- report ------------------------------------------------------------------------------------
def _load(average: Sequence[float]) -> str:
    return " ".join(f"{value:.2f}" for value in average) + f" (1, 5, 15 min; {os.cpu_count()} CPUs)"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.3f}"


def figures_table(figures: Sequence[Figures], args: argparse.Namespace) -> Table:
    title = (
        f"medians of {args.rounds} rounds x {args.duration:g}s per target and case "
        f"(wrk, /v1/completions, {COMPLETION_TOKENS} tokens)"
    )
    table = Table(title=title)
    for column in (
        "case",
        "target",
        "p50 ms",
        "p99 ms",
        "req/s",
        "CPU us/req",
        "added p50 ms",
        "added p99 ms",
        "errors",
    ):
        table.add_column(column, justify="right" if column not in ("case", "target") else "left")
    ordered = sorted(figures, key=lambda f: (f.case.concurrency, f.case.stream))
    for figure in ordered:
        table.add_row(
            figure.case.label,
            figure.target,
            _ms(figure.p50),
            _ms(figure.p99),
            f"{figure.rps:,.0f}",
            f"{figure.cpu_per_request * 1e6:,.0f}",
            _ms(figure.added_p50),
            _ms(figure.added_p99),
            str(figure.errors),
        )
    return table


def ratios_table(found: Sequence[Ratio]) -> Table:
    table = Table(title="gateway against the peers")
    for column in ("metric", "peer", "gateway", "peer's", "gateway/peer", "goal"):
        table.add_column(
            column, justify="left" if column in ("metric", "peer", "goal") else "right"
        )
    for r in found:
        value = "-" if r.ratio is None else f"{r.ratio:.2f}x"
        table.add_row(
            r.metric,
            r.peer,
            f"{r.gateway:,.3f}" if "ms" in r.metric else f"{r.gateway:,.0f}",
            f"{r.other:,.3f}" if "ms" in r.metric else f"{r.other:,.0f}",
            value,
            r.goal,
        )
    return table


def write_json(
    path: Path,
    args: argparse.Namespace,
    runs: Sequence[Run],
    figures: Sequence[Figures],
    found: Sequence[Ratio],
    versions: dict[str, str],
    load_average: dict[str, list[float]],
) -> None:
    def case(c: Case) -> dict[str, Any]:
        return {"concurrency": c.concurrency, "stream": c.stream, "label": c.label}

    document = {
        "settings": {
            "rounds": args.rounds,
            "duration": args.duration,
            "warmup": args.warmup,
            "targets": args.targets,
            "concurrency": args.concurrency,
            "modes": args.modes,
            "prompt": args.prompt,
            "wrk_threads": args.wrk_threads,
            "peer_policy": args.peer_policy,
            "gateway_config": str(args.gateway_config) if args.gateway_config else None,
            "pin": args.pin,
            "workers": args.workers,
            "load_average": load_average,
            "versions": versions,
        },
        "runs": [
            {
                "target": r.target,
                "case": case(r.case),
                "round": r.round,
                "rps": r.result.rps,
                "cpu_seconds": r.cpu,
                **asdict(r.result),
            }
            for r in runs
        ],
        "figures": [{**asdict(f), "case": case(f.case)} for f in figures],
        "ratios": [{**asdict(r), "ratio": r.ratio} for r in found],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


# -- command line ------------------------------------------------------------------------------
def _csv(kind: type, choices: Sequence[str] | None = None) -> Any:
    def parse(text: str) -> list[Any]:
        values = [kind(part.strip()) for part in text.split(",") if part.strip()]
        unknown = [v for v in values if choices is not None and v not in choices]
        if not values or unknown:
            raise argparse.ArgumentTypeError(f"expected a comma list of {choices or kind.__name__}")
        return values

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument(
        "--targets",
        type=_csv(str, TARGETS + FLOORS),
        default=list(TARGETS),
        help="comma list of direct, gateway, vllm-router, smg (default: these four), "
        "floor-asgi, floor-raw, floor-decode, floor-plan (the Python floor of a relay, "
        "floor_relay.py)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument(
        "--duration", type=float, default=5.0, help="seconds per wrk run (default 5)"
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=1.0,
        help="seconds of discarded wrk run per target and case first (0: none)",
    )
    parser.add_argument(
        "--concurrency",
        type=_csv(int),
        default=[1, 16],
        help="comma list of wrk connection counts (default 1,16)",
    )
    parser.add_argument("--modes", type=_csv(str, ("whole", "stream")), default=["whole", "stream"])
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--wrk-threads", type=int, default=1, help="wrk threads (default 1)")
    parser.add_argument(
        "--peer-policy",
        default="round_robin",
        help="--policy of vllm-router and SMG (default round_robin; 'default': their own, "
        "cache_aware, with which vllm-router asks the worker to render and tokenize every "
        "prompt)",
    )
    parser.add_argument(
        "--gateway-config",
        type=Path,
        default=None,
        help="gateway YAML to use instead of the generated one "
        "(${BACKEND_URL} and ${MODEL} are substituted)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another checkout (with its .venv, as make builds it) or a build of another "
        "version (pip install --target) whose gateway runs as the target gateway-baseline, "
        "with the same config: before and after in one invocation",
    )
    parser.add_argument(
        "--compiled",
        type=Path,
        default=None,
        help="a compiled build (make compiled: .compiled) on which this gateway runs as the "
        "target gateway-compiled: source and compiled in one invocation",
    )
    parser.add_argument(
        "--pin",
        type=int,
        default=None,
        help="run every relay on this CPU alone, the backend and wrk on the others (core for core)",
    )
    parser.add_argument(
        "--workers",
        type=_csv(int),
        default=[1],
        help="comma list of gateway worker counts: each above 1 adds the target gateway-wN "
        "(serve --workers N; default 1)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.duration < 1 or args.warmup < 0 or args.wrk_threads < 1:
        parser.error("--rounds and --duration must be >= 1, --warmup >= 0, --wrk-threads >= 1")
    if any(c < 1 for c in args.concurrency) or any(w < 1 for w in args.workers):
        parser.error("--concurrency and --workers values must be >= 1")
    args.targets = [t for t in TARGETS + FLOORS if t in args.targets]
    args.targets += [f"{WORKERS_PREFIX}{w}" for w in dict.fromkeys(args.workers) if w > 1]
    if args.baseline is not None:
        venv = args.baseline / ".venv" / "bin" / "pd-orchestrator"
        if not venv.exists() and not (args.baseline / "pd_orchestrator").is_dir():
            parser.error(f"--baseline {args.baseline}: neither a checkout with .venv nor a build")
        args.targets.append(BASELINE)
    if args.compiled is not None:
        if not (args.compiled / "pd_orchestrator").is_dir():
            parser.error(f"--compiled {args.compiled}: no pd_orchestrator (run make compiled)")
        args.targets.append(COMPILED)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    wrk = ensure_wrk()
    cases = [Case(c, mode == "stream") for c in args.concurrency for mode in args.modes]
    versions = {"wrk": wrk_version(wrk), "vllm-router": VLLM_ROUTER.version, "smg": SMG.version}
    with ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pdo-wrk-")))
        scripts = {}
        for stream in (False, True):
            scripts[stream] = directory / f"{'stream' if stream else 'whole'}.lua"
            scripts[stream].write_text(lua_script(request_body(stream, args.prompt)))
        targets = start_targets(stack, args)
        load_average = {"before": list(os.getloadavg())}
        console.print(f"load average before: {_load(load_average['before'])}")
        runs = measure(wrk, targets, cases, scripts, args)
        load_average["after"] = list(os.getloadavg())
        console.print(f"load average after: {_load(load_average['after'])}")
    figures = summarize(runs)
    found = ratios(figures, cases)
    console.print(figures_table(figures, args))
    if found:
        console.print(ratios_table(found))
    if args.json is not None:
        write_json(args.json, args, runs, figures, found, versions, load_average)
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        console.print("interrupted; every process it started is stopped")
        sys.exit(130)
