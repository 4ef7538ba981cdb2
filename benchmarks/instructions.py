"""Instructions per request: the request path's cost counted, not timed.

On a machine shared with other work the CPU time of one request moves by a third or
more from one run to the next, and by up to 2x in a noisy hour, so a change worth 10%
cannot be seen in a timed figure without many rounds. This script counts instead:
it runs ``request_path.py`` (the gateway's ASGI app, or one of the floor relays,
called from 16 loops in one process, the minimal backend in another) under
valgrind's ``callgrind``, which counts every instruction the process executes (the
backend, a child process, is not traced), once with ``--requests N`` and once with
``4N``. ``(I(4N) - I(N)) / 3N`` is what one more request costs: the start-up, the
imports and the warm-up are the same in both and cancel. Counts of the same code
agree within about 1% (the hash seed and the request ids move a few branches),
whatever else the machine runs.

An instruction is not a nanosecond (a cache miss costs more than an add), so this
is a measure of work done, for comparing two versions of the code or two targets of
one invocation; the overhead benchmark (``overhead_bench.py``) stays the measure of
what a client sees. ``--baseline DIR`` adds the gateway of another checkout (its own
``.venv``, as ``make`` builds it) as ``gateway-baseline``: before and after in one
invocation. ``--compiled DIR`` adds this checkout's gateway run on the compiled build
in ``DIR`` (``make compiled``: ``.compiled``, ahead of the source on ``PYTHONPATH``) as
``gateway-compiled``, and with ``--fleets`` its decision as ``decision-compiled``.

    .venv/bin/python benchmarks/instructions.py [--targets gateway,floor-plan,floor-decode]
        [--modes whole,stream] [--requests 400] [--baseline DIR] [--compiled DIR] [--jobs 2]
        [--json FILE]

Needs ``valgrind`` (the Debian package). A run of ``4N`` = 1,600 requests takes about
a minute and a half under callgrind.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGETS = ("gateway", "floor-asgi", "floor-decode", "floor-plan")
BASELINE = "gateway-baseline"
COMPILED = "gateway-compiled"
DECISION = "decision"
_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")


@dataclass(frozen=True, slots=True)
class Run:
    """One count: ``target`` (``gateway-baseline``: ``--baseline``'s gateway) in
    ``mode`` (``whole`` or ``stream``) with ``requests`` requests; or, for the targets
    ``decision``, ``decision-baseline`` and ``decision-compiled``, the decision alone
    over the fleet ``mode`` (``D:P``, ``decision_bench.py``)."""

    target: str
    mode: str
    requests: int

    def argv(self, baseline: Path | None, compiled: Path | None = None) -> list[str]:
        """The command: callgrind around the checkout's script (``--baseline``'s python
        and, for the decision, this checkout's script: it only calls the decision; a
        ``-compiled`` target with ``compiled`` first on ``PYTHONPATH``)."""
        python = Path(sys.executable)
        prefix: list[str] = []
        if self.target.endswith("-baseline"):
            assert baseline is not None
            python = baseline / ".venv" / "bin" / "python"
        if self.target.endswith("-compiled"):
            assert compiled is not None
            prefix = ["env", f"PYTHONPATH={compiled.resolve()}"]
        callgrind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
        argv = [*prefix, *callgrind, str(python)]
        if self.target.startswith(DECISION):
            decoders, prefillers = self.mode.split(":")
            script = HERE / "decision_bench.py"
            argv += [str(script), "--decoders", decoders, "--prefillers", prefillers]
            return [*argv, "--requests", str(self.requests)]
        target = self.target.removesuffix("-baseline")
        root = HERE.parent if target == self.target else baseline
        target = target.removesuffix("-compiled")
        assert root is not None
        argv += [str(root / "benchmarks" / "request_path.py"), "--target", target]
        argv += ["--requests", str(self.requests)]
        return argv + (["--stream"] if self.mode == "stream" else [])


def count(run: Run, baseline: Path | None, compiled: Path | None = None) -> int:
    """The instructions ``run``'s process executed (callgrind's ``I refs``)."""
    argv = run.argv(baseline, compiled)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    found = _REFS.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{run}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return int(found.group(1).replace(",", ""))


def per_request(counts: dict[Run, int], target: str, mode: str, requests: int) -> float:
    """Instructions one more request costs: the difference of the two counts."""
    small = counts[Run(target, mode, requests)]
    large = counts[Run(target, mode, 4 * requests)]
    return (large - small) / (3 * requests)


def table(
    figures: dict[tuple[str, str], float], targets: Sequence[str], modes: Sequence[str]
) -> str:
    """Markdown: instructions per request, and each against the first target."""
    first = targets[0]
    head = "| target | " + " | ".join(f"{m}: instructions/request | {m}: / {first}" for m in modes)
    lines = [head + " |", "|---" * (1 + 2 * len(modes)) + "|"]
    for target in targets:
        cells = []
        for mode in modes:
            value = figures[(target, mode)]
            cells += [f"{value:,.0f}", f"{value / figures[(first, mode)]:.3f}x"]
        lines.append(f"| {target} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--targets", default="gateway,floor-plan,floor-decode")
    parser.add_argument("--modes", default="whole,stream")
    parser.add_argument(
        "--fleets", default="", help="D:P,...: count the decision alone over these fleets too"
    )
    parser.add_argument("--requests", type=int, default=400, help="N: runs of N and 4N")
    parser.add_argument("--baseline", type=Path, help="another checkout, built with make")
    parser.add_argument("--compiled", type=Path, help="a compiled build (make compiled: .compiled)")
    parser.add_argument("--jobs", type=int, default=2, help="counts run at once")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    args.targets = [t for t in args.targets.split(",") if t]
    args.modes = [m for m in args.modes.split(",") if m]
    if unknown := [t for t in args.targets if t not in TARGETS]:
        parser.error(f"unknown targets {unknown}; choose from {', '.join(TARGETS)}")
    if unknown := [m for m in args.modes if m not in ("whole", "stream")]:
        parser.error(f"unknown modes {unknown}; choose from whole, stream")
    args.fleets = [f for f in args.fleets.split(",") if f]
    if bad := [f for f in args.fleets if not re.fullmatch(r"[1-9]\d*:\d+", f)]:
        parser.error(f"--fleets: {bad} are not DECODERS:PREFILLERS")
    if args.requests < 1 or args.jobs < 1:
        parser.error("--requests and --jobs must be >= 1")
    if args.baseline is not None:
        if not (args.baseline / ".venv" / "bin" / "python").exists():
            parser.error(f"--baseline {args.baseline}: no .venv/bin/python (run make there)")
        args.targets.insert(1, BASELINE)
    if args.compiled is not None:
        if not (args.compiled / "pd_orchestrator").is_dir():
            parser.error(f"--compiled {args.compiled}: no pd_orchestrator (run make compiled)")
        args.targets.insert(1, COMPILED)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    deciders = [DECISION] + ([f"{DECISION}-baseline"] if args.baseline is not None else [])
    deciders += [f"{DECISION}-compiled"] if args.compiled is not None else []
    cases = [(t, m) for t in args.targets for m in args.modes]
    cases += [(t, fleet) for fleet in args.fleets for t in deciders]
    runs = [Run(t, m, n) for t, m in cases for n in (args.requests, 4 * args.requests)]
    with ThreadPoolExecutor(args.jobs) as pool:
        counts = pool.map(lambda r: count(r, args.baseline, args.compiled), runs)
        counted = dict(zip(runs, counts, strict=True))
    figures = {(t, m): per_request(counted, t, m, args.requests) for t, m in cases}
    print(table(figures, args.targets, args.modes))
    if args.fleets:
        print()
        print(table(figures, deciders, args.fleets).replace("instructions/request", "decision"))
    if args.json is not None:
        rows = [{"target": t, "mode": m, "instructions": v} for (t, m), v in figures.items()]
        args.json.write_text(json.dumps({"requests": args.requests, "figures": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
