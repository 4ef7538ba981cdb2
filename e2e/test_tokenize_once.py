"""Ask-all's token-id fan-out against a target pair: the prompt tokenized once, every
leg of the original prompt sent as token ids on ``/v1/completions``, the client's
answer identical to the text route's (greedy), on both APIs, streamed and whole."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from targets import Target, gateway_for, metric, warm_up
from test_gateway_pd import _text_of

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def by_ids(target: Target, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway in ask-all mode that tokenizes once from one asked decoder."""
    overrides = {"mode": "ask-all", "ask_all": {"width": "all", "tokenize_from": 1}}
    with gateway_for(target, tmp_path_factory.mktemp("by-ids"), **overrides) as child:
        warm_up(child.url, target)
        yield child.url


def _answer(gateway: str, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """Text, token ids, finish, usage, decision, and the shape of the answer."""
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    with httpx.Client(timeout=300) as client:
        if not body.get("stream"):
            response = client.post(f"{gateway}{path}", json=body)
            assert response.status_code == 200, response.text
            data = response.json()
            choice = data["choices"][0]
            text = choice["text"] if kind == "completion" else choice["message"]["content"]
            return {
                "decision": response.headers["x-pd-decision"], "text": text,
                "ids": choice["token_ids"], "finish": choice["finish_reason"],
                "usage": data["usage"], "object": {data["object"]},
                "id": {data["id"].split("-")[0]}, "roles": int(kind == "chat"),
            }  # fmt: skip
        response = client.post(f"{gateway}{path}", json=body)
    assert response.status_code == 200, response.text
    events = [e[6:] for e in response.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    out: dict[str, Any] = {"decision": response.headers["x-pd-decision"], "text": "", "ids": [],
                           "object": set(), "id": set(), "roles": 0}  # fmt: skip
    for chunk in map(json.loads, events[:-1]):
        assert "error" not in chunk, chunk
        out["object"].add(chunk["object"])
        out["id"].add(chunk["id"].split("-")[0])
        if chunk.get("usage"):
            out["usage"] = chunk["usage"]
        for choice in chunk["choices"]:
            delta = choice.get("delta", {})
            out["roles"] += "role" in delta
            out["text"] += (
                choice.get("text") if kind == "completion" else delta.get("content")
            ) or ""
            out["ids"] += choice.get("token_ids") or []
            out["finish"] = choice.get("finish_reason") or out.get("finish")
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_token_id_fan_out_answers_as_the_text_route(
    target: Target, gateway: str, by_ids: str, kind: str, stream: bool
) -> None:
    text = _text_of(target.reference, target.model, 120, uuid.uuid4().hex)
    body: dict[str, Any] = {"model": target.model, "max_tokens": 12, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    tokenized = metric(by_ids, "pd_orchestrator_ask_all_prompts_total", form="tokenized")
    legs = metric(by_ids, "pd_orchestrator_upstream_requests_total", phase="tokenize")
    first = _answer(by_ids, kind, body)  # cold: rejected as ids, then P/D as ids
    assert first["decision"] == "pd"
    assert metric(by_ids, "pd_orchestrator_ask_all_prompts_total", form="tokenized") == (
        tokenized + 1
    )
    assert metric(by_ids, "pd_orchestrator_upstream_requests_total", phase="tokenize") == legs + 1
    second = _answer(gateway, kind, body)  # the text route, warm now on the decoder
    assert second["decision"] == "decode"
    assert first["ids"] == second["ids"] and len(first["ids"]) == 12
    for name in ("text", "finish", "object", "id", "roles"):
        assert first[name] == second[name], name
    for name in ("prompt_tokens", "completion_tokens"):
        assert first["usage"][name] == second["usage"][name], name
