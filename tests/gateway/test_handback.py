"""Preempted requests handed back mid-generation, and broken decode legs recovered."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory, gateway_config
from .helpers import MODEL, Answer, call, metric, metrics_text

pytestmark = pytest.mark.anyio

PROMPTS = [
    f"conversation {i}: " + "the history so far is long and detailed. " * 5 for i in range(4)
]
OUTPUT = 150


def _pressured_decoder(sims: SimFactory) -> Child:
    # 64 blocks of 16 tokens: four 220-token prompts plus 150 outputs each do not fit.
    return sims(
        "--profile", "h200-llama3-8b", "--model", MODEL, "--time-scale", "0.3",
        "--kv-connector", "nixl",
        "--num-kv-blocks", "64", "--max-num-seqs", "8", name="decoder",
    )  # fmt: skip


def _body(kind: str, index: int, stream: bool) -> dict[str, Any]:
    common = {"model": MODEL, "max_tokens": OUTPUT, "ignore_eos": True, "stream": stream}
    common["return_token_ids"] = True
    if kind == "completion":
        return common | {"prompt": PROMPTS[index]}
    return common | {"messages": [{"role": "user", "content": PROMPTS[index]}]}


async def _concurrently(url: str, kind: str, stream: bool) -> list[Answer]:
    answers: list[Answer | None] = [None] * len(PROMPTS)

    async def one(i: int) -> None:
        answers[i] = await call(url, kind, _body(kind, i, stream))

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    return [a for a in answers if a is not None]


async def _warm(url: str, kind: str) -> None:
    for i in range(len(PROMPTS)):
        warm = await call(url, kind, _body(kind, i, False) | {"max_tokens": 1})
        assert warm.status == 200


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_preempted_requests_are_handed_back_seamlessly(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, kind: str, stream: bool
) -> None:
    decoder = _pressured_decoder(sim_factory)
    prefiller = sim_factory("--profile", "instant", "--kv-connector", "nixl", name="prefill")
    reference = sim_factory("--profile", "instant", name="reference")
    config = gateway_config([decoder], [prefiller], threshold={"policy": {"value": 0.6}})
    gateway = gateway_factory(config)

    await _warm(gateway.url, kind)  # the decoder now holds every prompt: attempts are admitted
    answers = await _concurrently(gateway.url, kind, stream)
    references = [
        await call(reference.url, kind, _body(kind, i, False)) for i in range(len(PROMPTS))
    ]
    for answer, expected in zip(answers, references, strict=True):
        assert answer.status == 200, answer.body
        assert answer.decision == "decode"
        assert answer.token_ids == expected.token_ids
        assert answer.text == expected.text
        assert answer.finish_reason == "length"
    gateway_metrics = await metrics_text(gateway.url)
    decoder_metrics = await metrics_text(decoder.url)
    handbacks = metric(gateway_metrics, "pd_orchestrator_handbacks_total")
    assert handbacks >= 1
    assert metric(decoder_metrics, "vllm:cache_threshold_rejections_total", phase="preemption") == (
        handbacks
    )
    if not stream:
        assert sum(int(a.headers["x-pd-handbacks"]) for a in answers) == handbacks


async def test_after_max_handbacks_the_decoder_continues_locally(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    decoder = _pressured_decoder(sim_factory)
    prefiller = sim_factory("--profile", "instant", "--kv-connector", "nixl", name="prefill")
    reference = sim_factory("--profile", "instant", name="reference")
    config = gateway_config(
        [decoder],
        [prefiller],
        threshold={"policy": {"value": 0.6}},
        handback={"max_handbacks": 0},
    )
    gateway = gateway_factory(config)
    await _warm(gateway.url, "completion")
    prefills_before = metric(await metrics_text(prefiller.url), "vllm:prompt_tokens_total")
    answers = await _concurrently(gateway.url, "completion", True)
    for i, answer in enumerate(answers):
        expected = await call(reference.url, "completion", _body("completion", i, False))
        assert answer.token_ids == expected.token_ids
    assert metric(await metrics_text(gateway.url), "pd_orchestrator_handbacks_total") >= 1
    # no continuation went through the prefiller: it saw only the warm-up prompts
    assert metric(await metrics_text(prefiller.url), "vllm:prompt_tokens_total") == prefills_before


async def test_a_decode_leg_that_breaks_mid_stream_is_continued_elsewhere(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    nixl = ("--profile", "instant", "--kv-connector", "nixl")
    flaky = sim_factory(*nixl, "--drop-after-tokens", "5", name="flaky")
    steady = sim_factory(*nixl, name="steady")
    prefiller = sim_factory(*nixl, name="prefill")
    reference = sim_factory("--profile", "instant", name="reference")
    gateway = gateway_factory(gateway_config([flaky, steady], [prefiller]))
    for i in range(4):  # affinity spreads prompts; at least one starts on the flaky decoder
        body = _body("completion", i, True) | {"max_tokens": 20}
        answer = await call(gateway.url, "completion", body)
        expected = await call(reference.url, "completion", body | {"stream": False})
        assert answer.status == 200 and answer.body is None
        assert answer.token_ids == expected.token_ids
    text = await metrics_text(gateway.url)
    assert metric(text, "pd_orchestrator_upstream_errors_total", kind="recovered") >= 1


async def test_requests_a_continuation_cannot_honour_are_not_handed_back(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    """Tools (or structured output, or logprobs) go with threshold 0: a preempted one
    is recomputed by its decoder, and its answer is still the reference's."""
    decoder = _pressured_decoder(sim_factory)
    prefiller = sim_factory("--profile", "instant", "--kv-connector", "nixl", name="prefill")
    reference = sim_factory("--profile", "instant", name="reference")
    config = gateway_config([decoder], [prefiller], threshold={"policy": {"value": 0.6}})
    gateway = gateway_factory(config)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    answers: list[Answer | None] = [None] * len(PROMPTS)

    async def one(i: int) -> None:
        answers[i] = await call(gateway.url, "chat", _body("chat", i, True) | {"tools": tools})

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    for i, answer in enumerate(answers):
        assert answer is not None and answer.status == 200 and answer.decision == "decode"
        expected = await call(reference.url, "chat", _body("chat", i, False))
        assert answer.token_ids == expected.token_ids
    assert metric(await metrics_text(gateway.url), "pd_orchestrator_handbacks_total") == 0
    assert metric(await metrics_text(decoder.url), "vllm:num_preemptions_total") >= 1
