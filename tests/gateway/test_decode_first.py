"""The decode-first flow end to end: simulators and the gateway as real processes."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory, gateway_config
from .helpers import MODEL, Answer, call, metric, metrics_text

pytestmark = pytest.mark.anyio


class Stack:
    def __init__(self, gateway: Child, decoders: list[Child], prefiller: Child, reference: Child):
        self.gateway = gateway
        self.decoders = decoders
        self.prefiller = prefiller
        self.reference = reference

    @property
    def url(self) -> str:
        return self.gateway.url


@pytest.fixture(scope="module")
def stack(module_sims: SimFactory, module_gateways: GatewayFactory) -> Stack:
    sim = ("--profile", "instant", "--kv-connector", "nixl")
    decoders = [module_sims(*sim, name=f"decode-{i}") for i in range(2)]
    prefiller = module_sims(*sim, name="prefill")
    reference = module_sims("--profile", "instant", name="reference")
    # No load scorers: every decoder ties and the prompt's affinity key picks one, so a
    # repeated prompt finds its warm decoder whatever load a scrape happened to catch.
    routing = {"decode": {"scorers": []}}
    config = gateway_config(
        decoders, [prefiller], threshold={"policy": {"value": 0.5}}, routing=routing
    )
    return Stack(module_gateways(config), decoders, prefiller, reference)


def _prompt(tag: str = "") -> str:
    return f"{tag}{uuid.uuid4().hex} " + "a long enough prompt for several blocks. " * 4


def _completion(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 12, "ignore_eos": True} | extra


async def _reference(stack: Stack, kind: str, body: dict[str, Any]) -> Answer:
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return await call(stack.reference.url, kind, plain | {"return_token_ids": True})


async def test_cold_prompt_goes_pd_then_the_same_prompt_is_decoded(stack: Stack) -> None:
    body = _completion(_prompt())
    first = await call(stack.url, "completion", body)
    second = await call(stack.url, "completion", body)
    assert first.status == 200 and first.decision == "pd"
    assert first.headers["x-pd-prefiller"] == "prefill-0"
    assert second.decision == "decode" and "x-pd-prefiller" not in second.headers
    assert second.headers["x-pd-decoder"] == first.headers["x-pd-decoder"]
    assert first.text == second.text == (await _reference(stack, "completion", body)).text


async def test_second_turn_of_a_conversation_is_admitted(stack: Stack) -> None:
    messages = [
        {"role": "system", "content": "You are terse. " * 30},
        {"role": "user", "content": f"Tell me about {uuid.uuid4().hex}."},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "ignore_eos": True}
    turn1 = await call(stack.url, "chat", body)
    assert turn1.decision == "pd"
    messages += [{"role": "assistant", "content": turn1.text}, {"role": "user", "content": "Why?"}]
    turn2 = await call(stack.url, "chat", body | {"messages": messages})
    assert turn2.decision == "decode"
    assert turn2.headers["x-pd-decoder"] == turn1.headers["x-pd-decoder"]
    assert turn2.usage is not None and turn2.usage["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("warm", [False, True], ids=["cold-pd", "warm-decode"])
async def test_answers_are_identical_whichever_path_served_them(
    stack: Stack, kind: str, stream: bool, warm: bool
) -> None:
    if kind == "completion":
        body = _completion(_prompt(), return_token_ids=True)
    else:
        content = _prompt()
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
        body |= {"max_tokens": 12, "ignore_eos": True, "return_token_ids": True}
    if warm:
        await call(stack.url, kind, body | {"max_tokens": 1})
    body |= {"stream": stream}
    answer = await call(stack.url, kind, body)
    expected = await _reference(stack, kind, body)
    assert answer.status == 200
    assert answer.decision == ("decode" if warm else "pd")
    assert answer.text == expected.text
    assert answer.token_ids == expected.token_ids and len(answer.token_ids) == 12
    assert answer.finish_reason == "length"


async def test_token_ids_are_stripped_unless_asked(stack: Stack) -> None:
    whole = await call(stack.url, "completion", _completion(_prompt()))
    assert whole.body is not None
    assert "token_ids" not in whole.body["choices"][0]
    assert "prompt_token_ids" not in whole.body["choices"][0]
    chat = await call(
        stack.url,
        "chat",
        {"model": MODEL, "messages": [{"role": "user", "content": _prompt()}], "stream": True},
    )
    assert all("prompt_token_ids" not in c for c in chat.chunks)
    assert all("token_ids" not in ch for c in chat.chunks for ch in c.get("choices", []))


async def test_stream_shape_role_chunk_usage_and_one_id(stack: Stack) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": _prompt()}],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer = await call(stack.url, "chat", body)
    assert answer.decision == "pd"
    assert answer.chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    roles = [c for c in answer.chunks if c.get("choices") and "role" in c["choices"][0]["delta"]]
    assert len(roles) == 1
    assert len({c["id"] for c in answer.chunks}) == 1
    usage_chunks = [c for c in answer.chunks if c.get("usage")]
    assert len(usage_chunks) == 1 and answer.chunks[-1] is usage_chunks[0]
    assert answer.usage is not None and answer.usage["completion_tokens"] == 5


async def test_usage_counts_what_the_prefill_side_provided(stack: Stack) -> None:
    answer = await call(stack.url, "completion", _completion(_prompt()))
    assert answer.decision == "pd" and answer.usage is not None
    prompt_tokens = answer.usage["prompt_tokens"]
    assert answer.usage["prompt_tokens_details"]["cached_tokens"] == prompt_tokens - 1
    assert answer.usage["completion_tokens"] == 12


async def test_official_openai_client(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    try:
        prompt = _prompt()
        # ignore_eos: without it a prompt whose first sampled token is EOS answers empty
        whole = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True}
        )
        pieces = []
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=8,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
    finally:
        await client.close()
    assert whole.choices[0].text and whole.usage is not None
    assert whole.usage.completion_tokens == 8
    assert "".join(pieces)


@pytest.mark.parametrize(
    ("content", "status", "fragment"),
    [
        (b"{not json", 400, "malformed JSON"),
        (b'{"prompt": "x"}', 400, "model"),
        (b'{"model": "sim-model", "prompt": "x", "max_tokens": -1}', 400, "max_tokens"),
        (b'{"model": "other", "prompt": "x"}', 404, "does not exist"),
        (  # the upstream's refusal, in the gateway's words
            b'{"model": "sim-model", "prompt": "x", "max_tokens": 2, "min_tokens": 5}',
            400,
            "refused the request during decode_attempt (HTTP 400)",
        ),
    ],
    ids=["malformed", "missing-model", "negative-max-tokens", "unknown-model", "upstream-400"],
)
async def test_bad_input_gets_a_4xx_in_vllm_shape(
    stack: Stack, content: bytes, status: int, fragment: str
) -> None:
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
        response = await client.post("/v1/completions", content=content)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == status and fragment in error["message"]


async def test_models_ready_health_and_metrics(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
        models = (await client.get("/v1/models")).json()
        ready = await client.get("/ready")
        health = await client.get("/health")
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert ready.status_code == 200 and health.status_code == 200
    await call(stack.url, "completion", _completion(_prompt()))
    text = await metrics_text(stack.url)
    assert metric(text, "pd_orchestrator_decisions_total", decision="pd") >= 1
    assert metric(text, "pd_orchestrator_requests_total", route="/v1/completions") >= 1
    assert metric(text, "pd_orchestrator_phase_seconds_count", phase="prefill") >= 1
    assert metric(text, "pd_orchestrator_ttft_seconds_count") >= 1
