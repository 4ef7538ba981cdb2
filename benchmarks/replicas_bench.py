"""Multi-turn decode hit rate with several gateway replicas behind a load balancer.

Each scenario gets a fresh simulated fleet on loopback (decoders publishing their
KV-cache events, prefillers; NIXL hand-over), one or three ``pd-orchestrator serve``
replicas over it and, for three, nginx in front (installed with apt-get when
missing). The same multi-turn chat workload goes through each: the conversations
of ``pd_orchestrator.bench.workloads.multi_turn`` (arrivals, 5-20 turns, think
times, message and answer lengths) sent as streamed ``/v1/chat/completions``
requests whose messages are the conversation so far (text in the simulator's
vocabulary), each with the conversation id in ``x-session-id``:

* approximate prefix routing (each replica learns from its own routing decisions):
  ``1 replica``; ``3 round-robin`` (nginx round-robin); ``3 affinity`` (nginx
  ``hash $http_x_session_id consistent``, the conversation id in ``x-session-id``);
* precise prefix routing (every replica subscribes to every decoder's KV events;
  chat prompts tokenized by a decoder's ``/tokenize``): the same three.

Figures, over the turns after a conversation's first (the ones whose history could
be cached): the share the gateway served on the decoder without remote prefill
(``x-pd-decision: decode``), the token hit rate (``usage.prompt_tokens_details.
cached_tokens`` / prompt tokens: the decoder's cache on ``decode``, the
prefiller's on ``pd``), the part of it the decoder itself held (cached tokens of
``decode`` turns / prompt tokens), the share that reached the decoder of the
previous turn, and the prompt tokens the whole fleet computed (the simulators'
``vllm:prefill_tokens_computed``), each against the one-replica run of the same
routing. ``--no-share-guard`` turns off the prefix scorers' share guard (kept per
replica) to show its part.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import yaml
from rich.console import Console
from rich.table import Table

from pd_orchestrator.bench.live import read_counters
from pd_orchestrator.bench.workloads import (
    BenchRequest,
    Workload,
    WorkloadOptions,
    materialize,
    multi_turn,
)
from pd_orchestrator.children import Child, RunDirectory, python_command, start_child, stop_child
from pd_orchestrator.sim.tokenizer import SimTokenizer

MODEL = "sim-model"
SESSION_HEADER = "x-session-id"
console = Console(width=160)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    replicas: int
    affinity: bool
    precise: bool


SCENARIOS = (
    Scenario("1 replica, approx.", 1, affinity=False, precise=False),
    Scenario("3 round-robin, approx.", 3, affinity=False, precise=False),
    Scenario("3 affinity, approx.", 3, affinity=True, precise=False),
    Scenario("1 replica, precise", 1, affinity=False, precise=True),
    Scenario("3 round-robin, precise", 3, affinity=False, precise=True),
    Scenario("3 affinity, precise", 3, affinity=True, precise=True),
)


@dataclass(frozen=True, slots=True)
class Options:
    decoders: int
    prefillers: int
    kv_blocks: int
    sim_time_scale: float
    threshold: float
    share_guard: bool


# -- nginx ------------------------------------------------------------------------------------
def nginx_executable() -> str:
    """nginx from PATH or /usr/sbin, installed from Debian with apt-get when missing."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SystemExit("nginx is missing: install it (Debian: apt-get install nginx-light)")
    console.print("installing nginx-light with apt-get ...", style="dim")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "nginx-light"],
        check=True,
        env=env,
    )
    found = shutil.which("nginx", path="/usr/sbin:/usr/local/sbin:/usr/bin")
    if not found:
        raise SystemExit("apt-get installed nginx-light but no nginx executable was found")
    return found


def nginx_config(directory: Path, port: int, backends: Sequence[str], affinity: bool) -> str:
    """An nginx configuration: ``port`` on loopback in front of ``backends`` (URLs),
    round-robin or by a consistent hash of the session header."""
    servers = "\n".join(f"    server {url.split('://', 1)[1]};" for url in backends)
    balance = "    hash $http_x_session_id consistent;\n" if affinity else ""
    temp = "\n".join(
        f"  {kind}_temp_path {directory / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""worker_processes 1;
daemon off;
pid {directory / "nginx.pid"};
error_log {directory / "error.log"} warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_max_body_size 64m;
  client_body_buffer_size 16m;  # long conversations stay in memory
{temp}
  upstream gateways {{
{balance}{servers}
    keepalive 64;
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://gateways;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 600s;
    }}
  }}
}}
"""


@contextmanager
def nginx(executable: str, backends: Sequence[str], affinity: bool) -> Iterator[str]:
    """nginx on a free loopback port in front of ``backends``; yields its URL."""
    with tempfile.TemporaryDirectory(prefix="pdo-nginx-") as tmp:
        directory = Path(tmp)
        directory.chmod(0o755)  # nginx's workers (another user when run as root) enter it
        port = _free_port()
        path = directory / "nginx.conf"
        path.write_text(nginx_config(directory, port, backends, affinity))
        argv = [
            executable,
            "-p",
            str(directory),
            "-e",
            str(directory / "error.log"),
            "-c",
            str(path),
        ]
        with subprocess.Popen(argv, stdin=subprocess.DEVNULL, process_group=0) as process:
            try:
                url = f"http://127.0.0.1:{port}"
                _wait_http(f"{url}/health", process)
                yield url
            finally:
                process.terminate()  # nginx: fast shutdown
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(10)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_http(url: str, process: subprocess.Popen[Any] | None = None, limit: float = 30) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer 200 within {limit:.0f}s")


# -- the fleet and the gateways ---------------------------------------------------------------
@dataclass
class Fleet:
    decoders: dict[str, Child]
    prefillers: dict[str, Child]
    events: dict[str, str]  # decoder name -> its KV-event publisher

    @property
    def urls(self) -> list[str]:
        return [c.url for c in [*self.decoders.values(), *self.prefillers.values()]]


def start_fleet(options: Options, stack: ExitStack, run: RunDirectory) -> Fleet:
    common = (
        "--host", "127.0.0.1", "--port", "0", "--profile", "h200-llama3-8b",
        "--model", MODEL, "--kv-connector", "nixl", "--block-size", "16",
        "--time-scale", str(options.sim_time_scale), "--num-kv-blocks", str(options.kv_blocks),
    )  # fmt: skip
    fleet = Fleet({}, {}, {})

    def start(name: str, *extra: str) -> Child:
        argv = python_command("sim", *common, "--engine-id", name, *extra)
        child = start_child(name, argv, log_dir=run.logs, timeout=60)
        stack.callback(stop_child, child)
        return child

    for i in range(options.decoders):
        name = f"decode-{i}"
        fleet.events[name] = f"tcp://127.0.0.1:{_free_port()}"
        fleet.decoders[name] = start(name, "--kv-events-endpoint", fleet.events[name])
    for i in range(options.prefillers):
        fleet.prefillers[f"prefill-{i}"] = start(f"prefill-{i}")
    return fleet


def gateway_config(fleet: Fleet, scenario: Scenario, options: Options) -> dict[str, Any]:
    prefix_scorer: dict[str, Any] = {
        "type": "precise-prefix" if scenario.precise else "approximate-prefix",
        "weight": 3,
    }
    if not options.share_guard:
        prefix_scorer["params"] = {"share_slack": None}
    config: dict[str, Any] = {
        "connector": "nixl",
        "decoders": [
            {"name": name, "url": child.url, "model": MODEL}
            for name, child in fleet.decoders.items()
        ],
        "prefillers": [
            {"name": name, "url": child.url, "model": MODEL}
            for name, child in fleet.prefillers.items()
        ],
        "routing": {
            "decode": {
                "scorers": [
                    prefix_scorer,
                    {"type": "queue-depth", "weight": 1},
                ]
            }
        },
        "threshold": {
            "policy": {"type": "static", "value": options.threshold},
            "honour_client": False,
        },
        "health": {"interval": 1.0},
    }
    if scenario.precise:
        config["prefix"] = {
            "precise": {
                "block_size": 16,
                "tokenize": True,  # chat prompts: token ids from a decoder's /tokenize
                "events": {
                    "publisher": None,
                    "endpoints": {name: {"publisher": url} for name, url in fleet.events.items()},
                },
            }
        }
    return config


def start_gateways(
    config: dict[str, Any], count: int, stack: ExitStack, run: RunDirectory
) -> list[Child]:
    path = run.path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    gateways = []
    for i in range(count):
        argv = python_command("serve", "--config", str(path), "--port", "0")
        child = start_child(f"gateway-{i}", argv, log_dir=run.logs, timeout=60)
        stack.callback(stop_child, child)
        gateways.append(child)
    for gateway in gateways:
        _wait_http(f"{gateway.url}/ready", gateway.process)
    if "prefix" in config:  # every replica has subscribed to every decoder's events
        decoders = {d["name"] for d in config["decoders"]}
        for gateway in gateways:
            _wait_streams(gateway.url, decoders)
    return gateways


def _wait_streams(url: str, decoders: set[str], limit: float = 30) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        streams = httpx.get(f"{url}/status", timeout=5).json()["prefix"]["kv_event_streams"]
        if all(streams.get(name) == "live" for name in decoders):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{url}: KV-event streams not live within {limit:.0f}s")


# -- the chat replay -------------------------------------------------------------------------
@dataclass
class Turn:
    """One request's outcome."""

    session: str
    turn: int
    decision: str = ""
    decoder: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


class ChatReplay:
    """Sends a workload's conversations as chat requests: turn 0 at its arrival, each
    next turn ``think_time`` after the previous answer; times are the workload's
    multiplied by ``time_scale`` (real seconds per simulated second)."""

    def __init__(self, client: httpx.AsyncClient, workload: Workload, time_scale: float) -> None:
        self.client = client
        self.workload = workload
        self.time_scale = time_scale
        self.tokenizer = SimTokenizer()
        self.turns: list[Turn] = []

    def text(self, request: BenchRequest, index: int) -> str:
        return self.tokenizer.decode(materialize([request.segments[index]]))

    async def run(self) -> list[Turn]:
        sessions: dict[str, list[BenchRequest]] = {}
        for request in self.workload.requests:
            sessions.setdefault(request.session, []).append(request)
        async with anyio.create_task_group() as tg:
            for requests in sessions.values():
                tg.start_soon(self.conversation, requests)
        return self.turns

    async def conversation(self, requests: list[BenchRequest]) -> None:
        await anyio.sleep(requests[0].arrival * self.time_scale)
        first = requests[0]
        messages = [{"role": "system", "content": self.text(first, 0)}]
        for request in requests:
            if request.index != first.index:
                await anyio.sleep(request.think_time * self.time_scale)
            messages.append({"role": "user", "content": self.text(request, -1)})
            turn = Turn(request.session, request.turn)
            self.turns.append(turn)
            answer = await self.send(request, messages, turn)
            if turn.error is not None:
                return  # the conversation cannot go on without its answer
            messages.append({"role": "assistant", "content": answer})

    async def send(self, request: BenchRequest, messages: list[dict[str, str]], turn: Turn) -> str:
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": request.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {SESSION_HEADER: request.session}
        pieces: list[str] = []
        try:
            async with self.client.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as response:
                if response.status_code != 200:
                    turn.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return ""
                turn.decision = response.headers.get("x-pd-decision", "")
                turn.decoder = response.headers.get("x-pd-decoder", "")
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        self.read_chunk(json.loads(line[6:]), turn, pieces)
        except httpx.HTTPError as exc:
            turn.error = f"{type(exc).__name__}: {exc}"
        return "".join(pieces)

    @staticmethod
    def read_chunk(chunk: dict[str, Any], turn: Turn, pieces: list[str]) -> None:
        if "error" in chunk:
            turn.error = str(chunk["error"])
        usage = chunk.get("usage") or {}
        if usage:
            turn.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            turn.cached_tokens = int(details.get("cached_tokens") or 0)
        for choice in chunk.get("choices") or []:
            pieces.append(str((choice.get("delta") or {}).get("content") or ""))


# -- one scenario -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Figures:
    turns: int
    decode_share: float
    token_hit_rate: float
    decoder_hit_rate: float
    same_decoder: float
    prefill_tokens: int
    errors: int
    first_error: str | None


def run_scenario(
    scenario: Scenario, workload: Workload, options: Options, nginx_path: str | None
) -> Figures:
    with RunDirectory(prefix="pdo-replicas-") as run, ExitStack() as stack:
        fleet = start_fleet(options, stack, run)
        config = gateway_config(fleet, scenario, options)
        gateways = start_gateways(config, scenario.replicas, stack, run)
        if scenario.replicas == 1:
            url = gateways[0].url
        else:
            assert nginx_path is not None
            url = stack.enter_context(
                nginx(nginx_path, [g.url for g in gateways], scenario.affinity)
            )
        return anyio.run(_replay, url, workload, options.sim_time_scale, fleet.urls)


async def _replay(url: str, workload: Workload, time_scale: float, sims: list[str]) -> Figures:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        before = await read_counters(client, sims)
        turns = await ChatReplay(client, workload, time_scale).run()
        computed = (await read_counters(client, sims) - before).prefill_tokens
    return figures(turns, int(computed))


def figures(turns: list[Turn], prefill_tokens: int) -> Figures:
    """The figures over the turns after each conversation's first (see the docstring)."""
    ordered = sorted(turns, key=lambda t: (t.session, t.turn))
    later = [t for t in ordered if t.turn > 0 and t.error is None]
    previous: dict[str, str] = {}
    same = 0
    for turn in ordered:
        if turn.turn > 0 and turn.error is None:
            same += previous.get(turn.session) == turn.decoder
        previous[turn.session] = turn.decoder
    prompt = sum(t.prompt_tokens for t in later)
    return Figures(
        turns=len(later),
        decode_share=sum(t.decision == "decode" for t in later) / max(1, len(later)),
        token_hit_rate=sum(t.cached_tokens for t in later) / max(1, prompt),
        decoder_hit_rate=sum(t.cached_tokens for t in later if t.decision == "decode")
        / max(1, prompt),
        same_decoder=same / max(1, len(later)),
        prefill_tokens=prefill_tokens,
        errors=sum(t.error is not None for t in turns),
        first_error=next((t.error for t in turns if t.error is not None), None),
    )


def report(rows: list[tuple[Scenario, Figures]], title: str) -> Table:
    table = Table(title=title)
    columns = ("scenario", "turns >= 2", "decode", "vs 1", "token hit rate", "vs 1")
    columns += ("on the decoder", "vs 1", "same decoder", "tokens computed", "vs 1", "errors")
    for column in columns:
        table.add_column(column, justify="left" if column == "scenario" else "right")
    bases = {s.precise: f for s, f in reversed(rows) if s.replicas == 1}
    for scenario, f in rows:
        base = bases.get(scenario.precise, f)
        table.add_row(
            scenario.name,
            str(f.turns),
            f"{f.decode_share:.1%}",
            _ratio(f.decode_share, base.decode_share),
            f"{f.token_hit_rate:.1%}",
            _ratio(f.token_hit_rate, base.token_hit_rate),
            f"{f.decoder_hit_rate:.1%}",
            _ratio(f.decoder_hit_rate, base.decoder_hit_rate),
            f"{f.same_decoder:.1%}",
            f"{f.prefill_tokens:,}",
            _ratio(f.prefill_tokens, base.prefill_tokens),
            str(f.errors),
        )
    return table


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--conversations", type=int, default=24)
    add("--requests", type=int, default=None, help="keep at most this many requests")
    add("--size-scale", type=float, default=0.25, help="multiplies every length")
    add("--think-scale", type=float, default=0.25, help="multiplies arrivals and think times")
    add("--sim-time-scale", type=float, default=0.25, help="real seconds per simulated second")
    add("--decoders", type=int, default=4)
    add("--prefillers", type=int, default=2)
    add("--kv-blocks", type=int, default=8192, help="KV blocks (16 tokens) per simulator")
    add("--threshold", type=float, default=0.5)
    add("--seed", type=int, default=0)
    add("--no-share-guard", action="store_true", help="prefix scorers without a share guard")
    add("--scenarios", default=",".join(str(i) for i in range(len(SCENARIOS))))
    args = parser.parse_args(argv)
    chosen = [SCENARIOS[int(i)] for i in args.scenarios.split(",")]
    workload = multi_turn(
        WorkloadOptions(
            requests=args.requests,
            time_scale=args.think_scale,
            size_scale=args.size_scale,
            seed=args.seed,
        ),
        conversations=args.conversations,
    )
    options = Options(
        args.decoders,
        args.prefillers,
        args.kv_blocks,
        args.sim_time_scale,
        args.threshold,
        share_guard=not args.no_share_guard,
    )
    nginx_path = nginx_executable() if any(s.replicas > 1 for s in chosen) else None
    rows = []
    for scenario in chosen:
        started = time.perf_counter()
        rows.append((scenario, run_scenario(scenario, workload, options, nginx_path)))
        if rows[-1][1].first_error:
            console.print(f"  first error: {rows[-1][1].first_error}", style="red")
        console.print(f"  {scenario.name}: {time.perf_counter() - started:.0f} s", style="dim")
    title = (
        f"{workload.description}; {len(workload)} requests; {args.decoders} decoders + "
        f"{args.prefillers} prefillers (simulated, NIXL), threshold {args.threshold}"
        + ("" if options.share_guard else ", no share guard")
    )
    console.print(report(rows, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
