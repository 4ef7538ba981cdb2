"""Ask-all over four simulated decoders in two pools (H200 and MI325X groups)."""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import httpx
import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory
from .helpers import MODEL, call, metric, metrics_text

pytestmark = pytest.mark.anyio
GROUP = {
    "hd0": "nvidia",
    "hd1": "nvidia",
    "hp0": "nvidia",
    "ad0": "amd",
    "ad1": "amd",
    "ap0": "amd",
}


class Fleet:
    def __init__(self, sims: dict[str, Child]) -> None:
        self.sims = sims

    def config(self, **ask_all: Any) -> dict[str, Any]:
        def pool(name: str, role: str, group: str, hardware: str, *members: str) -> dict[str, Any]:
            endpoints = [{"name": m, "url": self.sims[m].url} for m in members]
            return {
                "name": name,
                "role": role,
                "group": group,
                "hardware": hardware,
                "model": MODEL,
                "endpoints": endpoints,
            }

        return {
            "mode": "ask-all",
            "ask_all": ask_all,
            "pools": [
                pool("h200-decode", "decode", "nvidia", "h200", "hd0", "hd1"),
                pool("h200-prefill", "prefill", "nvidia", "h200", "hp0"),
                pool("mi325x-decode", "decode", "amd", "mi325x", "ad0", "ad1"),
                pool("mi325x-prefill", "prefill", "amd", "mi325x", "ap0"),
            ],
            "threshold": {"policy": {"value": 0.5}},
            "health": {"interval": 0.5},
            "load": {"interval": 0.2, "stale_after": 1.0},
        }


@pytest.fixture(scope="module")
def fleet(module_sims: SimFactory) -> Fleet:
    decoder = ("--profile", "h200-llama3-8b", "--model", MODEL, "--kv-connector", "nixl")
    prefiller = ("--profile", "instant", "--model", MODEL, "--kv-connector", "nixl")
    sims = {name: module_sims(*decoder, name=name) for name in ("hd0", "hd1", "ad0", "ad1")}
    sims |= {name: module_sims(*prefiller, name=name) for name in ("hp0", "ap0")}
    return Fleet(sims)


@pytest.fixture(scope="module")
def race(fleet: Fleet, module_gateways: GatewayFactory) -> Child:
    return module_gateways(fleet.config(), name="race")


def _chat(conversation: str, turns: list[str]) -> dict[str, Any]:
    messages = [{"role": "system", "content": f"[{conversation}] " + "be thorough. " * 20}]
    for i, text in enumerate(turns):
        messages.append({"role": "assistant" if i % 2 else "user", "content": text})
    return {"model": MODEL, "messages": messages, "max_tokens": 16, "ignore_eos": True}


async def test_turn_two_is_admitted_by_the_decoder_that_served_turn_one(race: Child) -> None:
    conversation = uuid.uuid4().hex
    turn1 = await call(race.url, "chat", _chat(conversation, ["tell me a story"]))
    assert turn1.status == 200 and turn1.decision == "pd"
    history = ["tell me a story", turn1.text, "go on"]
    turn2 = await call(race.url, "chat", _chat(conversation, history))
    assert turn2.decision == "decode"
    assert turn2.headers["x-pd-decoder"] == turn1.headers["x-pd-decoder"]
    streamed = await call(race.url, "chat", _chat(conversation, history) | {"stream": True})
    assert streamed.decision == "decode" and streamed.text == turn2.text


async def test_cold_conversations_spread_and_fall_back_to_pd_inside_one_group(
    race: Child,
) -> None:
    served = []
    for _ in range(16):
        answer = await call(race.url, "chat", _chat(uuid.uuid4().hex, ["hello"]))
        assert answer.decision == "pd"
        decoder, prefiller = answer.headers["x-pd-decoder"], answer.headers["x-pd-prefiller"]
        assert GROUP[decoder] == GROUP[prefiller]
        served.append(decoder)
    assert len(set(served)) >= 3, served
    text = await metrics_text(race.url)
    assert metric(text, "pd_orchestrator_ask_all_total", outcome="fallback_pd") >= 16
    assert metric(text, "pd_orchestrator_fanout_legs_total", outcome="rejected") >= 64


async def _running(child: Child) -> float:
    return metric(await metrics_text(child.url), "vllm:num_requests_running")


async def test_losing_legs_are_cancelled_and_the_winner_serves(fleet: Fleet, race: Child) -> None:
    prompt = f"{uuid.uuid4().hex} " + "a document both decoders have seen. " * 8
    warm = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    for name in ("hd1", "ad0"):  # two decoders of different pools hold the prefix
        assert (await call(fleet.sims[name].url, "completion", warm)).status == 200
    generated = {n: metric(await metrics_text(fleet.sims[n].url), "vllm:generation_tokens_total")
                 for n in fleet.sims}  # fmt: skip
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with (
        httpx.AsyncClient(base_url=race.url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        winner = response.headers["x-pd-decoder"]
        assert response.headers["x-pd-decision"] == "decode" and winner in ("hd1", "ad0")
        loser = "ad0" if winner == "hd1" else "hd1"
        with anyio.fail_after(5):
            while await _running(fleet.sims[loser]) > 0:  # noqa: ASYNC110 - another process
                await anyio.sleep(0.05)
        assert await _running(fleet.sims[winner]) == 1  # still generating for the client
        received = 0
        async for line in response.aiter_lines():
            received += line.startswith("data: {")
    assert received >= 400
    after = {n: metric(await metrics_text(fleet.sims[n].url), "vllm:generation_tokens_total")
             for n in fleet.sims}  # fmt: skip
    assert after[winner] - generated[winner] == 400  # x-pd-decoder served every token
    assert after[loser] - generated[loser] < 50  # the loser was stopped early
    text = await metrics_text(race.url)
    assert metric(text, "pd_orchestrator_fanout_legs_total", outcome="cancelled") >= 1


async def test_probe_variant_picks_the_decoder_with_the_most_cached_tokens(
    fleet: Fleet, gateway_factory: GatewayFactory
) -> None:
    gateway = gateway_factory(fleet.config(variant="probe"), name="probe")
    prompt = f"{uuid.uuid4().hex} " + "a shared prefix. " * 20
    short = {"model": MODEL, "prompt": prompt[: len(prompt) // 2], "max_tokens": 1}
    full = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    assert (await call(fleet.sims["hd0"].url, "completion", short)).status == 200
    assert (await call(fleet.sims["ad1"].url, "completion", full)).status == 200
    answer = await call(gateway.url, "completion", full | {"max_tokens": 8})
    assert answer.decision == "decode" and answer.headers["x-pd-decoder"] == "ad1"
    text = await metrics_text(gateway.url)
    assert metric(text, "pd_orchestrator_fanout_legs_total", outcome="admitted") >= 1


async def test_local_fallback_decodes_with_threshold_zero(
    fleet: Fleet, gateway_factory: GatewayFactory
) -> None:
    gateway = gateway_factory(fleet.config(fallback={"then": "local"}), name="local")
    before = metric(await metrics_text(fleet.sims["hp0"].url), "vllm:prompt_tokens_total")
    before += metric(await metrics_text(fleet.sims["ap0"].url), "vllm:prompt_tokens_total")
    answer = await call(gateway.url, "chat", _chat(uuid.uuid4().hex, ["cold"]))
    assert answer.status == 200 and answer.decision == "decode"
    assert "x-pd-prefiller" not in answer.headers
    after = metric(await metrics_text(fleet.sims["hp0"].url), "vllm:prompt_tokens_total")
    after += metric(await metrics_text(fleet.sims["ap0"].url), "vllm:prompt_tokens_total")
    assert after == before
    assert metric(await metrics_text(gateway.url), "pd_orchestrator_ask_all_total",
                  outcome="fallback_local") == 1  # fmt: skip


# -- adaptive width -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adaptive(fleet: Fleet, module_gateways: GatewayFactory) -> Child:
    config = fleet.config(width="adaptive", adaptive={"warmup": 0, "explore_every": 0})
    return module_gateways(config, name="adaptive")


def _count(text: str, name: str, **labels: str) -> float:
    """A counter's value; 0 before it was first counted."""
    try:
        return metric(text, name, **labels)
    except AssertionError:
        return 0.0


async def _decoders(fleet: Fleet, name: str, **labels: str) -> float:
    total = 0.0
    for decoder in ("hd0", "hd1", "ad0", "ad1"):
        total += _count(await metrics_text(fleet.sims[decoder].url), name, **labels)
    return total


async def _gateway(gateway: Child, name: str, **labels: str) -> float:
    return _count(await metrics_text(gateway.url), name, **labels)


async def test_adaptive_width_skips_cold_prompts_and_asks_the_holder_alone(
    fleet: Fleet, adaptive: Child
) -> None:
    rejections = "vllm:cache_threshold_rejections_total"
    before = await _decoders(fleet, rejections)
    conversation = uuid.uuid4().hex
    turn1 = await call(adaptive.url, "chat", _chat(conversation, ["tell me a story"]))
    assert turn1.status == 200 and turn1.decision == "pd"
    assert await _decoders(fleet, rejections) == before  # no decoder was asked
    assert await _gateway(adaptive, "pd_orchestrator_ask_all_total", outcome="skipped") >= 1
    asked = await _gateway(adaptive, "pd_orchestrator_ask_all_asked_sum")
    history = ["tell me a story", turn1.text, "go on"]
    turn2 = await call(adaptive.url, "chat", _chat(conversation, history) | {"stream": True})
    assert turn2.decision == "decode"
    assert turn2.headers["x-pd-decoder"] == turn1.headers["x-pd-decoder"]
    assert await _gateway(adaptive, "pd_orchestrator_ask_all_asked_sum") == asked + 1
    assert await _decoders(fleet, rejections) == before
    async with httpx.AsyncClient(base_url=adaptive.url, timeout=10) as client:
        status = (await client.get("/status")).json()["ask_all"]
    assert status["width"] == "adaptive"
    assert status["adaptive"]["skipped"] >= 1 and status["adaptive"]["by_reason"]["likely"] >= 1


async def test_a_stale_index_gets_a_rejection_then_pd_and_corrects_itself(
    fleet: Fleet, adaptive: Child
) -> None:
    conversation = uuid.uuid4().hex
    turn1 = await call(adaptive.url, "chat", _chat(conversation, ["tell me a story"]))
    holder = turn1.headers["x-pd-decoder"]
    async with httpx.AsyncClient(base_url=fleet.sims[holder].url, timeout=10) as client:
        assert (await client.post("/reset_prefix_cache")).status_code == 200  # as if restarted
    rejected = await _gateway(adaptive, "pd_orchestrator_fanout_legs_total", outcome="rejected")
    history = ["tell me a story", turn1.text, "go on"]
    turn2 = await call(adaptive.url, "chat", _chat(conversation, history))
    assert turn2.status == 200 and turn2.decision == "pd" and turn2.text
    after = await _gateway(adaptive, "pd_orchestrator_fanout_legs_total", outcome="rejected")
    assert after == rejected + 1  # the holder was asked, and said no
    again = await call(adaptive.url, "chat", _chat(conversation, history))
    assert again.decision == "decode" and again.text == turn2.text
    assert again.headers["x-pd-decoder"] == turn2.headers["x-pd-decoder"]
    assert (
        await _gateway(adaptive, "pd_orchestrator_fanout_legs_total", outcome="rejected") == after
    )


# -- tokenize once ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_race(fleet: Fleet, module_gateways: GatewayFactory) -> Child:
    return module_gateways(fleet.config(tokenize_from=None), name="text-race")


TOKENIZED = "vllm:prompt_tokens_tokenized_total"


async def _prefillers(fleet: Fleet, name: str) -> float:
    total = 0.0
    for prefiller in ("hp0", "ap0"):
        total += _count(await metrics_text(fleet.sims[prefiller].url), name)
    return total


def _shape(answer: Any) -> Any:
    """What must not change with the prompt's form: keys, object, id prefix."""
    if answer.body is not None:
        body = answer.body
        choice = body["choices"][0]
        message = sorted(choice.get("message", {}))
        return sorted(body), body["object"], body["id"].split("-")[0], sorted(choice), message
    objects = {chunk["object"] for chunk in answer.chunks}
    ids = {chunk["id"].split("-")[0] for chunk in answer.chunks}
    roles = sum(1 for c in answer.chunks for ch in c["choices"] if "role" in ch.get("delta", {}))
    return objects, ids, roles


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
async def test_token_id_fan_out_answers_as_the_text_fan_out(
    fleet: Fleet, race: Child, text_race: Child, kind: str, stream: bool
) -> None:
    """One ``/tokenize`` and token ids to the four asked decoders, the prefiller and the
    decode leg: the decoders tokenize the prompt once in all (the text fan-out: once per
    asked decoder, and again on the decode leg), the answer is the text fan-out's."""
    tag = uuid.uuid4().hex
    if kind == "chat":
        body = _chat(tag, ["summarise the plan"])
    else:
        body = {"model": MODEL, "prompt": f"{tag} " + "a cold document. " * 12, "max_tokens": 16,
                "ignore_eos": True}  # fmt: skip
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    before = await _decoders(fleet, TOKENIZED), await _prefillers(fleet, TOKENIZED)
    by_ids = await call(race.url, kind, body)  # cold: every decoder rejects, then P/D
    assert by_ids.status == 200 and by_ids.decision == "pd"
    assert by_ids.usage is not None
    prompt_tokens = by_ids.usage["prompt_tokens"]
    after = await _decoders(fleet, TOKENIZED), await _prefillers(fleet, TOKENIZED)
    assert after[0] - before[0] == prompt_tokens  # the one /tokenize
    assert after[1] == before[1]  # the prefiller got ids too
    by_text = await call(text_race.url, kind, body)  # warm now: admitted as text
    assert by_text.status == 200 and by_text.decision == "decode"
    assert await _decoders(fleet, TOKENIZED) - after[0] >= prompt_tokens
    assert by_ids.text == by_text.text and by_ids.text
    assert by_ids.finish_reason == by_text.finish_reason == "length"
    assert by_text.usage is not None
    assert by_ids.usage["prompt_tokens"] == by_text.usage["prompt_tokens"]
    assert by_ids.usage["completion_tokens"] == by_text.usage["completion_tokens"] == 16
    assert _shape(by_ids) == _shape(by_text)
    form = await _gateway(race, "pd_orchestrator_ask_all_prompts_total", form="tokenized")
    assert form >= 1


async def test_a_request_that_must_keep_its_text_is_fanned_out_as_text(
    fleet: Fleet, race: Child
) -> None:
    body = {"model": MODEL, "prompt": f"{uuid.uuid4().hex} echo me. " * 4, "max_tokens": 4,
            "echo": True}  # fmt: skip
    before = await _gateway(race, "pd_orchestrator_ask_all_prompts_total", form="text")
    tokenized = await _decoders(fleet, TOKENIZED)
    answer = await call(race.url, "completion", body)
    assert answer.status == 200 and answer.usage is not None
    after = await _gateway(race, "pd_orchestrator_ask_all_prompts_total", form="text")
    assert after == before + 1
    # each of the four asked decoders tokenized the text itself
    assert await _decoders(fleet, TOKENIZED) - tokenized >= 4 * answer.usage["prompt_tokens"]


# -- several choices ----------------------------------------------------------------------------
PREFILLED = "vllm:prompt_tokens_total"
REJECTIONS = "vllm:cache_threshold_rejections_total"


@pytest.mark.parametrize("width", ["all", "adaptive"])
async def test_a_cold_request_with_16_choices_is_prefilled_once(
    fleet: Fleet, race: Child, adaptive: Child, width: str
) -> None:
    """Choice 0 is prefilled and handed over; the other 15 are admitted warm on the
    decoder that now holds the prompt, asking no other decoder. Old: with ``width:
    adaptive`` (the shipped ask-all config) every choice skipped the fan-out and was
    prefilled on its own (16 prefills, 16 hand-overs); with ``all`` every choice asked
    all four decoders again."""
    gateway = race if width == "all" else adaptive
    body = _chat(uuid.uuid4().hex, ["write sixteen different poems"]) | {"n": 16, "seed": 7}
    before = await _prefillers(fleet, PREFILLED), await _decoders(fleet, REJECTIONS)
    answer = await call(gateway.url, "chat", body)
    assert answer.status == 200 and answer.decision == "pd" and answer.body is not None
    assert sorted(c["index"] for c in answer.body["choices"]) == list(range(16))
    assert answer.usage is not None
    prefilled = await _prefillers(fleet, PREFILLED) - before[0]
    assert prefilled == answer.usage["prompt_tokens"]  # one prefill
    asked = 4 if width == "all" else 0  # choice 0's fan-out; the others asked the holder
    assert await _decoders(fleet, REJECTIONS) - before[1] == asked


async def test_ask_all_does_not_ask_at_a_client_threshold_of_1(fleet: Fleet, race: Child) -> None:
    """At threshold 1 no prompt can be admitted: straight to P/D, no decoder asked (as
    decode-first). Old: ask-all asked all four decoders, each rejected."""
    body = _chat(uuid.uuid4().hex, ["hello"]) | {"cache_hit_threshold": 1.0}
    before = await _decoders(fleet, REJECTIONS)
    skipped = await _gateway(race, "pd_orchestrator_ask_all_total", outcome="skipped")
    answer = await call(race.url, "chat", body)
    assert answer.status == 200 and answer.decision == "pd" and answer.text
    assert await _decoders(fleet, REJECTIONS) == before
    assert await _gateway(race, "pd_orchestrator_ask_all_total", outcome="skipped") == skipped + 1


async def test_a_tokenized_prompt_is_held_to_the_token_id_limit(
    fleet: Fleet, gateway_factory: GatewayFactory
) -> None:
    """A text prompt the one ``/tokenize`` turns into more token ids than
    ``max_prompt_token_ids`` is refused as a token-id prompt of that length is (400).
    Old: its ids were sent to every asked decoder."""
    config = fleet.config() | {"limits": {"max_prompt_token_ids": 64}}
    gateway = gateway_factory(config, name="few-ids")
    short = await call(
        gateway.url, "completion", {"model": MODEL, "prompt": "hi there", "max_tokens": 2}
    )
    assert short.status == 200
    long = {"model": MODEL, "prompt": f"{uuid.uuid4().hex} " + "word " * 200, "max_tokens": 2}
    answer = await call(gateway.url, "completion", long)
    assert answer.status == 400 and answer.body is not None
    assert "more than 64 token ids" in answer.body["error"]["message"]
