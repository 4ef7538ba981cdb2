"""Token hit rate of prefix-aware routers vs round-robin and least-loaded.

Replays (a) the Mooncake conversation trace, scaled down (each 512-token hash block
becomes 32 tokens, lengths shrink 16x, KV capacity too), and (b) a shared-prefix
synthetic workload (groups x users, system prompts of 2-6k tokens, multi-turn
questions of 256-1200 tokens) through the routing pipeline against simulated
decoders stepped in virtual time (no HTTP). The precise router's index is fed
with each engine's KV events through the wire codec (encode, then decode).
Decision times are CPU time of the routing thread.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

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

TRACE_ENV = "PDO_MOONCAKE_TRACE"
console = Console(width=160)


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f}"


def table(title: str, results: Sequence[ReplayResult], bound: float) -> Table:
    out = Table(title=title)
    columns = ("router", "token hit rate", "% of bound", "max share", "fair share")
    columns += ("sticky", "p50 µs", "p99 µs", "state memory", "requests per decoder")
    for column in columns:
        out.add_column(column, justify="left" if column == "router" else "right")
    for r in results:
        out.add_row(
            r.router,
            f"{r.hit_rate:.1%}",
            f"{r.hit_rate / bound:.0%}" if bound else "-",
            f"{r.max_share:.1%}",
            f"{r.fair_share:.1%}",
            f"{r.sticky:.0%}",
            us(r.decision_p50),
            us(r.decision_p99),
            f"{r.memory_bytes / 2**20:.1f} MiB",
            "/".join(str(n) for n in r.per_decoder),
        )
    out.add_row("global cache (bound)", f"{bound:.1%}", "100%", *["-"] * 7)
    return out


def run(title: str, workload: list[TraceRequest], fleet: FleetSpec, routers: list[str]) -> None:
    started = time.perf_counter()
    bound = global_hit_rate(workload, fleet.block_size)
    results = []
    for name in routers:
        results.append(replay(workload, name, ROUTERS[name], fleet))
        console.print(f"  {title}: {name} done", style="dim")
    console.print(table(title, results, bound))
    console.print(f"  ({time.perf_counter() - started:.0f} s)", style="dim")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add(
        "--trace",
        type=Path,
        default=os.environ.get(TRACE_ENV),
        help=f"Mooncake conversation_trace.jsonl (default: ${TRACE_ENV}; none: skip Mooncake)",
    )
    add("--routers", default=",".join(ROUTERS), help=f"comma list of {', '.join(ROUTERS)}")
    add("--decoders", type=int, default=4)
    add("--mooncake-requests", type=int, default=6000)
    add("--mooncake-time-scale", type=float, default=4.0, help="trace time is divided by this")
    add(
        "--mooncake-kv-tokens",
        default="52800,211200",
        help="KV capacity per decoder in scaled tokens, comma list (52,800 is an H200's "
        "845k tokens for Llama-3-8B scaled down 16x)",
    )
    add("--groups", type=int, default=32)
    add("--users", type=int, default=8)
    add("--turns", type=int, default=3)
    add("--rate", type=float, default=4.0, help="new conversations per second")
    add("--synthetic-kv-tokens", type=int, default=64_000)
    add("--skip-mooncake", action="store_true")
    add("--skip-synthetic", action="store_true")
    args = parser.parse_args(argv)
    routers = [name for name in args.routers.split(",") if name]
    unknown = [name for name in routers if name not in ROUTERS]
    if unknown:
        parser.error(f"unknown routers: {', '.join(unknown)}")
    if args.trace is None and not args.skip_mooncake:
        console.print(f"no Mooncake trace (--trace or ${TRACE_ENV}): skipping it", style="yellow")
    elif not args.skip_mooncake:
        trace = Path(args.trace)
        if not trace.exists():
            parser.error(f"no trace at {trace}")
        workload = mooncake_workload(
            trace, limit=args.mooncake_requests, time_scale=args.mooncake_time_scale
        )
        for kv in (int(v) for v in args.mooncake_kv_tokens.split(",")):
            fleet = FleetSpec(decoders=args.decoders, kv_tokens=kv)
            title = (
                f"Mooncake, first {len(workload)} requests, time /{args.mooncake_time_scale:g}, "
                f"{args.decoders} decoders x {kv:,} KV tokens"
            )
            run(title, workload, fleet, routers)
    if not args.skip_synthetic:
        workload = shared_prefix_workload(
            groups=args.groups, users=args.users, turns=args.turns, rate=args.rate
        )
        fleet = FleetSpec(decoders=args.decoders, kv_tokens=args.synthetic_kv_tokens)
        title = (
            f"shared prefix: {args.groups} groups x {args.users} users x {args.turns} turns, "
            f"{args.decoders} decoders x {args.synthetic_kv_tokens:,} KV tokens"
        )
        run(title, workload, fleet, routers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
