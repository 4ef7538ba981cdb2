"""``pd-orchestrator profile``: measure running vLLM endpoints and write a profile file.

The file (:mod:`pd_orchestrator.model.measured`: the fitted latency model and the raw
points) is what a pool's ``profile:`` names, so the ``goodput`` policy starts from
this deployment's own costs, and what ``pd-orchestrator sim --profile FILE`` runs
from, so the bench replays the measured deployment.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import anyio
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pd_orchestrator.bench.profiling import ProfileOptions, Profiler
from pd_orchestrator.cli.logs import add_logging_arguments, setup_logging
from pd_orchestrator.model.measured import Measured, dump_measured, fit

__all__ = ["add_parser", "options_from_args", "run"]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in text.split(",") if part)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    defaults = ProfileOptions(url="")
    parser = subparsers.add_parser(
        "profile",
        help="measure running vLLM endpoints and write a profile file",
        description="Measures a running vLLM-compatible decoder (and, with --prefiller-url, "
        "the P/D hand-over through the connector) through its OpenAI API and /metrics: "
        "cold and cached prefill time, decode step time against batch and context, a "
        "mixed step, the hand-over's fixed and per-token costs. Writes the fitted model "
        "and the raw points (YAML for .yaml/.yml, else JSON): a pool's `profile:` names "
        "the file, `pd-orchestrator sim --profile FILE` runs from it.",
    )
    add = parser.add_argument
    add("--url", required=True, help="the decoder's base URL (http://host:port)")
    add("--prefiller-url", default=None, help="a prefiller: also measure the hand-over")
    add("--connector", default="nixl", help="the KV connector of the pair (default nixl)")
    add("--model", default=None, help="served model name (default: the first of /v1/models)")
    add("--api-key", default=None, help="bearer key of the endpoints")
    add("--out", type=Path, required=True, help="the profile file to write")
    add("--name", default=None, help="the profile's name (default: the file's stem)")
    add("--hardware", default="measured", help="hardware label recorded in the profile")
    join = ",".join
    add("--lengths", type=_ints, default=defaults.lengths,
        help=f"prompt lengths (default {join(map(str, defaults.lengths))})")  # fmt: skip
    add("--shares", type=_floats, default=defaults.shares,
        help=f"cached shares (default {join(map(str, defaults.shares))})")  # fmt: skip
    add("--batches", type=_ints, default=defaults.batches,
        help=f"decode batches (default {join(map(str, defaults.batches))})")  # fmt: skip
    add("--contexts", type=_ints, default=defaults.contexts,
        help=f"decode contexts (default {join(map(str, defaults.contexts))})")  # fmt: skip
    add("--output-tokens", type=int, default=defaults.output_tokens,
        help="tokens each decode stream generates")  # fmt: skip
    add("--mixed-chunk", type=int, default=defaults.mixed_chunk,
        help="the cold prompt of a mixed step (tokens)")  # fmt: skip
    add("--repeats", type=int, default=defaults.repeats, help="samples per setting")
    add("--max-requests", type=int, default=defaults.max_requests, help="requests at most")
    add("--max-seconds", type=float, default=defaults.max_seconds, help="seconds at most")
    add("--block-size", type=int, default=defaults.block_size, help="the decoder's KV block")
    add("--kv-bytes-per-token", type=int, default=128 * 1024,
        help="KV bytes a token (the unit of the fitted link speed; default 128 KiB)")  # fmt: skip
    add("--capacity-tokens", type=int, default=None,
        help="KV capacity (default: vllm:cache_config_info of /metrics, else 845000)")  # fmt: skip
    add("--seed", type=int, default=None,
        help="seed of the prompts' token ids (default: a fresh one each run; a seed run "
        "twice against one server finds its 'cold' prompts cached)")  # fmt: skip
    add("--no-progress", action="store_true", help="no progress bar")
    add_logging_arguments(parser)
    parser.set_defaults(handler=run)


def options_from_args(args: argparse.Namespace) -> ProfileOptions:
    return ProfileOptions(
        url=args.url,
        prefiller_url=args.prefiller_url,
        connector=args.connector,
        model=args.model,
        api_key=args.api_key,
        lengths=args.lengths,
        shares=args.shares,
        batches=args.batches,
        contexts=args.contexts,
        output_tokens=args.output_tokens,
        mixed_chunk=args.mixed_chunk,
        repeats=args.repeats,
        max_requests=args.max_requests,
        max_seconds=args.max_seconds,
        block_size=args.block_size,
        seed=args.seed,
    )


def _measured(args: argparse.Namespace, advance: Callable[[str], None]) -> Measured:
    profiler = Profiler(options_from_args(args), advance)
    points, source = anyio.run(profiler.run)
    capacity = args.capacity_tokens or source.get("capacity_tokens") or 845_000
    profile = fit(
        points,
        name=args.name or args.out.stem,
        model=str(source["model"]),
        hardware=args.hardware,
        kv_bytes_per_token=args.kv_bytes_per_token,
        capacity_tokens=int(capacity),
    )
    return Measured(profile, points, source)


def run(args: argparse.Namespace) -> int:
    setup_logging(args)
    console = Console(stderr=True)
    options = options_from_args(args)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(
        *columns, TimeElapsedColumn(), console=console, disable=args.no_progress
    ) as progress:
        task = progress.add_task("profile", total=options.planned())

        def advance(phase: str) -> None:
            progress.update(task, advance=1, description=phase)

        try:
            measured = _measured(args, advance)
        except Exception as exc:  # an unreachable or refusing endpoint: say so, exit 1
            console.print(f"[red]pd-orchestrator profile: {exc}[/]")
            return 1
    dump_measured(measured, args.out)
    p, source = measured.profile, measured.source
    console.print(
        f"wrote {args.out} ({source['requests']} requests): prefill {p.a_pf * 1e3:.2f} ms + "
        f"{p.lin * 1e6:.2f} us/token (attn {p.attn * 1e9:.3f} ns/pair); decode step "
        f"{(p.a_dec + p.weights) * 1e3:.2f} ms + {p.ctx_read * 1e9:.2f} ns/context token; "
        f"hand-over {p.a_kv * 1e3:.2f} ms + {(p.transfer_seconds(1) - p.a_kv) * 1e6:.2f} us/token",
        highlight=False,
    )
    if source.get("reports_cached_tokens") is False:
        console.print(
            "[yellow]the decoder reports no cached counts: start vLLM with "
            "--enable-prompt-tokens-details (cached points assumed whole blocks)[/]"
        )
    return 0
