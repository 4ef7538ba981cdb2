"""Simulator throughput (instant) and the TTFT of a 2k-token prompt, cold vs warm."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).parent))

from _common import console, ms, sim, summary_table

from pd_orchestrator.bench.loadgen import run_closed_loop, send, summarize
from pd_orchestrator.model.hardware import get_profile

MODEL = "sim-model"


async def throughput(url: str, total: int, concurrency: int) -> None:
    def body(i: int) -> dict[str, object]:
        return {"model": MODEL, "prompt": f"request {i} " * 8, "max_tokens": 16, "ignore_eos": True}

    samples, wall = await run_closed_loop(
        url, "/v1/completions", body, total=total, concurrency=concurrency
    )
    console.print(
        summary_table(
            f"simulator, instant profile: non-streaming, 16 tokens, concurrency {concurrency}",
            [("sim", summarize(samples, wall))],
        )
    )


async def ttft(url: str, repeats: int) -> None:
    import httpx

    cold, warm = [], []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for r in range(repeats):
            prompt = list(range(300 + r * 7, 300 + r * 7 + 2048))
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": True}
            cold.append((await send(client, "/v1/completions", body)).ttft or 0.0)
            warm.append((await send(client, "/v1/completions", body)).ttft or 0.0)
    profile = get_profile("h200-llama3-8b")
    model_cold = profile.a_pf + profile.prefill_seconds(2048, 0)
    console.print(
        f"TTFT of a 2048-token prompt on h200-llama3-8b, time-scale 1 (median of {repeats}): "
        f"cold {ms(statistics.median(cold))} ms (model: {ms(model_cold)} ms), "
        f"warm {ms(statistics.median(warm))} ms -> warm/cold = "
        f"{statistics.median(warm) / statistics.median(cold):.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--total", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with sim("--profile", "instant") as instant:
        anyio.run(throughput, instant.url, args.total, args.concurrency)
    with sim("--profile", "h200-llama3-8b", "--model", MODEL, "--time-scale", "1") as h200:
        anyio.run(ttft, h200.url, args.repeats)


if __name__ == "__main__":
    main()
