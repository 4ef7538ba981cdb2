"""Load with injected failures: every simulator answers HTTP 500 to 5% of its requests.

Cold prompts at a fixed concurrency through three decoders and two prefillers, each
failing 5% of its requests at random. Every request needs an attempt, a prefill and
a decode leg, so about one in ten meets a failure on its first decoder: prefill
failures are retried on the other prefiller, decoder failures start over on the
next decoder, and a request fails only when each of the three decoders failed it
(about 0.1%). Target: nothing lost, duplicated or hung; fewer than 0.5% clean
errors. Sizes come from ``PDO_CHAOS_LOAD_REQUESTS`` and ``PDO_CHAOS_LOAD_CONCURRENCY``
(``make chaos`` runs 2,000 requests at 200; CI a smaller default). The gateway's
peak RSS is reported.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory
from .harness import MODEL, Tally, jobs, recoveries, run_jobs, settle, start_fleet

pytestmark = pytest.mark.anyio

REQUESTS = int(os.environ.get("PDO_CHAOS_LOAD_REQUESTS", "600"))
CONCURRENCY = int(os.environ.get("PDO_CHAOS_LOAD_CONCURRENCY", "100"))
DECODERS = int(os.environ.get("PDO_CHAOS_LOAD_DECODERS", "3"))
INSTANT = ("--profile", "instant", "--kv-connector", "nixl", "--model", MODEL)


def _failing(seed: int) -> tuple[str, ...]:
    """An instance failing 5% of its requests, drawn from its own seed (shared draws
    would fail the same request numbers on every instance at once)."""
    return (*INSTANT, "--failure-rate", "0.05", "--fault-seed", str(seed))


def _peak_rss_mib(pid: int) -> float:
    """The process's peak resident set (Linux ``VmHWM``), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.mark.timeout(900)
async def test_load_with_5_percent_injected_500s(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, reference: Child
) -> None:
    fleet = start_fleet(
        sim_factory, gateway_factory, reference,
        decoders=[_failing(i) for i in range(DECODERS)],
        prefillers=[_failing(DECODERS + i) for i in range(2)],
        upstream={"retry_backoff": 0.01},
        timeouts={"decode_attempt": 20.0, "prefill": 20.0, "decode": 20.0},
    )  # fmt: skip
    tally = Tally(
        f"load: {REQUESTS} requests, concurrency {CONCURRENCY}, 5% 500s "
        f"({DECODERS} decoders, 2 prefillers)"
    )
    seconds = await run_jobs(
        fleet, jobs(REQUESTS, max_tokens=8), tally, concurrency=CONCURRENCY, bound=120.0
    )
    tally.notes |= await recoveries(fleet)
    tally.notes["seconds"] = round(seconds, 1)
    tally.notes["gateway_peak_rss_mib"] = round(_peak_rss_mib(fleet.gateway.process.pid), 1)
    # Fewer than 0.5%. A request fails only when all three decoders fail it (about
    # 0.1%: 0.6 expected at CI's 600 requests), so small runs also allow 5 -- more
    # happens with odds below 1 in 10,000 when the gateway works as designed; the
    # old behaviour (8.4%) would fail about 50.
    tally.check(max_clean_errors=max(int(REQUESTS * 0.005 - 1e-9), 5))
    assert tally.notes["retried"] >= 1  # the failures were there, and were retried
    await settle(fleet.upstreams)
