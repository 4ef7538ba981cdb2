"""Every connector's full hand-over between two simulator processes, driven by hand.

Each test runs what the flow executor will run: the adapter's lookups, then its
legs in the adapter's order (in sequence, or both at once holding the decode answer
until the prefill answered) with its bodies and headers. The decode leg asks for a
0.9 cache-hit threshold, so it is admitted only if the KV came through the
connector; its tokens must equal a single instance's greedy run, and the
decoder's metrics must count the connector's (external) prefix-cache hits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from connectors import (
    Connector,
    Leg,
    LegOrder,
    PeerInfo,
    PrefillOutcome,
    TransferContext,
    get_connector,
)
from pd_orchestrator.children import Child

from ..conftest import SimFactory
from .test_server import MODEL, _metric, _metrics

pytestmark = pytest.mark.anyio
PROMPT = "a long document to prefill remotely " * 12
BODY: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(module_sims: SimFactory) -> Child:
    return module_sims("--profile", "instant", name="reference")


def _peer(sim: Child, engine_id: str | None) -> PeerInfo:
    """A simulator's side channels all listen on its HTTP port."""
    port = sim.port
    return PeerInfo(
        host="127.0.0.1",
        engine_id=engine_id,
        nixl_port=port,
        bootstrap_port=port,
        handshake_port=port,
        notify_port=port,
        p2p_port=port,
    )


async def _post(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any]:
    response = await client.post(url + "/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def _lookups(
    client: httpx.AsyncClient, connector: Connector, ctx: TransferContext
) -> TransferContext:
    for lookup in connector.lookups(ctx):
        response = await client.get(lookup.url)
        ctx = ctx.with_peer(lookup.leg, lookup.parse(response.json()))
    return ctx


async def hand_over(
    connector: Connector,
    ctx: TransferContext,
    prefiller: Child,
    decoder: Child,
    body: dict[str, Any],
) -> tuple[dict[str, Any], PrefillOutcome, LegOrder]:
    """Run one hand-over the way the adapter's contract says; the decode answer."""
    async with httpx.AsyncClient(timeout=30) as client:
        ctx = await _lookups(client, connector, ctx)
        order = connector.order(ctx)
        prefill_headers = {"X-Request-Id": f"{ctx.request_id}-p"} | connector.headers(
            Leg.PREFILL, ctx
        )
        decode_headers = {"X-Request-Id": f"{ctx.request_id}-d"} | connector.headers(
            Leg.DECODE, ctx
        )
        prefill_body = connector.prefill_body(body, ctx)
        if order is LegOrder.SEQUENTIAL:
            prefill = await _post(client, prefiller.url, prefill_body, prefill_headers)
            outcome = connector.read_prefill(prefill, ctx)
            assert outcome.params is not None or connector.describe().handovers & {
                "shared-storage",
                "lmcache",
            }
            decode_body = connector.decode_body(body, outcome.params, ctx)
            return await _post(client, decoder.url, decode_body, decode_headers), outcome, order
        answers: dict[str, dict[str, Any]] = {}
        decode_body = connector.decode_body(body, connector.ahead_params(ctx), ctx)

        async def leg(
            name: str, url: str, leg_body: dict[str, Any], headers: dict[str, str]
        ) -> None:
            answers[name] = await _post(client, url, leg_body, headers)

        async with anyio.create_task_group() as tg:
            tg.start_soon(leg, "decode", decoder.url, decode_body, decode_headers)
            tg.start_soon(leg, "prefill", prefiller.url, prefill_body, prefill_headers)
        outcome = connector.read_prefill(answers["prefill"], ctx)
        assert not outcome.finished and not outcome.stale
        return answers["decode"], outcome, order


async def _check(decoded: dict[str, Any], decoder: Child, reference: Child) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        expected = await _post(client, reference.url, BODY, {})
    assert decoded["choices"][0]["finish_reason"] == "length"
    assert decoded["choices"][0]["text"] == expected["choices"][0]["text"]
    prompt_tokens = decoded["usage"]["prompt_tokens"]
    assert decoded["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * prompt_tokens
    hits = _metric(await _metrics(decoder.url), "vllm:external_prefix_cache_hits_total")
    assert hits >= 0.9 * prompt_tokens


def _ctx(
    prefiller: Child, decoder: Child, name: str, prefill_engine: str | None
) -> TransferContext:
    return TransferContext(
        request_id=f"req-{name}",
        transfer_id=f"xfer-{name}",
        prefiller=_peer(prefiller, prefill_engine),
        decoder=_peer(decoder, "decode"),
    )


CASES: list[tuple[str, LegOrder, bool]] = [
    # (connector spec, expected order, whether the context names the prefiller's engine)
    ("nixl", LegOrder.SEQUENTIAL, True),
    ("nixl-push", LegOrder.SEQUENTIAL, False),
    ("nixl-push", LegOrder.TOGETHER, True),
    ("mooncake", LegOrder.TOGETHER, False),
    ("moriio", LegOrder.TOGETHER, True),
    ("offloading", LegOrder.SEQUENTIAL, True),
    ("lmcache", LegOrder.SEQUENTIAL, True),
    ("example", LegOrder.SEQUENTIAL, True),
    ("multi:nixl,example", LegOrder.SEQUENTIAL, True),
    ("multi:lmcache,offloading", LegOrder.SEQUENTIAL, True),
]


@pytest.mark.parametrize(("spec", "order", "engine_known"), CASES, ids=lambda v: str(v))
async def test_hand_over_through_each_connector(
    sim_factory: SimFactory,
    reference: Child,
    tmp_path: Path,
    spec: str,
    order: LegOrder,
    engine_known: bool,
) -> None:
    common = ("--profile", "instant", "--kv-connector", spec, "--kv-shared-dir", str(tmp_path))
    common += ("--lmcache-chunk-size", "16")
    prefiller = sim_factory(*common, "--engine-id", "prefill", name="prefill")
    decoder = sim_factory(*common, "--engine-id", "decode", name="decode")
    connector = get_connector(spec)
    ctx = _ctx(
        prefiller,
        decoder,
        spec.replace(":", "-").replace(",", "-"),
        "prefill" if engine_known else None,
    )

    async with httpx.AsyncClient(timeout=30) as client:
        cold = await _post(client, decoder.url, BODY | {"cache_hit_threshold": 0.9}, {})
    assert cold["choices"][0]["finish_reason"] == "cache_threshold"  # nothing cached yet

    decoded, outcome, ran = await hand_over(
        connector, ctx, prefiller, decoder, BODY | {"cache_hit_threshold": 0.9}
    )
    assert ran is order
    await _check(decoded, decoder, reference)
    if spec == "nixl-push" and not engine_known:
        assert outcome.learned is not None and outcome.learned.engine_id == "prefill"


async def test_push_registration_waits_for_a_prefill_that_has_not_finished(
    sim_factory: SimFactory, reference: Child
) -> None:
    """The decoder registers first; the prefiller writes when its prefill finishes."""
    common = ("--kv-connector", "nixl-push", "--model", MODEL)
    prefiller = sim_factory("--profile", "h200-llama3-8b", *common, "--engine-id", "prefill")
    decoder = sim_factory("--profile", "instant", *common, "--engine-id", "decode")
    connector = get_connector("nixl-push")
    ctx = _ctx(prefiller, decoder, "early", "prefill")
    headers = connector.headers(Leg.DECODE, ctx)
    body = BODY | {"cache_hit_threshold": 0.9}
    async with httpx.AsyncClient(timeout=30) as client:
        answers: dict[str, dict[str, Any]] = {}

        async def decode() -> None:
            answers["decode"] = await _post(
                client,
                decoder.url,
                connector.decode_body(body, connector.ahead_params(ctx), ctx),
                headers,
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(decode)
            await anyio.sleep(0.2)  # the registration is waiting before the prefill starts
            await _post(client, prefiller.url, connector.prefill_body(body, ctx), headers)
    await _check(answers["decode"], decoder, reference)


async def test_mooncake_decoder_fails_for_an_engine_the_bootstrap_does_not_know(
    sim_factory: SimFactory,
) -> None:
    common = ("--profile", "instant", "--kv-connector", "mooncake")
    prefiller = sim_factory(*common, "--engine-id", "prefill")
    decoder = sim_factory(*common, "--engine-id", "decode")
    connector = get_connector("mooncake")
    ctx = _ctx(prefiller, decoder, "wrong", "not-the-prefiller")
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(
            decoder.url + "/v1/completions",
            json=connector.decode_body(BODY, connector.ahead_params(ctx), ctx),
        )
    assert response.status_code == 500
    assert "not found at bootstrap" in response.json()["error"]["message"]


async def test_offloading_prefill_pulls_a_cached_prefix_from_a_kv_source(
    sim_factory: SimFactory,
) -> None:
    """``remote_kv_source``: the prefiller loads what a third instance has cached."""
    common = ("--profile", "instant", "--kv-connector", "offloading")
    source = sim_factory(*common, name="source")
    prefiller = sim_factory(*common, name="prefill")
    decoder = sim_factory(*common, name="decode")
    async with httpx.AsyncClient(timeout=30) as client:
        await _post(client, source.url, BODY | {"max_tokens": 1}, {})  # warms its prefix cache
        connector = get_connector("offloading")
        ctx = TransferContext(
            request_id="req-src",
            transfer_id="xfer-src",
            prefiller=_peer(prefiller, None),
            decoder=_peer(decoder, None),
            kv_source=_peer(source, None),
        )
        prefill = await _post(client, prefiller.url, connector.prefill_body(BODY, ctx), {})
    assert prefill["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    hits = _metric(await _metrics(prefiller.url), "vllm:external_prefix_cache_hits_total")
    assert hits > 0
