"""Entry point: one sub-command per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from pd_orchestrator import __version__
from pd_orchestrator.cli import bench, gateway, profile, sidecar, sim, soak, top, up

__all__ = ["build_parser", "main"]

_COMMANDS: tuple[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None], ...] = (
    sim.add_parser,
    gateway.add_parsers,
    up.add_parser,
    sidecar.add_parser,
    top.add_parser,
    bench.add_parser,
    soak.add_parser,
    profile.add_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pd-orchestrator",
        description="Decode-first prefill/decode disaggregation orchestrator for vLLM.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sidecar"]:  # llm-d's flags may come Go-style: -port=8000
        argv = ["sidecar", *sidecar.normalize_flags(argv[1:])]
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
