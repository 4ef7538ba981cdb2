"""Preempted requests handed back mid-generation, and broken decode legs recovered."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
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


async def _load_read(gateway: str, decoder: str = "decode-0") -> dict[str, Any]:
    """``decoder``'s load in the gateway's ``/status``, once the gateway has read it."""
    async with httpx.AsyncClient(base_url=gateway, timeout=10) as client:
        with anyio.fail_after(20):
            while True:
                status = (await client.get("/status")).json()
                [entry] = [e for e in status["endpoints"] if e["name"] == decoder]
                if entry["load"] is not None:
                    return dict(entry["load"])
                await anyio.sleep(0.1)


LONG_ARGUMENTS = {
    "type": "object",
    "properties": {"ids": {"type": "array", "items": {"type": "integer", "minimum": 10,
                                                      "maximum": 99},
                           "minItems": 60, "maxItems": 60}},
    "required": ["ids"],
}  # fmt: skip
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
          "minItems": 60, "maxItems": 60}  # fmt: skip
"""121 tokens of JSON (the simulator's), within ``OUTPUT``: enough to preempt."""
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": LONG_ARGUMENTS}}]
"""A tool whose call (the simulator answers ``auto`` with calls or text) runs past
``OUTPUT`` tokens as text with ``ignore_eos`` does."""


async def test_constrained_requests_go_admission_only_and_are_never_handed_back(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    """Tools (or structured output, or logprobs) go with the policy's threshold at
    admission only: a cold one goes P/D, a warm one is admitted, and a preempted one
    is recomputed by its decoder (never handed back), its answer still the reference's."""
    decoder = _pressured_decoder(sim_factory)
    prefiller = sim_factory("--profile", "instant", "--kv-connector", "nixl", name="prefill")
    reference = sim_factory("--profile", "instant", name="reference")
    config = gateway_config([decoder], [prefiller], threshold={"policy": {"value": 0.6}})
    gateway = gateway_factory(config)
    assert (await _load_read(gateway.url))["admission_only"] is True
    for i in range(len(PROMPTS)):  # cold: rejected at admission, then P/D
        cold = _body("chat", i, False) | {"tools": TOOLS, "max_tokens": 1}
        assert (await call(gateway.url, "chat", cold)).decision == "pd"
    answers: list[Answer | None] = [None] * len(PROMPTS)

    async def one(i: int) -> None:
        answers[i] = await call(gateway.url, "chat", _body("chat", i, True) | {"tools": TOOLS})

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    for i, answer in enumerate(answers):
        assert answer is not None and answer.status == 200 and answer.decision == "decode"
        expected = await call(reference.url, "chat", _body("chat", i, False) | {"tools": TOOLS})
        assert answer.token_ids == expected.token_ids
    text = await metrics_text(gateway.url)
    assert metric(text, "pd_orchestrator_handbacks_total") == 0
    assert metric(
        text, "pd_orchestrator_constrained_requests_total", threshold="admission-only"
    ) == (2 * len(PROMPTS))
    decoder_text = await metrics_text(decoder.url)
    assert metric(decoder_text, "vllm:num_preemptions_total") >= 1
    assert metric(decoder_text, "vllm:cache_threshold_rejections_total", phase="preemption") == 0


@pytest.mark.parametrize(
    ("kind", "stream"), [("chat", True), ("completion", False)], ids=["chat-stream", "whole"]
)
async def test_a_preempted_structured_output_is_handed_back_and_continued(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, kind: str, stream: bool
) -> None:
    """A structured output on decoders that resume grammars goes with the policy's
    threshold and no admission-only: preempted, it is handed back and continued (the
    continuation carries its format and the resume count; the simulated plugin checks
    the count against the prompt), its answer still the reference's."""
    decoder = _pressured_decoder(sim_factory)
    prefiller = sim_factory("--profile", "instant", "--kv-connector", "nixl", name="prefill")
    reference = sim_factory("--profile", "instant", name="reference")
    config = gateway_config([decoder], [prefiller], threshold={"policy": {"value": 0.6}})
    gateway = gateway_factory(config)
    load = await _load_read(gateway.url)
    assert load["admission_only"] is True and load["resumes"] is True
    structured = {"structured_outputs": {"json": DIGITS}}
    await _warm(gateway.url, kind)
    answers: list[Answer | None] = [None] * len(PROMPTS)

    async def one(i: int) -> None:
        answers[i] = await call(gateway.url, kind, _body(kind, i, stream) | structured)

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    for i, answer in enumerate(answers):
        assert answer is not None and answer.status == 200, answer
        expected = await call(reference.url, kind, _body(kind, i, False) | structured)
        assert answer.token_ids == expected.token_ids and answer.text == expected.text
        digits = json.loads(answer.text)  # one document across the legs
        assert len(digits) == 60 and all(0 <= d <= 9 for d in digits)
    text = await metrics_text(gateway.url)
    assert metric(text, "pd_orchestrator_handbacks_total") >= 1
    resumable = metric(text, "pd_orchestrator_constrained_requests_total", threshold="resumable")
    assert resumable == len(PROMPTS)
    decoder_text = await metrics_text(decoder.url)
    assert metric(decoder_text, "vllm:cache_threshold_rejections_total", phase="preemption") >= 1


async def test_a_client_cannot_set_the_resume_count(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    """Only the gateway says which prompt tokens are output a grammar is advanced over:
    a client's count would walk its own constraint past what it allows."""
    nixl = ("--profile", "instant", "--kv-connector", "nixl")
    decoder, prefiller = sim_factory(*nixl, name="decoder"), sim_factory(*nixl, name="prefill")
    gateway = gateway_factory(gateway_config([decoder], [prefiller]))
    body = {"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"}}
    refused = await call(gateway.url, "completion", body | {"cache_hit_resume_tokens": 1})
    assert refused.status == 400 and refused.body is not None
    assert refused.body["error"]["param"] == "cache_hit_resume_tokens"
    xargs = {"vllm_xargs": {"cache_hit_resume_tokens": 1}}
    refused = await call(gateway.url, "completion", body | xargs)
    assert refused.status == 400 and refused.body is not None
    assert refused.body["error"]["param"] == "vllm_xargs.cache_hit_resume_tokens"
    direct = await call(decoder.url, "completion", body | {"cache_hit_resume_tokens": 5})
    assert direct.status == 400  # more than the prompt's tokens


async def test_an_older_plugin_gets_constrained_requests_with_threshold_zero(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    nixl = ("--profile", "instant", "--kv-connector", "nixl")
    older = sim_factory(*nixl, "--no-admission-only", name="older")
    prefiller = sim_factory(*nixl, name="prefill")
    config = gateway_config([older], [prefiller], threshold={"policy": {"value": 0.6}})
    gateway = gateway_factory(config)
    assert (await _load_read(gateway.url))["admission_only"] is False
    for i in range(2):
        body = _body("chat", i, False) | {"tools": TOOLS, "max_tokens": 4}
        answer = await call(gateway.url, "chat", body)
        assert answer.status == 200 and answer.decision == "decode"  # cold, yet admitted
    text = await metrics_text(gateway.url)
    assert metric(text, "pd_orchestrator_constrained_requests_total", threshold="zero") == 2
    assert metric(text, "pd_orchestrator_threshold_decisions_total", reason="not-continuable") == 2
    log = gateway.log_path.read_text()
    assert log.count("decoder decode-0 does not take cache_hit_admission_only") == 1
    refused = await call(gateway.url, "chat", body | {"cache_hit_admission_only": False})
    assert refused.status == 400 and refused.body is not None
    assert refused.body["error"]["param"] == "cache_hit_admission_only"
    xargs = {"vllm_xargs": {"cache_hit_admission_only": True}}
    refused = await call(gateway.url, "completion", {"model": MODEL, "prompt": "x"} | xargs)
    assert refused.status == 400 and refused.body is not None
    assert refused.body["error"]["param"] == "vllm_xargs.cache_hit_admission_only"


def _flaky_fleet(sims: SimFactory) -> tuple[list[Child], Child, Child]:
    """Two decoders that drop every stream after 5 tokens, a prefiller, a reference."""
    nixl = ("--profile", "instant", "--kv-connector", "nixl")
    flaky = [sims(*nixl, "--drop-after-tokens", "5", name=f"flaky-{i}") for i in range(2)]
    return flaky, sims(*nixl, name="prefill"), sims("--profile", "instant", name="reference")


BROKEN = 8
"""Tokens of an answer that breaks after 5: 3 more come from the recovery."""


@pytest.mark.parametrize("n", [1, 2], ids=["one-choice", "two-choices"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
async def test_the_usage_of_a_recovered_answer_counts_each_token_once(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, kind: str, stream: bool, n: int
) -> None:
    """Each choice breaks after 5 tokens and goes on on the other decoder: the usage
    counts the 8 tokens of each choice the client got, those of the broken leg too.
    (A client that wants a whole answer gets streamed legs in ask-all mode.)"""
    flaky, prefiller, reference = _flaky_fleet(sim_factory)
    mode = "decode-first" if stream else "ask-all"
    gateway = gateway_factory(gateway_config(flaky, [prefiller], mode=mode))
    body = _body(kind, 0, stream) | {"max_tokens": BROKEN, "n": n}
    if stream:
        body["stream_options"] = {"include_usage": True}
    answer = await call(gateway.url, kind, body)
    expected = await call(reference.url, kind, _body(kind, 0, False) | {"max_tokens": BROKEN})
    assert answer.status == 200, answer.body
    if stream:
        tokens = len(answer.token_ids)
    else:
        assert answer.body is not None
        tokens = sum(len(choice["token_ids"]) for choice in answer.body["choices"])
    if n == 1:
        assert answer.token_ids == expected.token_ids
    assert tokens == BROKEN * n
    assert answer.usage is not None and expected.usage is not None
    assert answer.usage["completion_tokens"] == BROKEN * n
    assert answer.usage["prompt_tokens"] == expected.usage["prompt_tokens"]
    text = await metrics_text(gateway.url)
    assert metric(text, "pd_orchestrator_upstream_errors_total", kind="recovered") == n


async def test_a_recovery_may_go_to_a_decoder_a_break_took_out_of_routing(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    """The first request breaks on one decoder (out of routing until its next health
    check) and is recovered on the other; the second, planned on the other alone,
    breaks there too: it is recovered on the first, which only a break took out."""
    flaky, prefiller, reference = _flaky_fleet(sim_factory)
    config = gateway_config(flaky, [prefiller], health={"interval": 600.0})
    gateway = gateway_factory(config)  # health checked once, at the start
    for i in range(2):
        body = _body("completion", i, True) | {"max_tokens": BROKEN}
        answer = await call(gateway.url, "completion", body)
        expected = await call(reference.url, "completion", body | {"stream": False})
        assert answer.status == 200 and answer.body is None, answer.body
        assert answer.token_ids == expected.token_ids
        if i == 0:
            async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:
                status = (await client.get("/status")).json()
            out = [e["name"] for e in status["endpoints"] if not e["healthy"]]
            assert len(out) == 1  # the first decoder it broke on
    text = await metrics_text(gateway.url)
    assert metric(text, "pd_orchestrator_upstream_errors_total", kind="recovered") == 2
