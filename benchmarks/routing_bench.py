"""Token hit rate of round-robin, least-loaded and ask-all on a scaled-down Mooncake replay.

Each mode gets fresh simulated decoders and prefillers and its own gateway; the
first ``--requests`` requests of the Mooncake conversation trace are replayed open
loop at their (compressed) timestamps. Prompts are token ids derived from the
trace's 512-token hash blocks (``--block-tokens`` ids per block, so that a replay
fits on this machine); the hit rate is computed in the trace's own units: for each
request, the longest prefix of its hash blocks already served by the decoder that
served it, against the same with one cache shared by every decoder (the bound).

Modes: ``round-robin`` and ``least-loaded`` decode everything where they route it
(threshold 0); ``ask-all`` (race and probe) asks every decoder with threshold 0.5
and prefills remotely when all reject; ``ask-all-adaptive`` asks only the decoders
likely to hold the prompt (``ask_all.width: adaptive``; its 30-second warm-up
compressed with the trace's time), none when no decoder is.

Columns beyond the hit rates: upstream requests per client request (every request
the simulated endpoints finished, rejections included), decoders asked per request
(the gateway's ``pd_orchestrator_ask_all_asked``), and the prompt tokens the
decoders took in per prompt token sent (``vllm:prefix_cache_queries`` of the
decoders over the prompts' length: what each asked decoder hashes), and the prompt
tokens the decoders tokenized per prompt token sent (the simulator's
``vllm:prompt_tokens_tokenized``: text prompts, rendered chats, ``/tokenize``).

``--prompts text`` (the default) sends each prompt as the text of its ids (the
simulator's tokenizer maps it back to the same ids), as clients do; ``ids`` sends the
ids. Mode ``ask-all-text`` is ask-all with ``tokenize_from: null``: the text goes to
every asked decoder, each of which tokenizes it (ask-all before tokenize-once).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import yaml
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))

from _common import console

from pd_orchestrator.children import Child, python_command, start_child, stop_child
from pd_orchestrator.sim.tokenizer import NUM_WORDS, WORD_BASE, SimTokenizer

MODEL = "sim-model"
TRACE_ENV = "PDO_MOONCAKE_TRACE"
DECODE_ONLY = {"policy": {"type": "static", "value": 0.0}, "honour_client": False}
MODES: dict[str, dict[str, Any]] = {
    "round-robin": {
        "threshold": DECODE_ONLY,
        "routing": {
            "decode": {"scorers": [], "picker": {"type": "max-score", "params": {"ties": "rotate"}}}
        },
    },
    "least-loaded": {
        "threshold": DECODE_ONLY,
        "routing": {
            "decode": {
                "scorers": [{"type": "queue-depth"}],
                "picker": {"type": "max-score", "params": {"ties": "rotate"}},
            }
        },
    },
    "ask-all": {"mode": "ask-all", "threshold": {"policy": {"value": 0.5}}},
    "ask-all-text": {
        "mode": "ask-all",
        "ask_all": {"tokenize_from": None},
        "threshold": {"policy": {"value": 0.5}},
    },
    "ask-all-probe": {
        "mode": "ask-all",
        "ask_all": {"variant": "probe"},
        "threshold": {"policy": {"value": 0.5}},
    },
    "ask-all-adaptive": {
        "mode": "ask-all",
        "ask_all": {"width": "adaptive"},
        "threshold": {"policy": {"value": 0.5}},
    },
}


@dataclass(frozen=True)
class Request:
    at: float
    blocks: tuple[int, ...]
    input_length: int
    output: int


@dataclass
class Served:
    request: Request
    status: int
    decoder: str | None
    decision: str | None
    ttft: float | None


def load_trace(path: Path, count: int, compress: float) -> list[Request]:
    requests = []
    with path.open() as trace:
        for line in trace:
            row = json.loads(line)
            requests.append(
                Request(
                    at=row["timestamp"] / 1000 / compress,
                    blocks=tuple(row["hash_ids"]),
                    input_length=row["input_length"],
                    output=max(1, min(32, row["output_length"] // 16)),
                )
            )
            if len(requests) == count:
                break
    return requests


def prompt_ids(request: Request, per_block: int) -> list[int]:
    """Token ids of a request: ``per_block`` ids derived from each hash block, truncated."""
    ids: list[int] = []
    for block in request.blocks:
        for i in range(per_block):
            digest = hashlib.blake2b(f"{block}:{i}".encode(), digest_size=8).digest()
            ids.append(WORD_BASE + int.from_bytes(digest) % NUM_WORDS)
    return ids[: max(1, request.input_length * per_block // 512)]


def hit_rates(served: list[Served]) -> tuple[float, float]:
    """(routing hit rate, global-cache bound) in trace tokens."""
    caches: dict[str, set[tuple[int, ...]]] = {}
    shared: set[tuple[int, ...]] = set()
    hit = bound = total = 0
    for item in sorted(served, key=lambda s: s.request.at):
        blocks = item.request.blocks
        prefixes = [blocks[: k + 1] for k in range(len(blocks))]
        cache = caches.setdefault(item.decoder or "?", set())
        local = sum(1 for _ in _takewhile(prefixes, cache))
        shared_hit = sum(1 for _ in _takewhile(prefixes, shared))
        length = item.request.input_length
        hit += min(local * 512, length)
        bound += min(shared_hit * 512, length)
        total += length
        cache.update(prefixes)
        shared.update(prefixes)
    return hit / total, bound / total


def _takewhile(
    prefixes: list[tuple[int, ...]], cache: set[tuple[int, ...]]
) -> list[tuple[int, ...]]:
    out = []
    for prefix in prefixes:
        if prefix not in cache:
            break
        out.append(prefix)
    return out


async def replay(
    url: str, requests: list[Request], per_block: int, limit: int, text: bool
) -> list[Served]:
    served: list[Served] = []
    tokenizer = SimTokenizer()
    gate = anyio.Semaphore(limit)
    start = time.perf_counter()

    async def one(client: httpx.AsyncClient, request: Request) -> None:
        await anyio.sleep(max(0.0, request.at - (time.perf_counter() - start)))
        ids = prompt_ids(request, per_block)
        body = {
            "model": MODEL,
            "prompt": tokenizer.decode(ids) if text else ids,
            "max_tokens": request.output,
            "ignore_eos": True,
            "stream": True,
        }
        async with gate:
            sent = time.perf_counter()
            ttft = None
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if ttft is None and line.startswith("data: {"):
                        ttft = time.perf_counter() - sent
                headers = response.headers
            served.append(
                Served(request, response.status_code, headers.get("x-pd-decoder"),
                       headers.get("x-pd-decision"), ttft)
            )  # fmt: skip

    # idle connections expire well before the gateway's 5-second keep-alive timeout:
    # at equal timeouts a request can go out on a connection the server is closing
    limits = httpx.Limits(max_connections=limit, keepalive_expiry=1.0)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        async with anyio.create_task_group() as tg:
            for request in requests:
                tg.start_soon(one, client, request)
    return served


def _metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.split("{", 1)[0].split(" ", 1)[0] == name
    )


def run_mode(
    name: str, overrides: dict[str, Any], args: argparse.Namespace, requests: list[Request]
) -> list[str]:
    sim = ("--profile", "h200-llama3-8b", "--model", MODEL, "--time-scale", str(args.time_scale),
           "--kv-connector", "nixl", "--num-kv-blocks", str(args.kv_blocks))  # fmt: skip
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        sims: dict[str, Child] = {}
        for i in range(args.decoders):
            sims[f"d{i}"] = start_child(f"d{i}", python_command("sim", "--port", "0", *sim))
            stack.callback(stop_child, sims[f"d{i}"])
        for i in range(args.prefillers):
            sims[f"p{i}"] = start_child(f"p{i}", python_command("sim", "--port", "0", *sim))
            stack.callback(stop_child, sims[f"p{i}"])
        config = {
            "decoders": [
                {"name": n, "url": c.url, "model": MODEL} for n, c in sims.items() if n[0] == "d"
            ],
            "prefillers": [
                {"name": n, "url": c.url, "model": MODEL} for n, c in sims.items() if n[0] == "p"
            ],
            "load": {"interval": 0.25, "stale_after": 1.0},
        } | overrides
        if overrides.get("ask_all", {}).get("width") == "adaptive":
            # the warm-up is in real seconds: compressed with the trace's time
            config["ask_all"] = {"width": "adaptive", "adaptive": {"warmup": 30 / args.compress}}
        path = Path(tmp) / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        gateway = start_child(
            "gateway",
            python_command("serve", "--config", str(path), "--port", "0"),
            log_dir=args.log_dir,
        )
        stack.callback(stop_child, gateway)
        served = anyio.run(
            replay, gateway.url, requests, args.block_tokens, args.concurrency,
            args.prompts == "text",
        )  # fmt: skip
        texts = {n: httpx.get(c.url + "/metrics").text for n, c in sims.items()}
        gateway_text = httpx.get(gateway.url + "/metrics").text
    ok = [s for s in served if s.status == 200]
    hit, bound = hit_rates(ok)
    upstream = sum(_metric(t, "vllm:request_success_total") for t in texts.values())
    prefill = sum(_metric(t, "vllm:prefill_tokens_computed_total") for t in texts.values())
    queried = sum(
        _metric(t, "vllm:prefix_cache_queries_total") for n, t in texts.items() if n[0] == "d"
    )
    tokenized = sum(
        _metric(t, "vllm:prompt_tokens_tokenized_total") for n, t in texts.items() if n[0] == "d"
    )
    sent = sum(len(prompt_ids(s.request, args.block_tokens)) for s in ok)
    asked_count = _metric(gateway_text, "pd_orchestrator_ask_all_asked_count")
    asked = (
        _metric(gateway_text, "pd_orchestrator_ask_all_asked_sum") / asked_count
        if asked_count
        else None
    )
    wasted = _metric(gateway_text, "pd_orchestrator_fanout_wasted_tokens_total")
    decisions = [s.decision for s in ok]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    per_decoder = [sum(1 for s in ok if s.decoder == d) for d in sims if d[0] == "d"]
    n = len(ok)
    return [
        name, str(n), f"{hit:.1%}", f"{bound:.1%}",
        f"{decisions.count('decode') / n:.0%} / {decisions.count('pd') / n:.0%}",
        f"{upstream / n:.2f}", "-" if asked is None else f"{asked:.2f}",
        f"{queried / sent:.2f}", f"{tokenized / sent:.2f}",
        f"{wasted / n:.2f}", f"{prefill / n:.0f}",
        f"{max(per_decoder) / (n / len(per_decoder)):.2f}",
        f"{statistics.median(ttfts) * 1e3:.0f}",
        f"{sorted(ttfts)[int(0.99 * (len(ttfts) - 1))] * 1e3:.0f}",
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=os.environ.get(TRACE_ENV),
        required=not os.environ.get(TRACE_ENV),
        help=f"Mooncake conversation trace (JSON lines; default ${TRACE_ENV})",
    )
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument(
        "--compress", type=float, default=20.0, help="trace seconds per replay second"
    )
    parser.add_argument(
        "--block-tokens", type=int, default=32, help="token ids per 512-token block"
    )
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--prefillers", type=int, default=2)
    parser.add_argument("--kv-blocks", type=int, default=20000)
    parser.add_argument("--time-scale", type=float, default=0.5)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--modes", nargs="*", default=list(MODES))
    parser.add_argument("--log-dir", type=Path, help="keep each gateway's log here")
    parser.add_argument("--prompts", choices=("text", "ids"), default="text")
    args = parser.parse_args()
    requests = load_trace(args.trace, args.requests, args.compress)
    table = Table(title=f"Mooncake replay: {len(requests)} requests over {args.decoders} decoders")
    for column in ("mode", "served", "token hit rate", "global bound", "decode / pd",
                   "upstream req/req", "asked/req", "decoder prompt tok / prompt tok",
                   "decoder tokenized / prompt tok",
                   "wasted tok/req", "prefill tok/req", "max share / fair",
                   "TTFT p50 ms", "TTFT p99 ms"):  # fmt: skip
        table.add_column(column, justify="right")
    for mode in args.modes:
        table.add_row(*run_mode(mode, MODES[mode], args, requests))
        console.print(f"[dim]{mode} done[/]")
    console.print(table)


if __name__ == "__main__":
    main()
