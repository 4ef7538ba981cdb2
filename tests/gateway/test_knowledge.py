"""No silent knowledge, end to end: a pool that names a measured profile file runs
``goodput`` from it, one that names none starts from the seeds, and the gateway says
which (``/status``, the knowledge gauge) and what the model learnt since. Simulators
and the gateway as real processes."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from pd_orchestrator.config.settings import TimeoutConfig, UpstreamConfig
from pd_orchestrator.gateway.calibrate import _streamed
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.hardware import PROFILES
from pd_orchestrator.model.measured import Measured, Points, dump_measured
from pd_orchestrator.policies.calibration import COLD_TOKEN_IDS
from pd_orchestrator.upstream.client import Upstream

from ..conftest import GatewayFactory, SimFactory
from .helpers import call, metric, metrics_text

pytestmark = pytest.mark.anyio


async def test_a_pool_runs_goodput_from_its_measured_profile_and_the_gateway_says_so(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    measured = PROFILES["h200-llama3-8b"]
    profile = tmp_path / "measured.yaml"
    dump_measured(Measured(measured, Points(), {"url": "http://decoder"}), profile)
    sim = ("--profile", "instant", "--kv-connector", "nixl")
    decoder, prefiller = sim_factory(*sim, name="decode"), sim_factory(*sim, name="prefill")
    pools = [
        {"name": "decode", "role": "decode", "hardware": "h200", "model": "sim-model",
         "profile": str(profile), "endpoints": [{"name": "d0", "url": decoder.url}]},
        {"name": "prefill", "role": "prefill", "hardware": "h200", "model": "sim-model",
         "endpoints": [{"name": "p0", "url": prefiller.url}]},
    ]  # fmt: skip
    config = {"pools": pools, "threshold": {"policy": {"type": "goodput"}}}
    gateway = gateway_factory(config | {"health": {"interval": 0.5}})
    prompt = f"{uuid.uuid4().hex} " + "a prompt of a few blocks. " * 8
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    answer = await call(gateway.url, "completion", body | {"stream": True})
    assert answer.status == 200
    async with httpx.AsyncClient(timeout=30) as client:
        status = (await client.get(f"{gateway.url}/status")).json()
    assert status["goodput_starts_from"] == {
        "decode": f"measured profile {profile}",
        "prefill": "seeds",  # `hardware: h200` alone picks no simulator constants
    }
    learnt = status["goodput_learnt"]["goodput"]["decode"]
    assert learnt["handover_fixed"] == pytest.approx(measured.a_kv)
    assert learnt["rate_local"] > 0
    assert learnt["step_per_stream"] is None  # a measured profile has the step
    assert learnt["attention"] == pytest.approx(measured.attn)  # and the attention term
    text = await metrics_text(gateway.url)
    knowledge = "pd_orchestrator_policy_knowledge"
    assert metric(text, knowledge, pool="decode", source="measured") == 1
    assert metric(text, knowledge, pool="prefill", source="seeds") == 1


def _seeded_pools(decoder_url: str, prefiller_url: str) -> list[dict[str, object]]:
    """A decode and a prefill pool on simulators, neither naming a profile."""
    return [
        {"name": "decode", "role": "decode", "hardware": "h200", "model": "sim-model",
         "endpoints": [{"name": "d0", "url": decoder_url}]},
        {"name": "prefill", "role": "prefill", "hardware": "h200", "model": "sim-model",
         "endpoints": [{"name": "p0", "url": prefiller_url}]},
    ]  # fmt: skip


async def _learnt_once(url: str, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The decode pool's learnt state once ``check`` holds for it (fails after 30 s)."""
    async with httpx.AsyncClient(timeout=10) as client:
        with anyio.fail_after(30):
            while True:
                status = (await client.get(f"{url}/status")).json()
                learnt: dict[str, Any] = status["goodput_learnt"].get("goodput", {})
                if check(learnt):
                    return learnt
                await anyio.sleep(0.1)


async def _timed_once(url: str) -> dict[str, Any]:
    """``/status`` once no pool is still being timed (fails after 30 s)."""
    async with httpx.AsyncClient(timeout=10) as client:
        with anyio.fail_after(30):
            while True:
                status: dict[str, Any] = (await client.get(f"{url}/status")).json()
                timing = status.get("goodput_timing", {})
                if not any(str(v).startswith("timing") for v in timing.values()):
                    return status
                await anyio.sleep(0.1)


async def test_a_pool_with_no_profile_is_timed_when_the_gateway_starts(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    """Before any request, the gateway times cold prompts on each pool with no profile:
    the decoder's teach its local rate, the prefiller's its own and the decode pool's
    remote rate, and one more prompt on the decoder, streaming 32 tokens, its decode
    step. The simulators run the H200 profile (about 30,000 tokens/s on these lengths,
    6.5 ms a step of one stream): the rates leave the 20,000 seed for it, and the step
    is learnt on the decode pool only, from the gaps between the tokens."""
    sim = ("--profile", "h200-llama3-8b", "--model", "sim-model", "--kv-connector", "nixl")
    decoder, prefiller = sim_factory(*sim, name="decode"), sim_factory(*sim, name="prefill")
    params = {"probe_tokens": [2048, 4096], "probe_repeats": 1}
    config = {
        "pools": _seeded_pools(decoder.url, prefiller.url),
        "threshold": {"policy": {"type": "goodput", "params": params}},
        "health": {"interval": 0.5},
    }
    gateway = gateway_factory(config)
    learnt = await _learnt_once(
        gateway.url,
        lambda pools: (
            pools.get("decode", {}).get("alone_local") == 2
            and pools["decode"]["alone_remote"] == 2
            and pools.get("prefill", {}).get("alone_local") == 2
            and pools["decode"]["step_fixed"] is not None
        ),
    )
    # the engine's 6.5 ms; the simulators keep wall time, which a loaded host stretches
    assert 0.003 < learnt["decode"]["step_fixed"] < 0.02, learnt
    assert learnt["decode"]["step_per_stream"] == 0.0  # one batch size: flat
    assert learnt["prefill"]["step_fixed"] is None
    # two samples timed alone: the first lifts the seed by at most x1.5, the second
    # moves it to the faster length's rate, which may sit a little above 30,000 (on a
    # loaded host one read 30,033): from 0.8x to 1.25x the engine's rate
    seed, engine = 20_000, 30_000
    for pool, rate in (
        ("decode", "rate_local"),
        ("decode", "rate_remote"),
        ("prefill", "rate_local"),
    ):
        assert 1.2 * seed < learnt[pool][rate] <= 1.25 * engine, (pool, rate, learnt)
    text = await metrics_text(decoder.url)
    assert metric(text, "vllm:prompt_tokens_total") >= 2048 + 4096  # the decoder's prompts
    status = await _timed_once(gateway.url)
    assert status["goodput_timing"] == {
        "decode": "timed on d0: 5 prompts",  # two lengths, then three step prompts
        "prefill": "timed on p0: 2 prompts",
    }


def _read_often(sim_factory: SimFactory, params: dict[str, object]) -> dict[str, object]:
    """A gateway config: ``goodput`` with ``params`` over a decoder and a prefiller that
    prefill in chunks of 2,048 tokens (a reading between two chunks shows the prompt
    running), their loads read every 0.1 s."""
    sim = ("--profile", "h200-llama3-8b", "--model", "sim-model", "--kv-connector", "nixl",
           "--max-num-batched-tokens", "2048")  # fmt: skip
    decoder, prefiller = sim_factory(*sim, name="decode"), sim_factory(*sim, name="prefill")
    return {
        "pools": _seeded_pools(decoder.url, prefiller.url),
        "threshold": {"policy": {"type": "goodput", "params": params}},
        "health": {"interval": 0.5},
        "load": {"interval": 0.1, "stale_after": 5.0},
    }


async def test_each_probe_prompt_is_judged_alone_on_a_reading_taken_after_the_last(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    """The poller reads the simulators every 0.1 s, so its last reading when a prompt is
    sent was often taken while the prompt before ran (some 0.3 s each, prefilled in four
    chunks, so a reading between two counts it running). Each prompt follows the last
    one's answer with nothing else there, and is timed alone: all six on each server
    teach the rates as prompts timed alone. Judged on the poller's last reading, each of
    three runs counted some as timed beside the prompt before."""
    params = {"probe_tokens": [8192], "probe_repeats": 6, "probe_step_tokens": 0}
    gateway = gateway_factory(_read_often(sim_factory, params))
    status = await _timed_once(gateway.url)
    assert status["goodput_timing"] == {
        "decode": "timed on d0: 6 prompts",
        "prefill": "timed on p0: 6 prompts",
    }
    learnt = status["goodput_learnt"]["goodput"]
    alone = (learnt["decode"]["alone_local"], learnt["decode"]["alone_remote"],
             learnt["prefill"]["alone_local"])  # fmt: skip
    assert alone == (6, 6, 6), learnt


async def test_a_served_prompt_is_judged_alone_on_a_reading_that_counted_the_one_before(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    """The poller reads the decoder every 0.1 s, so a prompt sent the moment the one
    before was answered is planned on a reading taken while that one ran (some 0.3 s,
    prefilled in four chunks): the reading shows one request running, the one the
    gateway counted there when it was taken. Nothing else was there, so each of six cold
    prompts served on the decoder in turn teaches the local rate as a prompt timed
    alone. Judged on the reading's running count, most counted as timed beside the one
    before (a bounded step of the rate instead of a sample of its median)."""
    gateway = gateway_factory(_read_often(sim_factory, {"probe_tokens": []}))
    rng = random.Random(5)
    # the policy routes the first prompt (its pools' models made); the client's threshold
    # 0 then keeps each long one on the decoder, and the policy learns from what was served
    held = [rng.randrange(*COLD_TOKEN_IDS) for _ in range(64)]  # a simulator reports a
    # cached count only when some of the prompt was held: the six share these blocks
    fresh = [[rng.randrange(*COLD_TOKEN_IDS) for _ in range(8128)] for _ in range(6)]
    for prompt, threshold in [(held, {})] + [(held + t, {"cache_hit_threshold": 0}) for t in fresh]:
        body = {"model": "sim-model", "prompt": prompt, "max_tokens": 2} | threshold
        answer = await call(gateway.url, "completion", body)
        assert answer.status == 200
        assert answer.headers["x-pd-decision"] == "decode"
    learnt = await _learnt_once(gateway.url, lambda pools: "decode" in pools)
    assert learnt["decode"]["alone_local"] == 6, learnt


async def test_no_probe_is_longer_than_the_model_takes(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    """A probe length beyond the endpoint's ``max_model_len`` is not sent: the pool
    learns from traffic, starting on the seeds."""
    sim = ("--profile", "instant", "--model", "sim-model", "--max-model-len", "1024")
    decoder, prefiller = sim_factory(*sim, name="decode"), sim_factory(*sim, name="prefill")
    config = {
        "pools": _seeded_pools(decoder.url, prefiller.url),
        "threshold": {"policy": {"type": "goodput", "params": {"probe_tokens": [2048]}}},
        "health": {"interval": 0.5},
    }
    gateway = gateway_factory(config)
    body = {"model": "sim-model", "prompt": "hello " * 20, "max_tokens": 2}
    assert (await call(gateway.url, "completion", body)).status == 200
    await anyio.sleep(1.0)  # time for a probe, had one been sent
    learnt = await _learnt_once(gateway.url, lambda pools: "decode" in pools)
    assert learnt["decode"]["rate_local"] == 20_000 and learnt["decode"]["alone_local"] == 0
    assert metric(await metrics_text(decoder.url), "vllm:prompt_tokens_total") < 1024


async def test_a_probe_the_endpoint_refuses_leaves_the_pool_to_traffic(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    """The decoder serves another model than its pool names: it answers the probe with
    an error; ``/status`` says so, the pool stays on the seeds and the gateway goes on
    serving (here the prefill pool, whose probe succeeds, is timed all the same)."""
    decoder = sim_factory("--profile", "instant", "--model", "other-model", name="decode")
    prefiller = sim_factory("--profile", "h200-llama3-8b", "--model", "sim-model", name="prefill")
    params = {"probe_tokens": [1024], "probe_repeats": 1}
    config = {
        "pools": _seeded_pools(decoder.url, prefiller.url),
        "threshold": {"policy": {"type": "goodput", "params": params}},
        "health": {"interval": 0.5},
    }
    gateway = gateway_factory(config)
    status = await _timed_once(gateway.url)
    timing = status["goodput_timing"]
    assert timing == {"decode": "failed on d0 after 0 prompts", "prefill": "timed on p0: 1 prompt"}
    learnt = status["goodput_learnt"]["goodput"]
    assert learnt["decode"]["rate_local"] == 20_000 and learnt["decode"]["alone_local"] == 0
    assert learnt["decode"]["rate_remote"] > 20_000  # the prefiller's prompt
    body = {"model": "sim-model", "prompt": "hello " * 20, "max_tokens": 2}
    assert (await call(gateway.url, "completion", body)).status in (200, 404)  # it serves


async def test_a_step_prompt_is_timed_by_the_gaps_between_its_streamed_tokens(
    sim_factory: SimFactory,
) -> None:
    """The decode step prompt streams with its token ids: 32 tokens, its usage, and the
    mean gap after the first token, which leaves the prefill out (a 16k-token prompt
    on the simulated H200: its prefill alone is about 0.6 s, some 90 steps' worth, so
    read whole the prompt's time over 31 would be many times the step)."""
    sim = sim_factory("--profile", "h200-llama3-8b", "--model", "sim-model", name="decode")
    endpoint = Endpoint("d0", sim.url, Role.DECODE, "h200")
    upstream = Upstream(UpstreamConfig(), TimeoutConfig())
    prompt = [100 + n % 3000 for n in range(16384)]
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 32, "ignore_eos": True}
    try:
        sent = time.monotonic()
        usage, gap = await _streamed(upstream, endpoint, body, len(prompt), time.monotonic)
        whole = time.monotonic() - sent
    finally:
        await upstream.aclose()
    assert isinstance(usage, dict) and usage["completion_tokens"] == 32
    assert usage["prompt_tokens"] == len(prompt)
    assert gap is not None and 0.003 < gap < 0.02, gap  # the engine's 6.5 ms
    assert whole / 31 > 2 * gap, (whole, gap)
