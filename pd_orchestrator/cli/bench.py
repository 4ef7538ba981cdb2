"""``pd-orchestrator bench``: run a workload under every strategy and report.

Virtual (``--virtual``): a virtual-time fleet of simulator engines driven by the
routing pipeline and the threshold policies (fast: the whole Mooncake trace over
16 instances in minutes). Live (default): for each strategy a fresh simulated
fleet and our gateway on loopback, real HTTP; ``--vllm-router`` adds vllm-router
in P/D mode in front of the same simulators; ``--target URL`` instead sends the
workload to one running server (a gateway, a router or a simulator).

Writes ``results.json`` and PNG plots to ``--out`` and prints a table.

Virtual runs also measure goodput as the field does (DistServe): per strategy, the
highest multiple of the workload's arrival rate at which ``--attainment`` of the
requests meet both SLOs, by a sweep and ``--bisections`` bisection steps
(:mod:`pd_orchestrator.bench.goodput`), printed with each strategy's ratio to the
best other one and each pool's busy fraction; ``attainment.png`` plots attainment
against the rate. ``--bisections -1`` skips the search. ``--seeds N`` pools each
probe over ``N`` draws of a seeded workload (``--seed``, ``--seed`` + 1, ...): the
attainment of all their requests together. A draw of the Mooncake trace is a
window of it: seed ``k`` replays its ``k``-th stretch of ``--requests`` lines.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pd_orchestrator.bench.belief import ProfileError, misjudges, windows_rows
from pd_orchestrator.bench.fleet import FLEETS, FleetSpec, preset_fleet
from pd_orchestrator.bench.goodput import (
    GoodputSearch,
    Probe,
    SearchSettings,
    pooled,
    scaled,
    search,
)
from pd_orchestrator.bench.live import (
    LiveOptions,
    run_fleet_strategy,
    run_target,
    run_vllm_router,
)
from pd_orchestrator.bench.report import (
    goodput_document,
    goodput_table,
    plot_attainment,
    plot_results,
    summary_table,
    write_json,
)
from pd_orchestrator.bench.results import RunResult, Slo, summarize
from pd_orchestrator.bench.strategies import (
    DEFAULT_STRATEGIES,
    Strategy,
    load_policy_file,
    resolve_strategies,
)
from pd_orchestrator.bench.virtual import VirtualFleet, VirtualOptions
from pd_orchestrator.bench.workloads import (
    WORKLOADS,
    Workload,
    WorkloadOptions,
    build_workload,
    warm_up_options,
    warmed,
)
from pd_orchestrator.config import ConfigError, load_config
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.routing import RoutingConfig, RoutingProfiles, build_profiles

__all__ = ["ROUTING_PRESETS", "add_parser", "run"]

TRACE_ENV = "PDO_MOONCAKE_TRACE"
"""The environment variable naming the Mooncake trace when ``--trace`` is not given."""

ROUTING_PRESETS: dict[str, dict[str, Any]] = {
    # Decoders by rendezvous hashing of the prompt's first 1024 tokens (every healthy
    # decoder ties), prefillers by queue depth: a conversation stays where its KV is.
    "affinity": {
        "decode": {
            "scorers": [{"type": "queue-depth", "weight": 1.0}],
            "picker": {"type": "max-score", "params": {"tolerance": 1.0}},
        }
    },
    # Affinity with bounded loads: the same hashing, but a decoder past 1.25 times
    # the mean queue depth (plus one) passes the key on to its next decoder in hash
    # order, so a few hot keys do not pile onto one decoder.
    "bounded": {
        "decode": {
            "scorers": [{"type": "queue-depth", "weight": 1.0}],
            "picker": {"type": "max-score", "params": {"tolerance": 1.0, "load_bound": 1.25}},
        }
    },
    # The gateway's defaults: queue depth (weight 2) and KV usage (weight 1).
    "load": {},
}


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark decode-first policies against baselines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--workload", choices=WORKLOADS, required=True)
    add("--virtual", action="store_true", help="virtual-time fleet instead of live HTTP")
    add("--fleet", default="h200", help=f"{', '.join(FLEETS)}, or a gateway config with sim blocks")
    add("--decoders", type=int, default=None, help="decoders of a preset fleet (total)")
    add("--prefillers", type=int, default=None, help="prefillers of a preset fleet (total)")
    add(
        "--prefill-role",
        choices=("prefill", "both", "spill"),
        default="prefill",
        help="both: a preset's prefillers also decode (a flexible fleet, named *-flex); "
        "spill: they also serve whole requests goodput sends them (named *-spill)",
    )
    add("--policies", default=",".join(DEFAULT_STRATEGIES), help="comma-separated strategies")
    add("--policy-file", type=Path, default=None, help="YAML {name: threshold.policy block}")
    add("--routing", default="bounded", help="bounded, affinity, load, or a routing YAML file")
    add("--requests", type=int, default=None, help="at most this many requests")
    add("--time-scale", type=float, default=1.0, help="multiply arrival and think times")
    add("--size-scale", type=float, default=1.0, help="multiply prompt and output lengths")
    add("--rate", type=float, default=None, help="arrivals/s of the synthetic workloads")
    add("--seed", type=int, default=0, help="the draw (mooncake: which --requests lines)")
    add(
        "--trace",
        type=Path,
        default=Path(os.environ[TRACE_ENV]) if os.environ.get(TRACE_ENV) else None,
        help=f"the Mooncake trace (JSON lines; default ${TRACE_ENV})",
    )
    add(
        "--trace-offset",
        type=int,
        default=0,
        help="mooncake: skip this many trace lines before the seed's window "
        "(docs/benchmarks.md names the windows used in development)",
    )
    add(
        "--trace-bursts",
        action="store_true",
        help="mooncake: replay each timestamp's requests at once, as recorded "
        "(default: spread over the trace's timestamp step)",
    )
    add("--slo-ttft", type=float, default=2.0, help="goodput SLO on TTFT (seconds)")
    add(
        "--slo-ttft-floor",
        type=float,
        default=None,
        help="the TTFT limit's floor with --slo-ttft-scale (seconds; default --slo-ttft)",
    )
    add(
        "--slo-ttft-scale",
        type=float,
        default=0.0,
        help="TTFT limit per request: max(floor, this x its isolated cold prefill on the "
        "fleet's prefill hardware); 0: the absolute --slo-ttft",
    )
    add("--slo-tpot", type=float, default=0.05, help="goodput SLO on mean ITL (seconds)")
    add("--hop", type=float, default=VirtualOptions().hop, help="virtual: one HTTP leg (s)")
    add(
        "--no-profile",
        action="store_true",
        help="the policies are not told the instances' latency profiles: they start from "
        "seeds and learn online, as on a deployment nobody measured",
    )
    add(
        "--no-prefix-index",
        action="store_true",
        help="policies learn no prompt's cached prefix (a gateway without prefix.precise)",
    )
    add(
        "--attainment",
        type=float,
        default=0.9,
        help="virtual: the share of requests meeting the SLO that goodput asks for",
    )
    add(
        "--bisections",
        type=int,
        default=4,
        help="virtual: bisection steps of the goodput search (-1: no search)",
    )
    add(
        "--seeds",
        type=int,
        default=1,
        help="virtual: pool each goodput probe over this many seeds of the workload",
    )
    add(
        "--warm-up",
        type=int,
        default=0,
        metavar="N",
        help="virtual: before each run's requests, N requests of the same workload on "
        "contents of their own (another draw; of the trace, the lines after the window), "
        "served and learnt from, not counted",
    )
    add(
        "--warm-up-pause",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="virtual: simulated seconds from the warm-up's last request finishing to the "
        "measured requests' start",
    )
    add(
        "--profile-error",
        type=ProfileError.parse,
        action="append",
        default=[],
        metavar="prefill=F,transfer=G",
        help="virtual: also run each goodput strategy from a belief this far off "
        "(prefill rates x F, transfer rate x G; the simulated truth unchanged); repeatable",
    )
    add(
        "--windows",
        type=float,
        default=None,
        metavar="SECONDS",
        help="also print each run's attainment per window of this many seconds of arrivals",
    )
    add("--out", type=Path, default=None, help="output directory (default under bench-results/)")
    add("--no-plots", action="store_true")
    live = parser.add_argument_group("live runs")
    live.add_argument("--target", default=None, help="send to this running server only")
    live.add_argument(
        "--metrics-url", action="append", default=[], help="simulator /metrics to read"
    )
    live.add_argument("--sim-time-scale", type=float, default=1.0, help="simulators' time scale")
    live.add_argument("--concurrency", type=int, default=256, help="requests in flight at most")
    live.add_argument(
        "--gateways",
        default="1",
        help="gateway processes on one port (serve --workers N, SO_REUSEPORT), each with "
        "its own state; a comma-separated list runs each strategy once per count",
    )
    live.add_argument(
        "--shared-state",
        action="store_true",
        help="start a NATS server and let the gateway processes share their load through it",
    )
    live.add_argument("--vllm-router", action="store_true", help="also run vllm-router (P/D)")
    live.add_argument("--router-policy", default="round_robin", help="vllm-router's --policy")
    parser.set_defaults(handler=run)


def _fleet(args: argparse.Namespace) -> FleetSpec:
    fleet = _declared_fleet(args)
    return fleet.unprofiled() if getattr(args, "no_profile", False) else fleet


def _declared_fleet(args: argparse.Namespace) -> FleetSpec:
    if args.fleet in FLEETS:
        fleet = preset_fleet(args.fleet, args.decoders, args.prefillers)
        if args.prefill_role == "both":
            return fleet.flexible()
        return fleet.spilling() if args.prefill_role == "spill" else fleet
    config = load_config(Path(args.fleet))
    return FleetSpec.from_config(config, Path(args.fleet).stem)


def _routing(name: str) -> tuple[str, RoutingProfiles]:
    if name in ROUTING_PRESETS:
        block: Any = ROUTING_PRESETS[name]
    else:
        data = yaml.safe_load(Path(name).read_text()) or {}
        block = data.get("routing", data) if isinstance(data, dict) else data
    config = RoutingConfig.model_validate(block)
    return name, build_profiles(config, builtin_registry())


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


def _tracked(progress: Progress, name: str, total: int) -> Callable[[int], None]:
    task = progress.add_task(name, total=total)

    def advance(count: int) -> None:
        progress.advance(task, count)

    return advance


def _virtual_options(args: argparse.Namespace) -> VirtualOptions:
    """The virtual fleet's options the flags set (runs and goodput probes alike)."""
    return VirtualOptions(hop=args.hop, prefix_index=not args.no_prefix_index)


def _run_virtual(
    args: argparse.Namespace,
    fleet: FleetSpec,
    strategies: Sequence[Strategy],
    workload: Workload,
    console: Console,
) -> list[RunResult]:
    _, routing = _routing(args.routing)
    options = _virtual_options(args)
    results = []
    with _progress(console) as progress:
        for strategy in strategies:
            advance = _tracked(progress, strategy.name, len(workload))
            results.append(VirtualFleet(fleet, strategy, routing, options).run(workload, advance))
            if not console.is_terminal:
                console.print(f"{strategy.name}: {results[-1].wall_seconds:.1f}s", highlight=False)
        for error in args.profile_error:
            for strategy in filter(misjudges, strategies):
                name = f"{strategy.name} ({error.describe()})"
                advance = _tracked(progress, name, len(workload))
                wrong = replace(options, profile_error=error)
                result = VirtualFleet(fleet, strategy, routing, wrong).run(workload, advance)
                result.strategy = name
                results.append(result)
    return results


def _search_goodput(
    args: argparse.Namespace,
    fleet: FleetSpec,
    strategies: Sequence[Strategy],
    workloads: Sequence[Workload],
    console: Console,
) -> dict[str, GoodputSearch]:
    """Each strategy's goodput search (virtual runs over the scaled workloads, one per
    seed, pooled into one probe per multiplier)."""
    _, routing = _routing(args.routing)
    options = _virtual_options(args)
    slo = _slo(args, fleet)
    settings = SearchSettings(goal=args.attainment, bisections=args.bisections)
    sizes = [len(workload) - workload.warm_up for workload in workloads]

    def run(workload: Workload, multiplier: float, strategy: Strategy) -> Probe:
        result = VirtualFleet(fleet, strategy, routing, options).run(scaled(workload, multiplier))
        summary = summarize(result, slo)
        rate = summary.completed / summary.span if summary.span > 0 else 0.0
        return Probe(multiplier, summary.slo_share, rate, summary.busy)

    searches: dict[str, GoodputSearch] = {}
    for strategy in strategies:

        def probe(multiplier: float, strategy: Strategy = strategy) -> Probe:
            return pooled([run(w, multiplier, strategy) for w in workloads], sizes)

        searches[strategy.name] = found = search(probe, settings)
        console.print(
            f"goodput {strategy.name}: x{found.multiplier:.3g} ({len(found.probes)} runs)",
            highlight=False,
        )
    return searches


def _run_live(
    args: argparse.Namespace,
    fleet: FleetSpec,
    strategies: Sequence[Strategy],
    workload: Workload,
    console: Console,
) -> list[RunResult]:
    options = LiveOptions(
        sim_time_scale=args.sim_time_scale,
        concurrency=args.concurrency,
        prefix_index=not args.no_prefix_index,
        shared_state=args.shared_state,
    )
    results = []
    with _progress(console) as progress:
        if args.target is not None:
            advance = _tracked(progress, "target", len(workload))
            result = anyio.run(
                _target, args.target, workload, fleet.model, options, args.metrics_url, advance
            )
            return [result]
        counts = _gateway_counts(args.gateways)
        for strategy in strategies:
            for count in counts:
                name = strategy.name if len(counts) == 1 else f"{strategy.name} ({count} gw)"
                advance = _tracked(progress, name, len(workload))
                served = replace(options, gateways=count)
                result = run_fleet_strategy(fleet, strategy, workload, served, advance)
                result.strategy = name
                results.append(result)
        if args.vllm_router:
            advance = _tracked(progress, "vllm-router", len(workload))
            results.append(run_vllm_router(fleet, workload, options, args.router_policy, advance))
    return results


def _gateway_counts(text: str) -> list[int]:
    """``--gateways``: counts of gateway processes, comma-separated, each >= 1."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--gateways {text!r}: expected counts like 1,2,4") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"--gateways {text!r}: each count must be >= 1")
    return counts


async def _target(
    url: str,
    workload: Workload,
    model: str,
    options: LiveOptions,
    metrics: list[str],
    advance: Callable[[int], None],
) -> RunResult:
    return await run_target(
        url,
        workload,
        model,
        options,
        strategy="target",
        mode="unknown",
        fleet=url,
        metrics_urls=metrics,
        progress=advance,
    )


def _slo(args: argparse.Namespace, fleet: FleetSpec) -> Slo:
    """The SLO of ``--slo-*``: absolute (``--slo-ttft``) or, with ``--slo-ttft-scale``,
    scaling with each prompt's cold prefill on the fleet's prefill hardware."""
    floor = args.slo_ttft if args.slo_ttft_floor is None else args.slo_ttft_floor
    if not args.slo_ttft_scale:
        return Slo(floor, args.slo_tpot, attainment=args.attainment)
    prefill = fleet.prefill_latency()
    return Slo(floor, args.slo_tpot, args.slo_ttft_scale, prefill, args.attainment)


def _settings(
    args: argparse.Namespace, fleet: FleetSpec, workload: Workload, slo: Slo
) -> dict[str, Any]:
    return {
        "workload": workload.name,
        "description": workload.description,
        "requests": len(workload) - workload.warm_up,
        "warm_up": workload.warm_up,
        "warm_up_pause": workload.pause if workload.warm_up else None,
        "runner": "virtual" if args.virtual else "live",
        "fleet": fleet.name,
        "instances": fleet.describe(),
        "routing": args.routing,
        "time_scale": args.time_scale,
        "size_scale": args.size_scale,
        "sim_time_scale": None if args.virtual else args.sim_time_scale,
        "hop_seconds": args.hop if args.virtual else None,
        "prefix_index": not args.no_prefix_index,
        "seed": args.seed,
        "seeds": args.seeds,
        "trace_offset": args.trace_offset if args.workload == "mooncake" else None,
        "trace_window": workload.window or None,
        "trace_bursts": args.trace_bursts if args.workload == "mooncake" else None,
        "slo": {
            "ttft": slo.ttft,
            "tpot": slo.tpot,
            "ttft_scale": slo.ttft_scale,
            "ttft_prefill_profile": slo.prefill.name if slo.prefill else None,
            "described": slo.describe(),
        },
    }


def _report(
    args: argparse.Namespace,
    fleet: FleetSpec,
    workload: Workload,
    results: Sequence[RunResult],
    console: Console,
    searches: dict[str, GoodputSearch] | None = None,
) -> None:
    slo = _slo(args, fleet)
    runner = "virtual" if args.virtual else "live"
    out: Path = args.out or Path("bench-results") / f"{workload.name}-{runner}-{fleet.name}"
    out.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(result, slo) for result in results]
    window = f", {workload.window}" if workload.window else ""
    counted = len(workload) - workload.warm_up
    title = f"{workload.name} ({counted} requests{window}), {runner}, {fleet.describe()}"
    console.print(summary_table(summaries, title, slo))
    document = None
    if searches:
        pooled_over = f", each probe over {args.seeds} seeds" if args.seeds > 1 else ""
        label = f"goodput: {title}{pooled_over}"
        console.print(goodput_table(searches, label, slo, args.attainment))
        document = goodput_document(searches, args.attainment)
    write_json(
        out / "results.json", _settings(args, fleet, workload, slo), results, summaries, document
    )
    if not args.no_plots:
        plot_results(out, f"{workload.name}, {fleet.name}", results, summaries)
        if searches:
            plot_attainment(
                out / "attainment.png", f"{workload.name}, {fleet.name}", searches, args.attainment
            )
    if args.windows:
        console.print(_windows_table(results, slo, args.windows))
    walls = ", ".join(f"{s.strategy} {s.wall_seconds:.1f}s" for s in summaries)
    console.print(f"wall time: {walls}\nresults in {out}/", highlight=False)


def _windows_table(results: Sequence[RunResult], slo: Slo, length: float) -> Table:
    """Each run's attainment (and request count) per window of arrivals."""
    table = Table(title=f"attainment per {length:g} s of arrivals (requests)")
    table.add_column("arrivals")
    for result in results:
        table.add_column(result.strategy, justify="right")
    for row in windows_rows(results, slo, length):
        table.add_row(*row)
    return table


def _seeded(
    args: argparse.Namespace, options: WorkloadOptions, workload: Workload
) -> list[Workload]:
    """The workloads the goodput search pools: ``workload`` and, with ``--seeds N``,
    the draws of seeds ``--seed`` + 1 ... + N - 1. ``ValueError`` when ``--seeds``
    is below 1, asked of a run with no search, or a draw is the same as the first
    (a workload that ignores its seed would pool one run with itself)."""
    if args.seeds < 1:
        raise ValueError("--seeds must be at least 1")
    if args.seeds == 1:
        return [workload]
    if not args.virtual or args.bisections < 0:
        raise ValueError("--seeds pools the probes of the virtual goodput search (--virtual)")
    workloads = [workload]
    for offset in range(1, args.seeds):
        drawn = build_workload(args.workload, replace(options, seed=args.seed + offset))
        if drawn.requests == workload.requests:
            raise ValueError(
                f"seeds {args.seed} and {args.seed + offset} draw the same {args.workload} "
                "requests: pooling them would count one run twice"
            )
        workloads.append(drawn)
    return workloads


def _warmed(
    args: argparse.Namespace, options: WorkloadOptions, workloads: list[Workload]
) -> list[Workload]:
    """``workloads`` (the draws of seeds ``--seed`` + 0, 1, ...), each after a
    ``--warm-up`` of its own (:func:`warmed`); unchanged for none. ``ValueError`` for
    a negative count or pause, or a warm-up asked of a live run."""
    count = args.warm_up
    if count < 0 or not args.warm_up_pause >= 0.0:
        raise ValueError("--warm-up and --warm-up-pause must be >= 0")
    if count == 0:
        return workloads
    if not args.virtual:
        raise ValueError("--warm-up is for virtual runs (--virtual)")
    warmed_up = []
    for offset, workload in enumerate(workloads):
        drawn = warm_up_options(args.workload, replace(options, seed=args.seed + offset), count)
        warm = build_workload(args.workload, drawn)
        warmed_up.append(warmed(warm, workload, args.warm_up_pause))
    return warmed_up


def run(args: argparse.Namespace) -> int:
    console = Console() if sys.stdout.isatty() else Console(width=150)
    try:
        fleet = _fleet(args)
        policies = load_policy_file(args.policy_file) if args.policy_file else {}
        strategies = resolve_strategies(
            [name.strip() for name in args.policies.split(",") if name.strip()],
            policies,
            _slo(args, fleet),
        )
        options = WorkloadOptions(
            requests=args.requests,
            time_scale=args.time_scale,
            size_scale=args.size_scale,
            rate=args.rate,
            seed=args.seed,
            trace=args.trace,
            trace_offset=args.trace_offset,
            bursts=args.trace_bursts,
        )
        workload = build_workload(args.workload, options)
        workloads = _warmed(args, options, _seeded(args, options, workload))
        workload = workloads[0]
        _routing(args.routing)
        _gateway_counts(args.gateways)
    except (ValueError, OSError, ConfigError) as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        return 2
    console.print(f"{workload.description}\nfleet: {fleet.describe()}", highlight=False)
    runner = _run_virtual if args.virtual else _run_live
    results = runner(args, fleet, strategies, workload, console)
    searches = None
    if args.virtual and args.bisections >= 0:
        searches = _search_goodput(args, fleet, strategies, workloads, console)
    _report(args, fleet, workload, results, console, searches)
    return 0
