"""``n`` > 1 through the gateway: each choice its own generation, one answer."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import orjson
import pytest

from ..conftest import GatewayFactory, SimFactory, gateway_config
from .helpers import MODEL, call, metric, metrics_text

pytestmark = pytest.mark.anyio
INSTANT = ("--profile", "instant", "--kv-connector", "nixl")


def _body(kind: str, prompt: str, **extra: Any) -> dict[str, Any]:
    common = {"model": MODEL, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
    if kind == "completion":
        return common | {"prompt": prompt} | extra
    return common | {"messages": [{"role": "user", "content": prompt}]} | extra


async def _streamed_choices(url: str, kind: str, body: dict[str, Any]) -> tuple[
    dict[int, list[int]], list[dict[str, Any]], int
]:  # fmt: skip
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        response = await client.post(path, json=body | {"stream": True})
        assert response.status_code == 200, response.text
    events = [e[6:] for e in response.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [orjson.loads(e) for e in events[:-1]]
    ids: dict[int, list[int]] = {}
    roles = 0
    for chunk in chunks:
        for choice in chunk["choices"]:
            ids.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
            roles += (choice.get("delta") or {}).get("role") == "assistant"
    return ids, chunks, roles


@pytest.mark.parametrize("kind", ["completion", "chat"])
async def test_n_choices_are_each_a_generation_of_one_answer(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, kind: str
) -> None:
    decoder, prefiller = sim_factory(*INSTANT), sim_factory(*INSTANT)
    reference = sim_factory("--profile", "instant")
    gateway = gateway_factory(
        gateway_config([decoder], [prefiller], threshold={"policy": {"value": 0.5}})
    )
    prompt = f"{uuid.uuid4().hex} " + "a prompt long enough for several cache blocks. " * 4
    expected = (await call(reference.url, kind, _body(kind, prompt))).token_ids

    whole = await call(gateway.url, kind, _body(kind, prompt, n=3))
    assert whole.status == 200 and whole.decision == "pd"
    assert whole.body is not None
    choices = whole.body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert all(c["token_ids"] == expected for c in choices)
    assert whole.body["usage"]["completion_tokens"] == 18
    # choice 0 prefilled the prompt; the other two found it on the decoder
    assert metric(await metrics_text(prefiller.url), "vllm:request_success_total") == 1

    body = _body(kind, prompt, n=3, stream_options={"include_usage": True})
    ids, chunks, roles = await _streamed_choices(gateway.url, kind, body)
    assert ids == {0: expected, 1: expected, 2: expected}
    assert len({chunk["id"] for chunk in chunks}) == 1  # one answer
    assert chunks[-1]["usage"]["completion_tokens"] == 18
    assert roles == (3 if kind == "chat" else 0)  # one role chunk per choice


async def test_too_many_choices_is_a_400(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    decoder, prefiller = sim_factory(*INSTANT), sim_factory(*INSTANT)
    gateway = gateway_factory(gateway_config([decoder], [prefiller]))
    answer = await call(gateway.url, "completion", _body("completion", "hi", n=17))
    assert answer.status == 400 and answer.body is not None
    assert answer.body["error"]["param"] == "n"
