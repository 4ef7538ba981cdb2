"""The gateway's decision alone, at a fleet's size.

The overhead benchmark's fleet is one decoder and one prefiller, so what the
decision costs per endpoint never shows there. This script builds the gateway's
state (:class:`~pd_orchestrator.gateway.app.Gateway`, no server, no polls) over a
fleet of ``--decoders`` decoders and ``--prefillers`` prefillers (one group, the
default routing profiles and policy; addresses that are never contacted) and makes
the decision for the overhead benchmark's request ``--requests`` times, as the
gateway makes it for each request: the body's checks and parse, admission, the
routing candidates (kept current), the plan (``floor_relay.Planned``; the learning
after the answer is left out), and the fleet's counts moved as a served request
moves them (its decoder entered and left), so that the next decision sees one
endpoint changed, as the gateway's does. It prints the CPU time per decision; under
``instructions.py --fleets`` it is counted instead of timed.

    .venv/bin/python benchmarks/decision_bench.py [--decoders 16] [--prefillers 8]
        [--requests 4000]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import floor_relay  # noqa: E402
import overhead_bench  # noqa: E402

from pd_orchestrator.config.loader import parse_config  # noqa: E402


def fleet_config(decoders: int, prefillers: int) -> dict[str, Any]:
    """The overhead benchmark's config with ``decoders`` and ``prefillers`` endpoints
    (loopback addresses on port 9, never contacted)."""

    def pool(role: str, count: int) -> dict[str, Any]:
        endpoints = [
            {"name": f"{role}-{i}", "url": f"http://127.0.{i // 250}.{i % 250 + 2}:9"}
            for i in range(count)
        ]
        return {
            "name": role,
            "role": role,
            "hardware": "cpu",
            "group": "bench",
            "model": overhead_bench.MODEL,
            "endpoints": endpoints,
        }

    pools = [pool("decode", decoders), pool("prefill", prefillers)]
    return {"version": 1, "connector": "nixl", "pools": pools}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--decoders", type=int, default=16)
    parser.add_argument("--prefillers", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4000)
    args = parser.parse_args(argv)
    if args.decoders < 1 or args.prefillers < 0 or args.requests < 1:
        parser.error("--decoders and --requests must be >= 1, --prefillers >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    decide = floor_relay.Planned(parse_config(fleet_config(args.decoders, args.prefillers)))
    raw = overhead_bench.request_body(False, overhead_bench.PROMPT).encode()
    scope = {"path": "/v1/completions", "headers": [(b"content-type", b"application/json")]}
    counts = decide.state.fleet
    for _ in range(50):  # warm-up
        decide.decide(scope, raw)
    started = time.process_time()
    for _ in range(args.requests):
        plan = decide.decide(scope, raw)[2][1]
        counts.enter(plan.decoder.name, plan.prompt_tokens)
        counts.leave(plan.decoder.name, plan.prompt_tokens)
    spent = time.process_time() - started
    fleet = f"{args.decoders}:{args.prefillers}"
    each = spent / args.requests * 1e6
    print(f"decision over {fleet}: {args.requests} requests, CPU {each:.1f} us per decision")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
