"""``pd-orchestrator sim``: run one simulated vLLM instance."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import anyio

from pd_orchestrator.cli.logs import add_logging_arguments, setup_logging
from pd_orchestrator.cli.signals import exit_on_sigterm
from pd_orchestrator.model.hardware import PROFILES
from pd_orchestrator.model.measured import resolve_profile
from pd_orchestrator.prefix.hashing import HASH_ALGOS
from pd_orchestrator.sim.faults import PROTOCOL_FAULTS
from pd_orchestrator.sim.options import SimOptions

__all__ = ["add_parser", "options_from_args", "run"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "sim",
        help="run a simulated vLLM instance",
        description="A vLLM-faithful simulated instance: prefix caching, the cache-hit "
        "threshold, KV hand-over through vLLM's connectors, continuous batching with "
        "preemption, and the H200/MI325X latency model.",
    )
    add = parser.add_argument
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8100, help="0 picks a free port (announced on stdout)")
    add("--model", default=None, help="served model name (default: the profile's model)")
    add(
        "--profile",
        type=_profile,
        default="h200-llama3-8b",
        help=f"a built-in latency profile ({', '.join(sorted(PROFILES))}) or a profile file "
        "`pd-orchestrator profile` wrote (default h200-llama3-8b)",
    )
    add("--time-scale", type=float, default=1.0, help="1 is real time, 0 removes delays")
    add("--block-size", type=int, default=16)
    add("--num-kv-blocks", type=int, default=None, help="default: profile capacity")
    add("--max-num-seqs", type=int, default=256)
    add("--max-num-batched-tokens", type=int, default=8192)
    add("--max-model-len", type=int, default=131_072)
    add("--global-cache-hit-threshold", type=float, default=0.0)
    add(
        "--kv-connector",
        default="none",
        help="KV connector spec: none, nixl, nixl-push, mooncake, moriio, offloading, lmcache, "
        "example, or multi:A,B (vLLM's MultiConnector over A and B, in order)",
    )
    add("--engine-id", default=None)
    add("--seed", type=int, default=0, help="generation seed")
    add(
        "--hash-seed",
        default=None,
        help="prefix-cache hash seed, vLLM's PYTHONHASHSEED (default: $PYTHONHASHSEED if set, "
        "else vLLM's fixed seed)",
    )
    add("--prefix-caching-hash-algo", choices=list(HASH_ALGOS), default="sha256")
    add(
        "--lease-seconds",
        type=float,
        default=30.0,
        help="how long produced KV is held (0: gone before any pull)",
    )
    add(
        "--kv-shared-dir",
        type=Path,
        default=None,
        help="shared store of the example and lmcache connectors",
    )
    add("--lmcache-chunk-size", type=int, default=256, help="LMCache's chunk size in tokens")
    add("--kv-load-failure-policy", choices=["fail", "recompute"], default="fail")
    add("--side-channel-host", default=None, help="host advertised in kv_transfer_params")
    add("--failure-rate", type=float, default=0.0, help="fraction of requests answered 500")
    add("--fault-seed", type=int, default=None, help="seed of the failures (default: --seed)")
    add("--drop-after-tokens", type=int, default=None, help="drop streams after N tokens")
    add(
        "--response-delay",
        type=float,
        default=0.0,
        help="seconds each completion request waits before it is taken (a slow server)",
    )
    add("--health-delay", type=float, default=0.0, help="seconds /health takes to answer")
    add(
        "--always-reject",
        action="store_true",
        help="answer every request cache_threshold, whatever its threshold (a faulty decoder)",
    )
    add(
        "--no-admission-only",
        action="store_true",
        help="an older threshold plugin: ignore cache_hit_admission_only (a preempted "
        "request below its threshold is handed back) and do not export its gauge",
    )
    add(
        "--protocol-fault",
        choices=PROTOCOL_FAULTS,
        default=None,
        help="send answers no vLLM would send (a faulty upstream)",
    )
    add("--kv-events-endpoint", default=None, help="ZMQ endpoint to publish KV events on (PUB)")
    add("--kv-events-replay-endpoint", default=None, help="ZMQ endpoint answering replays")
    add("--kv-events-topic", default="", help="topic of the published KV events")
    add("--kv-events-buffer-steps", type=int, default=10_000, help="batches kept for replay")
    add(
        "--kv-events-bytes-hashes",
        action="store_true",
        help="publish block hashes as digest bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)",
    )
    add(
        "--api-key",
        action="append",
        default=None,
        help="as vLLM's --api-key: /v1 routes need 'Authorization: Bearer KEY' (repeatable)",
    )
    add_logging_arguments(parser)
    parser.set_defaults(handler=run)


def _profile(value: str) -> str:
    """``value`` when it names a built-in profile or a readable profile file."""
    try:
        resolve_profile(value)
    except (KeyError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc.args[0])) from None
    return value


def options_from_args(args: argparse.Namespace) -> SimOptions:
    return SimOptions(
        host=args.host,
        port=args.port,
        model=args.model,
        profile=args.profile,
        time_scale=args.time_scale,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        global_cache_hit_threshold=args.global_cache_hit_threshold,
        kv_connector=args.kv_connector,
        engine_id=args.engine_id,
        seed=args.seed,
        hash_seed=args.hash_seed if args.hash_seed is not None else os.getenv("PYTHONHASHSEED"),
        hash_algo=args.prefix_caching_hash_algo,
        lease_seconds=args.lease_seconds,
        kv_shared_dir=args.kv_shared_dir,
        lmcache_chunk_size=args.lmcache_chunk_size,
        kv_load_failure_policy=args.kv_load_failure_policy,
        side_channel_host=args.side_channel_host,
        failure_rate=args.failure_rate,
        fault_seed=args.fault_seed,
        drop_after_tokens=args.drop_after_tokens,
        response_delay=args.response_delay,
        health_delay=args.health_delay,
        always_reject=args.always_reject,
        admission_only=not args.no_admission_only,
        protocol_fault=args.protocol_fault,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic,
        kv_events_buffer_steps=args.kv_events_buffer_steps,
        kv_events_int_hashes=not args.kv_events_bytes_hashes,
        api_keys=tuple(args.api_key or ()),
    )


def run(args: argparse.Namespace) -> int:
    from pd_orchestrator.sim.server import serve

    try:
        options = options_from_args(args)
    except (ValueError, KeyError) as exc:
        raise SystemExit(f"pd-orchestrator sim: {exc}") from None
    setup_logging(args)
    exit_on_sigterm()
    anyio.run(serve, options)
    return 0
