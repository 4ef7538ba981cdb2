"""``pd-orchestrator soak``: the embedded system under load and faults for an hour.

Simulated pools and the gateway on loopback, a steady mix of requests, a decoder
killed and restarted and a prefiller answering 500s each period, every answer
checked token for token (:mod:`pd_orchestrator.bench.soak`). Prints a table every
``--report-every`` seconds and at the end; exits 1 when a pass criterion fails.
"""

from __future__ import annotations

import argparse
import sys

from pd_orchestrator.bench.soak import SoakOptions, run_soak

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("soak", help="long run under load and faults (loopback)")
    add = parser.add_argument
    defaults = SoakOptions()
    add("--duration", type=float, default=defaults.duration, help="seconds of load")
    add("--rate", type=float, default=defaults.rate, help="requests sent per second")
    add("--concurrency", type=int, default=defaults.concurrency, help="requests in flight at most")
    add("--report-every", type=float, default=defaults.report_every, help="seconds between tables")
    add("--fault-period", type=float, default=defaults.fault_period, help="seconds per fault cycle")
    add(
        "--flat-after",
        type=float,
        default=defaults.flat_after,
        help="RSS and descriptors must stay flat from this second on",
    )
    add("--flat-window", type=float, default=defaults.flat_window,
        help="seconds of readings compared (medians) at flat-after and at the end")  # fmt: skip
    add("--max-tokens", type=int, default=defaults.max_tokens, help="tokens per answer")
    add("--seed", type=int, default=defaults.seed, help="seed of the request mix")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        options = _options(args)
    except ValueError as exc:
        print(f"pd-orchestrator soak: {exc}", file=sys.stderr)
        return 2
    return 0 if run_soak(options).passed else 1


def _options(args: argparse.Namespace) -> SoakOptions:
    return SoakOptions(
        duration=args.duration,
        rate=args.rate,
        concurrency=args.concurrency,
        report_every=args.report_every,
        fault_period=args.fault_period,
        flat_after=args.flat_after,
        flat_window=args.flat_window,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
