"""Every KV connector's whole flow through the gateway: on the simulator, and on the
real vLLM CPU pair for the connectors vLLM's CPU build can run.

Simulator target (``PDO_E2E_TARGET=sim``), every connector: a simulated prefiller
and decoder speaking it, the gateway in front with the pools naming it (the
simulators' side channels all listen on their HTTP ports). A cold prompt goes P/D
and its tokens equal a single instance's; the same prompt then is admitted by the
decoder (``decode``); requests the decoder preempts are handed back through the
same connector and still end token for token equal to the reference.

vLLM target (``PDO_E2E_TARGET=vllm``, ``make e2e-vllm``), the connectors of
:data:`VLLM_CONNECTORS`: one real pair per connector, started with it and shared by
its two tests, the gateway in front, the same flow (the suite's shared pair runs
``nixl``: ``test_gateway_pd.py``).
e2e/README.md tables which connectors run on CPU vLLM and why the others cannot.

On the ``live`` target these tests skip: live pairs run the connector they were
started with (``test_gateway_pd.py``).
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import yaml
from targets import HEALTH, Target, gateway_for, metric_in, vllm_target, wait_ready, warm_up

from pd_orchestrator.children import Child, python_command, start_child, stop_child

TARGET = os.environ.get("PDO_E2E_TARGET", "sim")
pytestmark = pytest.mark.anyio
sim_only = pytest.mark.skipif(TARGET != "sim", reason="simulator target only")
vllm_only = pytest.mark.skipif(TARGET != "vllm", reason="vLLM target only")
MODEL = "sim-model"
OUTPUT = 150
PROMPTS = [
    f"conversation {i}: " + "the history so far is long and detailed. " * 5 for i in range(4)
]

# (connector spec, whether the gateway's config names the prefiller's engine id: without
# it nixl-push learns it from the first prefill answer and mooncake looks it up)
CONNECTORS = [
    ("nixl", True),
    ("nixl-push", False),
    ("mooncake", False),
    ("moriio", True),
    ("offloading", True),
    ("lmcache", True),
    ("example", True),
    ("multi:nixl,example", True),
]
# With a shared store the decoder itself reloads a preempted request's blocks from the
# store when it resumes it: nothing is handed back (decode-first at its most natural).
SHARED_STORE = {"lmcache", "example", "multi:nixl,example"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _sim(stack: ExitStack, name: str, *args: str) -> Child:
    argv = python_command("sim", "--host", "127.0.0.1", "--port", "0", *args)
    child = start_child(name, argv, timeout=60)
    stack.callback(stop_child, child)
    return child


def _kv(sim: Child, engine: str, named: bool) -> dict[str, Any]:
    port = sim.port
    kv: dict[str, Any] = {"host": "127.0.0.1", "nixl_port": port, "bootstrap_port": port}
    kv |= {"handshake_port": port, "notify_port": port, "p2p_port": port}
    return kv | ({"engine_id": engine} if named else {})


class Stack:
    def __init__(
        self, spec: str, gateway: Child, decoder: Child, prefiller: Child, reference: Child
    ):
        self.spec = spec
        self.gateway, self.decoder, self.prefiller = gateway, decoder, prefiller
        self.reference = reference


@pytest.fixture(params=CONNECTORS, ids=[spec for spec, _ in CONNECTORS])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stack]:
    spec, named = request.param
    shared = ("--kv-connector", spec, "--kv-shared-dir", str(tmp_path), "--model", MODEL)
    shared += ("--lmcache-chunk-size", "16")
    with ExitStack() as stack:
        # 64 blocks of 16 tokens: four 220-token prompts and 150 outputs each do not fit
        decoder = _sim(
            stack, "decoder", "--profile", "h200-llama3-8b", "--time-scale", "0.3",
            "--num-kv-blocks", "64", "--max-num-seqs", "8", "--engine-id", "decode", *shared,
        )  # fmt: skip
        prefiller = _sim(
            stack, "prefill", "--profile", "instant", "--engine-id", "prefill", *shared
        )
        reference = _sim(stack, "reference", "--profile", "instant", "--model", MODEL)
        config = {
            "connector": spec,
            "pools": [
                {"name": "decode", "role": "decode", "model": MODEL, "endpoints": [
                    {"name": "decode-0", "url": decoder.url, "kv": _kv(decoder, "decode", True)}]},
                {"name": "prefill", "role": "prefill", "model": MODEL, "endpoints": [
                    {"name": "prefill-0", "url": prefiller.url,
                     "kv": _kv(prefiller, "prefill", named)}]},
            ],
            "threshold": {"policy": {"type": "static", "value": 0.6}},
            "health": HEALTH,
        }  # fmt: skip
        path = tmp_path / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        gateway = start_child(
            "gateway", python_command("serve", "--config", str(path), "--port", "0"), timeout=60
        )
        stack.callback(stop_child, gateway)
        wait_ready(gateway.url)
        yield Stack(spec, gateway, decoder, prefiller, reference)


async def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as client:
        return await client.post(url + "/v1/completions", json=body)


def _ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"])


async def _streamed_ids(url: str, body: dict[str, Any]) -> tuple[httpx.Headers, list[int]]:
    ids: list[int] = []
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream("POST", url + "/v1/completions", json=body | {"stream": True}) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                assert "error" not in chunk, chunk
                for choice in chunk.get("choices") or []:
                    ids += choice.get("token_ids") or []
        return response.headers, ids


@sim_only
async def test_cold_pd_warm_decode_and_hand_back_through_the_connector(stack: Stack) -> None:
    gateway = stack.gateway.url
    prompt = f"{uuid.uuid4().hex} " + "a document to prefill remotely. " * 12
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    expected = _ids(await _post(stack.reference.url, body))

    cold = await _post(gateway, body)
    assert cold.headers["x-pd-decision"] == "pd" and _ids(cold) == expected
    headers, streamed = await _streamed_ids(gateway, body)
    assert headers["x-pd-decision"] == "decode" and streamed == expected

    async with httpx.AsyncClient(timeout=10) as client:
        decoder_metrics = (await client.get(stack.decoder.url + "/metrics")).text
    assert metric_in(decoder_metrics, "vllm:external_prefix_cache_hits_total") > 0

    # hand-backs: the decoder holds the prompts, then preempts under four at once
    bodies = [
        {"model": MODEL, "prompt": p, "max_tokens": OUTPUT, "ignore_eos": True,
         "return_token_ids": True}
        for p in PROMPTS
    ]  # fmt: skip
    for warm in bodies:
        assert (await _post(gateway, warm | {"max_tokens": 1})).status_code == 200
    answers: list[list[int]] = [[] for _ in bodies]

    async def one(i: int) -> None:
        answers[i] = (await _streamed_ids(gateway, bodies[i]))[1]

    with anyio.fail_after(240):
        async with anyio.create_task_group() as tg:
            for i in range(len(bodies)):
                tg.start_soon(one, i)
    for answer, sent in zip(answers, bodies, strict=True):
        assert answer == _ids(await _post(stack.reference.url, sent))
    async with httpx.AsyncClient(timeout=10) as client:
        gateway_metrics = (await client.get(gateway + "/metrics")).text
        decoder_metrics = (await client.get(stack.decoder.url + "/metrics")).text
    assert metric_in(decoder_metrics, "vllm:num_preemptions_total") >= 1
    if stack.spec not in SHARED_STORE:
        assert metric_in(gateway_metrics, "pd_orchestrator_handbacks_total") >= 1


# --- the real vLLM CPU pair ---------------------------------------------------------------

#: The connectors a real vLLM 0.32 CPU pair runs besides ``nixl`` reliably, each in a pair
#: of its own (``e2e/vllm_cpu/pair.py`` builds its ``--kv-transfer-config``).
#: ``PDO_E2E_VLLM_CONNECTORS`` (pair.py's connector names, separated by spaces) replaces
#: the list, e.g. to run ``nixl-push``, which is left out (e2e/README.md).
VLLM_CONNECTORS = os.environ.get("PDO_E2E_VLLM_CONNECTORS", "example multi:nixl,example").split()
#: Prompts that overflow the small decoder (24 blocks of 32 tokens) when decoded at once.
PREEMPT_PROMPTS, PREEMPT_PROMPT_TOKENS, PREEMPT_OUTPUT = 3, 161, 300
PREEMPT_ROUNDS = 4


class RealStack:
    def __init__(self, pair: Any, target: Target, gateway: str) -> None:
        self.pair, self.target, self.gateway = pair, target, gateway
        self.decoder: str = pair.decoder.url
        self.prefiller: str = pair.prefiller.url
        self.shared_dir: Path = pair.decoder.shared_dir


@pytest.fixture(scope="module", params=VLLM_CONNECTORS)
def real(
    request: pytest.FixtureRequest,
    vllm_pair_factory: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RealStack]:
    """A pair started with the connector, the gateway in front, one hand-over done
    (module scope: both tests of a connector share its pair)."""
    with vllm_pair_factory(connector=request.param, small_decoder=True) as pair:
        target = vllm_target(pair)
        with gateway_for(target, tmp_path_factory.mktemp("gateway")) as gateway:
            warm_up(gateway.url, target)
            yield RealStack(pair, target, gateway.url)


async def _metric_of(url: str, name: str, **labels: str) -> float:
    async with httpx.AsyncClient(timeout=10) as client:
        return metric_in((await client.get(url + "/metrics")).text, name, **labels)


def _stored_prompts(shared_dir: Path) -> int:
    """How many prompts ExampleConnector has saved in the pair's shared folder."""
    return sum(1 for entry in shared_dir.iterdir() if entry.is_dir())


async def _transfers(real: RealStack) -> dict[str, float]:
    """The counters that show how KV moved: NIXL reads on the decoder, NIXL writes on
    the prefiller (push), prompts saved to the shared folder."""
    name = "vllm:nixl_xfer_time_seconds_count"
    return {
        "decoder_nixl": await _metric_of(real.decoder, name),
        "prefiller_nixl": await _metric_of(real.prefiller, name),
        "stored": _stored_prompts(real.shared_dir),
    }


def _moved(spec: str, before: dict[str, float], after: dict[str, float]) -> bool:
    """Whether the connector's own transfer path ran between the two readings."""
    if spec == "nixl-push":
        return after["prefiller_nixl"] > before["prefiller_nixl"]
    if spec == "example":
        return after["stored"] > before["stored"]
    # multi:nixl,example -- NIXL, the first child, loads; the example child saves too
    return after["decoder_nixl"] > before["decoder_nixl"] and after["stored"] > before["stored"]


async def _reference(real: RealStack, body: dict[str, Any]) -> list[int]:
    """The prefiller's own greedy run (asked after the gateway's, so that a shared store
    cannot have been warmed by it)."""
    plain = body | {"stream": False, "cache_hit_threshold": 0, "temperature": 0}
    return _ids(await _post(real.prefiller, plain))


async def _preemption_round(real: RealStack, index: int) -> tuple[bool, bool]:
    """Prompts held by the decoder, then decoded at once: (hand-back seen, preemption seen).
    Every output must equal the reference."""
    rng = random.Random(f"{real.target.connector}-{index}-{uuid.uuid4().hex}")
    bodies = [
        {"model": real.target.model, "max_tokens": PREEMPT_OUTPUT, "ignore_eos": True,
         "temperature": 0, "return_token_ids": True, "cache_hit_threshold": 0.9,
         "prompt": [rng.randrange(1000, 3000) for _ in range(PREEMPT_PROMPT_TOKENS)]}
        for _ in range(PREEMPT_PROMPTS)
    ]  # fmt: skip
    for body in bodies:  # P/D once: every prompt is then warm on the decoder
        warm = await _post(real.gateway, body | {"max_tokens": 1})
        assert warm.status_code == 200 and warm.headers["x-pd-decision"] == "pd", warm.text
    handbacks = await _metric_of(real.gateway, "pd_orchestrator_handbacks_total")
    preemptions = await _metric_of(real.decoder, "vllm:num_preemptions_total")
    answers: list[list[int]] = [[] for _ in bodies]

    async def one(i: int) -> None:
        answers[i] = (await _streamed_ids(real.gateway, bodies[i]))[1]

    with anyio.fail_after(300):
        async with anyio.create_task_group() as tg:
            for i in range(len(bodies)):
                tg.start_soon(one, i)
    for i, body in enumerate(bodies):
        assert answers[i] == await _reference(real, body), f"round {index}, prompt {i}"
    return (
        await _metric_of(real.gateway, "pd_orchestrator_handbacks_total") > handbacks,
        await _metric_of(real.decoder, "vllm:num_preemptions_total") > preemptions,
    )


@vllm_only
@pytest.mark.timeout(900)
async def test_the_real_pair_hands_kv_over_cold_and_admits_it_warm(real: RealStack) -> None:
    spec, gateway = real.target.connector, real.gateway
    rng = random.Random(uuid.uuid4().hex)
    prompt = [rng.randrange(1000, 3000) for _ in range(200)]
    body = {"model": real.target.model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip

    # cold: decode-first is refused, the prefiller prefills, the KV reaches the decoder
    hits = await _metric_of(real.decoder, "vllm:external_prefix_cache_hits_total")
    moved = await _transfers(real)
    cold = await _post(gateway, body)
    assert cold.status_code == 200, cold.text
    assert cold.headers["x-pd-decision"] == "pd"
    assert await _metric_of(real.decoder, "vllm:external_prefix_cache_hits_total") > hits
    assert _moved(spec, moved, await _transfers(real)), (moved, await _transfers(real))

    # warm: the decoder holds the prompt now and admits it (streamed this time)
    prefilled = await _metric_of(real.prefiller, "vllm:prompt_tokens_total")
    headers, streamed = await _streamed_ids(gateway, body)
    assert headers["x-pd-decision"] == "decode"
    assert await _metric_of(real.prefiller, "vllm:prompt_tokens_total") == prefilled
    reference = await _reference(real, body)
    assert _ids(cold) == reference and streamed == reference


@vllm_only
@pytest.mark.timeout(900)
async def test_the_real_pair_resumes_a_handed_back_request_through_the_connector(
    real: RealStack,
) -> None:
    """The decoder preempts, hands the request back, the gateway resumes it through the
    prefiller and the same connector; the output still equals the reference."""
    rejections = await _metric_of(
        real.decoder, "vllm:cache_threshold_rejections_total", phase="preemption"
    )
    for index in range(PREEMPT_ROUNDS):
        handed_back, _ = await _preemption_round(real, index)
        if handed_back:
            break
    else:
        pytest.fail(f"no hand-back in {PREEMPT_ROUNDS} rounds")
    assert (
        await _metric_of(real.decoder, "vllm:cache_threshold_rejections_total", phase="preemption")
        > rejections
    )
