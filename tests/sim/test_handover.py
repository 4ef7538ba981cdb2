"""KV hand-over between two simulator processes (NIXL-style pull and shared storage)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from ..conftest import SimFactory
from .test_server import MODEL, _metric, _metrics, _post

pytestmark = pytest.mark.anyio
PROMPT = "a long document to prefill remotely " * 12  # well over a few blocks
DECODE = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}


def _prefill_body() -> dict[str, Any]:
    return DECODE | {
        "max_tokens": 1,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }


async def _usage(url: str) -> float:
    return _metric(await _metrics(url), "vllm:kv_cache_usage_perc")


async def test_nixl_handover_decodes_the_reference_tokens_and_frees_the_prefiller(
    sim_factory: SimFactory,
) -> None:
    prefiller = sim_factory("--profile", "instant", "--kv-connector", "nixl", name="prefill")
    decoder = sim_factory("--profile", "instant", "--kv-connector", "nixl", name="decode")
    reference = sim_factory("--profile", "instant", name="reference")

    prefill = (await _post(prefiller.url, "/v1/completions", _prefill_body())).json()
    params = prefill["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_port"] == prefiller.port
    assert params["remote_block_ids"] and params["remote_request_id"]
    assert await _usage(prefiller.url) > 0  # blocks held for the pull

    decoded = (
        await _post(
            decoder.url,
            "/v1/completions",
            DECODE | {"kv_transfer_params": params, "cache_hit_threshold": 0.9},
        )
    ).json()
    expected = (await _post(reference.url, "/v1/completions", DECODE)).json()
    assert decoded["choices"][0]["text"] == expected["choices"][0]["text"]
    assert decoded["choices"][0]["finish_reason"] == "length"
    prompt_tokens = decoded["usage"]["prompt_tokens"]
    assert decoded["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_tokens - 1
    assert await _usage(prefiller.url) == 0  # released after the pull

    text = await _metrics(decoder.url)
    assert _metric(text, "vllm:external_prefix_cache_hits_total") == prompt_tokens - 1
    assert _metric(text, "vllm:nixl_xfer_time_seconds_count") == 1

    replay = await _post(decoder.url, "/v1/completions", DECODE | {"kv_transfer_params": params})
    assert replay.status_code == 500  # the blocks were already pulled
    assert "KV transfer failed" in replay.json()["error"]["message"]


async def test_lease_expiry_releases_the_blocks(sim_factory: SimFactory) -> None:
    prefiller = sim_factory(
        "--profile", "instant", "--kv-connector", "nixl", "--lease-seconds", "0.3"
    )
    decoder = sim_factory(
        "--profile", "instant", "--kv-connector", "nixl", "--kv-load-failure-policy", "recompute"
    )
    params = (await _post(prefiller.url, "/v1/completions", _prefill_body())).json()[
        "kv_transfer_params"
    ]
    assert params["remote_block_ids"]  # held for a pull (how long is the lease's business)
    with anyio.fail_after(10):
        while await _usage(prefiller.url) > 0:  # noqa: ASYNC110 - polls another process
            await anyio.sleep(0.05)
    recomputed = await _post(
        decoder.url, "/v1/completions", DECODE | {"kv_transfer_params": params}
    )
    assert recomputed.status_code == 200  # policy "recompute": decode locally instead
    assert recomputed.json()["usage"]["prompt_tokens_details"] is None


async def test_shared_storage_handover(sim_factory: SimFactory, tmp_path: Path) -> None:
    shared = ("--kv-connector", "example", "--kv-shared-dir", str(tmp_path))
    prefiller = sim_factory("--profile", "instant", *shared, name="prefill")
    decoder = sim_factory("--profile", "instant", *shared, name="decode")
    cold = await _post(
        decoder.url,
        "/v1/completions",
        DECODE | {"prompt": PROMPT + "!", "cache_hit_threshold": 0.5},
    )
    assert cold.json()["choices"][0]["finish_reason"] == "cache_threshold"
    prefill = (await _post(prefiller.url, "/v1/completions", DECODE | {"max_tokens": 1})).json()
    assert prefill["kv_transfer_params"] is None  # shared storage: nothing to hand over
    decoded = await _post(decoder.url, "/v1/completions", DECODE | {"cache_hit_threshold": 0.5})
    answer = decoded.json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert [path async for path in anyio.Path(tmp_path).glob("*.kv")]


async def test_side_channel_rejects_a_foreign_engine_id(sim_factory: SimFactory) -> None:
    prefiller = sim_factory("--profile", "instant", "--kv-connector", "nixl")
    async with httpx.AsyncClient(base_url=prefiller.url, timeout=5) as client:
        response = await client.post(
            "/nixl/pull", json={"remote_engine_id": "someone-else", "remote_request_id": "x"}
        )
    assert response.status_code == 409


async def test_failure_rate_answers_500(sim_factory: SimFactory) -> None:
    always = sim_factory("--profile", "instant", "--failure-rate", "1.0")
    never = sim_factory("--profile", "instant", "--failure-rate", "0.0")
    body = DECODE | {"max_tokens": 2}
    failed = await _post(always.url, "/v1/completions", body)
    assert failed.status_code == 500 and "failure-rate" in failed.json()["error"]["message"]
    assert (await _post(never.url, "/v1/completions", body)).status_code == 200


async def test_failures_are_drawn_from_the_fault_seed_and_leave_tokens_alone(
    sim_factory: SimFactory,
) -> None:
    failing = ("--profile", "instant", "--failure-rate", "0.5")
    first, second = sim_factory(*failing), sim_factory(*failing, "--fault-seed", "9")
    body = DECODE | {"max_tokens": 3, "return_token_ids": True}
    outcomes: list[list[int]] = [[], []]
    answers = []
    for _ in range(24):
        for index, sim in enumerate((first, second)):
            answer = await _post(sim.url, "/v1/completions", body)
            outcomes[index].append(answer.status_code)
            if answer.status_code == 200:
                answers.append(answer.json()["choices"][0]["token_ids"])
    assert outcomes[0] != outcomes[1] and {500, 200} <= set(outcomes[0]) | set(outcomes[1])
    assert all(ids == answers[0] for ids in answers)  # the generation seed is the same


async def test_response_and_health_delays(sim_factory: SimFactory) -> None:
    slow = sim_factory("--profile", "instant", "--response-delay", "0.6", "--health-delay", "0.6")
    async with httpx.AsyncClient(timeout=0.3) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.get(f"{slow.url}/health")
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{slow.url}/v1/completions", json=DECODE | {"max_tokens": 1})
    async with httpx.AsyncClient(timeout=5) as client:
        assert (await client.get(f"{slow.url}/health")).status_code == 200
        answer = await client.post(f"{slow.url}/v1/completions", json=DECODE | {"max_tokens": 1})
        assert answer.status_code == 200
