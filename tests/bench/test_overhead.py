"""The overhead benchmark's pure parts: wrk's script and output, the minimal backend.

The backend runs as the benchmark runs it (``benchmarks/minimal_backend.py`` as a
script on a free loopback port); the tests check the answer shapes a relay
depends on (vLLM's, token ids included) and that answers are memoized.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pd_orchestrator.bench.wrk import MARKER, lua_script, parse_output, wrk_command
from pd_orchestrator.children import Child, start_child, stop_child
from pd_orchestrator.sim.tokenizer import SimTokenizer
from tests.bench.scripts import BENCHMARKS, benchmark_script

BACKEND = BENCHMARKS / "minimal_backend.py"
MODEL = "test-model"
TOKENS = 16

WRK_OUTPUT = """\
Running 4s test @ http://127.0.0.1:18200/v1/completions
  1 threads and 1 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   683.44us    1.67ms  27.18ms   95.41%
    Req/Sec     2.39k   491.88     3.08k    65.00%
  9506 requests in 4.00s, 6.26MB read
  Non-2xx or 3xx responses: 3
Requests/sec:   2375.64
Transfer/sec:      1.56MB
PDO_WRK requests=9506 duration_us=4001451 p50_us=375.0 p90_us=579.0 p99_us=6055.0 \
mean_us=683.4 max_us=27180.0 errors_connect=0 errors_read=1 errors_write=0 errors_status=3 \
errors_timeout=0
"""


# -- wrk ---------------------------------------------------------------------------------------
def test_parse_output_reads_the_result_line_in_seconds() -> None:
    result = parse_output(WRK_OUTPUT)
    assert result.requests == 9506
    assert result.duration == pytest.approx(4.001451)
    assert result.p50 == pytest.approx(375e-6)
    assert result.p90 == pytest.approx(579e-6)
    assert result.p99 == pytest.approx(6055e-6)
    assert result.max == pytest.approx(0.02718)
    assert result.rps == pytest.approx(9506 / 4.001451)
    assert (result.errors_status, result.errors_read, result.errors) == (3, 1, 4)


def test_parse_output_without_the_result_line_fails() -> None:
    with pytest.raises(ValueError, match=f"no {MARKER} line"):
        parse_output(WRK_OUTPUT.rsplit(MARKER, 1)[0])


def test_parse_output_names_a_missing_field() -> None:
    with pytest.raises(ValueError, match="p99_us"):
        parse_output(WRK_OUTPUT.replace("p99_us=6055.0 ", ""))


def test_lua_script_posts_the_body_verbatim() -> None:
    body = '{"prompt":"a ]] b ]=] c","max_tokens":16}'
    script = lua_script(body, {"X-Test": "1"})
    assert 'wrk.method = "POST"' in script
    assert f"wrk.body = [==[{body}]==]" in script  # a level no closing bracket in the body has
    assert "wrk.headers[[[X-Test]]] = [[1]]" in script
    assert "done = function(summary, latency, requests)" in script
    for field in ("p50_us", "p99_us", "errors_status", "duration_us"):
        assert f"{field}=" in script


def test_wrk_command_caps_threads_at_connections() -> None:
    command = wrk_command(
        "wrk", "http://h:1/v1/completions", "s.lua", connections=1, duration=2.4, threads=4
    )
    assert command == [
        "wrk",
        "--threads",
        "1",
        "--connections",
        "1",
        "--duration",
        "2s",
        "--timeout",
        "10s",
        "--script",
        "s.lua",
        "http://h:1/v1/completions",
    ]
    with pytest.raises(ValueError):
        wrk_command("wrk", "http://h:1/", "s.lua", connections=0, duration=1)


# -- the minimal backend -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def backend() -> Iterator[Child]:
    argv = [sys.executable, str(BACKEND), "--host", "127.0.0.1", "--port", "0", "--model", MODEL]
    child = start_child("minimal-backend", argv, timeout=30)
    try:
        yield child
    finally:
        stop_child(child)


@pytest.fixture
def client(backend: Child) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=backend.url, timeout=5.0) as client:
        yield client


def _events(response: httpx.Response) -> list[Any]:
    assert response.headers["content-type"] == "text/event-stream"
    data = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


def test_whole_completion_with_token_ids(client: httpx.Client) -> None:
    prompt = "hello there, relay"
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 16,
        "return_token_ids": True,
        "cache_hit_threshold": 1.0,
    }
    answer = client.post("/v1/completions", json=body).json()
    (choice,) = answer["choices"]
    assert answer["object"] == "text_completion"
    assert choice["finish_reason"] == "length"  # admitted whatever the threshold
    assert len(choice["token_ids"]) == TOKENS
    assert choice["text"] == SimTokenizer().decode(choice["token_ids"])
    assert choice["prompt_token_ids"] == SimTokenizer().encode(prompt)
    assert answer["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"])
    assert answer["usage"]["completion_tokens"] == TOKENS


def test_whole_completion_without_token_ids_and_a_smaller_limit(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4}
    answer = client.post("/v1/completions", json=body).json()
    (choice,) = answer["choices"]
    assert "token_ids" not in choice and "prompt_token_ids" not in choice
    assert answer["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": None,
    }


def test_streamed_completion_one_chunk_per_token(client: httpx.Client) -> None:
    prompt = "stream me"
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    chunks = _events(client.post("/v1/completions", json=body))
    *tokens, usage = chunks
    assert len(tokens) == TOKENS
    assert [len(c["choices"][0]["token_ids"]) for c in tokens] == [1] * TOKENS
    assert tokens[0]["choices"][0]["prompt_token_ids"] == SimTokenizer().encode(prompt)
    assert all("prompt_token_ids" not in c["choices"][0] for c in tokens[1:])
    reasons = [c["choices"][0]["finish_reason"] for c in tokens]
    assert reasons == [None] * (TOKENS - 1) + ["length"]
    whole = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt}).json()
    assert "".join(c["choices"][0]["text"] for c in tokens) == whole["choices"][0]["text"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == TOKENS


def test_streamed_without_usage_or_ids(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "plain", "stream": True}
    chunks = _events(client.post("/v1/completions", json=body))
    assert len(chunks) == TOKENS
    assert all("usage" not in c and "token_ids" not in c["choices"][0] for c in chunks)


def test_chat_carries_prompt_ids_at_the_top(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": MODEL, "messages": messages, "return_token_ids": True}
    answer = client.post("/v1/chat/completions", json=body).json()
    assert answer["object"] == "chat.completion"
    assert answer["prompt_token_ids"] and "prompt_token_ids" not in answer["choices"][0]
    assert len(answer["choices"][0]["token_ids"]) == TOKENS
    streamed = _events(client.post("/v1/chat/completions", json={**body, "stream": True}))
    role, *tokens = streamed
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert role["prompt_token_ids"] == answer["prompt_token_ids"]
    assert len(tokens) == TOKENS and tokens[-1]["choices"][0]["finish_reason"] == "length"


def test_probes(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]
    for path in ("/loads", "/v1/loads"):
        (rank,) = client.get(path).json()["loads"]
        assert rank["num_running_reqs"] == 0 and rank["token_usage"] == 0.0
    for _ in range(2):
        missing = client.get("/get_nothing")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    unknown = "minimal_backend_unknown_requests_total"
    assert _metric(client, unknown, {"path": "/get_nothing"})[0] == 2
    assert client.post("/v1/completions", content=b"{oops").status_code == 400
    assert client.get("/v1/completions").status_code == 405


def _metric(
    client: httpx.Client, name: str, labels: dict[str, str] | None = None
) -> tuple[float, dict[str, str]]:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and (labels is None or sample.labels == labels):
                return sample.value, sample.labels
    raise AssertionError(f"{name} {labels or ''} not in /metrics")


def test_metrics_and_memoized_answers(client: httpx.Client) -> None:
    value, labels = _metric(client, "vllm:kv_cache_usage_perc")
    assert value == 0.0 and labels == {"model_name": MODEL}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        assert _metric(client, name)[0] == 0.0
    served, _ = _metric(client, "minimal_backend_completions_total")
    built, _ = _metric(client, "minimal_backend_answers_built_total")
    body = {"model": MODEL, "prompt": "memo me", "max_tokens": 16}
    first = client.post("/v1/completions", json=body).content
    second = client.post("/v1/completions", json=body).content
    assert first == second
    assert _metric(client, "minimal_backend_completions_total")[0] == served + 2
    assert _metric(client, "minimal_backend_answers_built_total")[0] == built + 1


# -- the benchmark's answer check ----------------------------------------------------------------
@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    """The benchmark script as a module."""
    with benchmark_script("overhead_bench") as module:
        yield module


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_backend_passes_the_answer_check(
    bench: ModuleType, client: httpx.Client, stream: bool
) -> None:
    body = bench.request_body(stream, "check me", model=MODEL)
    response = client.post("/v1/completions", content=body)
    assert bench.check_answer(response, stream=stream) is None


def test_the_answer_check_refuses_token_ids_and_unstreamed_streams(
    bench: ModuleType, client: httpx.Client
) -> None:
    body = {"model": MODEL, "prompt": "check me", "max_tokens": 16, "return_token_ids": True}
    with_ids = client.post("/v1/completions", json=body)
    assert "token ids" in bench.check_answer(with_ids, stream=False)
    whole = client.post("/v1/completions", json={**body, "return_token_ids": False})
    assert "content-type" in bench.check_answer(whole, stream=True)
    short = client.post("/v1/completions", json={**body, "max_tokens": 3, "stream": True})
    assert "3 token chunks" in bench.check_answer(short, stream=True)


# -- per core, CPU per request, workers -----------------------------------------------------------
def test_pinned_runs_through_taskset_only_when_pinned(bench: ModuleType) -> None:
    assert bench.pinned(["wrk", "-c1"], None) == ["wrk", "-c1"]
    assert bench.pinned(["wrk", "-c1"], "1") == ["taskset", "-c", "1", "wrk", "-c1"]


def test_cpu_sets_give_the_relay_its_cores_and_the_load_the_rest(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert bench.cpu_sets(None) == (None, None)
    assert bench.cpu_sets(0) == ("0", "1,2,3")
    assert bench.cpu_sets(3, workers=2) == ("3,0", "1,2")
    assert bench.cpu_sets(1, workers=8) == ("1,2,3,0", "0,1,2,3")  # every core: shared
    with pytest.raises(SystemExit, match="--pin 7"):
        bench.cpu_sets(7)


def test_group_cpu_seconds_counts_a_busy_process_group(bench: ModuleType) -> None:
    import os
    import subprocess

    busy = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", busy], start_new_session=True)
    try:
        used = 0.0
        while child.poll() is None:
            used = max(used, bench.group_cpu_seconds(child.pid))
        assert used >= 0.2
        assert bench.group_cpu_seconds(os.getpid()) >= 0.0  # this group: some, never fails
    finally:
        child.kill()
        child.wait()


def test_ratios_set_workers_against_one_and_cpu_against_the_peers(bench: ModuleType) -> None:
    low, high = bench.Case(1, False), bench.Case(16, False)

    def figure(target: str, case: Any, rps: float, cpu: float, p50: float) -> Any:
        return bench.Figures(target, case, p50, p50, rps, 0, 3, cpu, p50, p50)

    figures = [
        figure("gateway", low, 100, 4e-4, 2e-4),
        figure("smg", low, 200, 2e-4, 1e-4),
        figure("gateway", high, 1000, 3e-4, 1e-3),
        figure("smg", high, 4000, 1e-4, 1e-3),
        figure("gateway-w2", high, 1900, 3e-4, 1e-3),
    ]
    found = {(r.metric, r.peer): r for r in bench.ratios(figures, [low, high])}
    assert found[("added p50 ms, c1 whole", "smg")].ratio == pytest.approx(2.0)
    assert found[("req/s, c16 whole", "smg")].ratio == pytest.approx(0.25)
    assert found[("CPU us/req, c16 whole", "smg")].ratio == pytest.approx(3.0)
    workers = found[("req/s, c16 whole, 2 workers", "gateway")]
    assert (workers.ratio, workers.goal) == (pytest.approx(1.9), ">= 1.8x")


def test_a_baseline_is_a_checkout_or_a_build(bench: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit):  # neither
        bench.parse_args(["--baseline", str(tmp_path)])
    (tmp_path / "pd_orchestrator").mkdir()  # a build of another version
    args = bench.parse_args(["--targets", "direct,gateway", "--baseline", str(tmp_path)])
    assert args.targets == ["direct", "gateway", "gateway-baseline"]


def test_workers_add_their_targets(bench: ModuleType) -> None:
    args = bench.parse_args(["--targets", "direct,gateway", "--workers", "1,2,2,4"])
    assert args.targets == ["direct", "gateway", "gateway-w2", "gateway-w4"]


def test_a_compiled_build_is_a_target_set_against_the_gateway(
    bench: ModuleType, tmp_path: Path
) -> None:
    with pytest.raises(SystemExit):  # no build there
        bench.parse_args(["--compiled", str(tmp_path)])
    (tmp_path / "pd_orchestrator").mkdir()
    args = bench.parse_args(["--targets", "direct,gateway", "--compiled", str(tmp_path)])
    assert args.targets == ["direct", "gateway", "gateway-compiled"]
    high = bench.Case(16, False)
    figures = [
        bench.Figures("gateway", high, 1e-3, 1e-3, 1000, 0, 3, 4e-4, 1e-3, 1e-3),
        bench.Figures("gateway-compiled", high, 1e-3, 1e-3, 1250, 0, 3, 3e-4, 1e-3, 1e-3),
    ]
    found = {(r.metric, r.peer): r for r in bench.ratios(figures, [high])}
    assert found[("req/s, c16 whole", "gateway-compiled")].ratio == pytest.approx(0.8)
    assert found[("CPU us/req, c16 whole", "gateway-compiled")].ratio == pytest.approx(4 / 3)


# -- the Python floor of a relay ----------------------------------------------------------------
FLOOR = BENCHMARKS / "floor_relay.py"


@pytest.fixture(scope="module", params=["asgi", "raw", "decode", "plan"])
def floor(request: pytest.FixtureRequest, backend: Child) -> Iterator[Child]:
    """A floor relay of each mode in front of the minimal backend."""
    argv = [sys.executable, str(FLOOR), "--mode", request.param, "--upstream", backend.url,
            "--model", MODEL]  # fmt: skip
    child = start_child(f"floor-{request.param}", argv, timeout=30)
    try:
        yield child
    finally:
        stop_child(child)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_floor_relay_passes_the_backend_s_answer_through(
    bench: ModuleType, backend: Child, floor: Child, stream: bool
) -> None:
    body = bench.request_body(stream, "relay me", model=MODEL)
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=5.0) as client:
        relayed = client.post(f"{floor.url}/v1/completions", content=body, headers=headers)
        direct = client.post(f"{backend.url}/v1/completions", content=body, headers=headers)
        assert bench.check_answer(relayed, stream=stream) is None
        again = client.post(f"{floor.url}/v1/completions", content=body, headers=headers)
        assert again.content == relayed.content  # and again on the kept-alive connections
    if floor.name not in ("floor-decode", "floor-plan"):  # memoized: the same bytes
        assert relayed.content == direct.content
    elif stream:  # the same events, the token ids asked for and taken out again
        assert [_content(e) for e in _events(relayed)] == [_content(e) for e in _events(direct)]
    else:
        assert _content(relayed.json()) == _content(direct.json())


def _content(answer: dict[str, Any]) -> Any:
    """An answer less what differs between two answers to two bodies (id, time)."""
    return {key: value for key, value in answer.items() if key not in ("id", "created")}


def test_floors_are_targets_only_when_named(bench: ModuleType) -> None:
    assert not set(bench.parse_args([]).targets) & set(bench.FLOORS)
    args = bench.parse_args(["--targets", "floor-raw,gateway,floor-plan,floor-decode,floor-asgi"])
    assert args.targets == ["gateway", "floor-asgi", "floor-raw", "floor-decode", "floor-plan"]


def test_the_plan_floor_admits_plans_and_learns_as_the_gateway_does(bench: ModuleType) -> None:
    """``floor-plan``'s decision is the gateway's: its admission refuses what the
    gateway refuses, in the same shape; its plan names the overhead benchmark's decoder
    with the configured policy's threshold; what it learns reaches the planner."""
    from pd_orchestrator.config.loader import parse_config

    with benchmark_script("floor_relay") as floor_relay:
        planned = floor_relay.Planned(parse_config(bench.gateway_config("http://127.0.0.1:9")))
        scope = {"path": "/v1/completions", "headers": [(b"content-type", b"application/json")]}
        raw = json.dumps({"model": bench.MODEL, "prompt": "plan me", "max_tokens": 4}).encode()
        body, threshold, (admitted, plan) = planned.decide(scope, raw)
        assert body["prompt"] == "plan me" and plan.decoder.name == "backend-decode"
        assert threshold == pytest.approx(0.7)  # the schema's default policy, static 0.7
        refused = {b"{": 400, json.dumps({"model": "other", "prompt": "x"}).encode(): 404}
        for bad, status in refused.items():
            with pytest.raises(floor_relay.Refused) as caught:
                planned.decide(scope, bad)
            assert caught.value.status == status
            assert set(json.loads(caught.value.body)["error"]) >= {"message", "type", "code"}
        resolver = planned.state.planner.threshold
        assert resolver.prompt_length.ratio(bench.MODEL) == 4.0  # the prior, chars/token
        usage = {"prompt_tokens": 7, "completion_tokens": 4,
                 "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip
        planned.learn((admitted, plan), floor_relay.Served(0.01, usage))
        assert resolver.prompt_length.ratio(bench.MODEL) < 4.0  # "plan me": 1 char a token


@pytest.mark.parametrize("target", ["gateway", "floor-asgi", "floor-decode", "floor-plan"])
def test_the_request_path_bench_serves_each_request_and_counts_its_calls(target: str) -> None:
    import subprocess

    argv = [sys.executable, str(BENCHMARKS / "request_path.py"), "--target", target,
            "--requests", "40", "--concurrency", "2", "--profile", "--top", "3"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=50, check=False)
    assert done.returncode == 0, done.stderr[-2000:]  # it fails on an answer not 200
    assert f"{target} whole: 40 requests, CPU " in done.stdout
    calls = float(done.stdout.split("calls per request (profiled): ")[1].split()[0])
    assert calls > 20
