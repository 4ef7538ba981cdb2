"""The cache-hit threshold on vLLM 0.33's own Scheduler, step by step.

Each test drives the plugin's scheduler subclass (built by vLLM's
``SchedulerConfig.get_scheduler_cls()``) through vLLM's ``schedule()`` /
``update_from_output()`` and vLLM's ``OutputProcessor`` (see ``conftest.py``).
Block size 16: a prompt of 97 tokens fully cached hits 96 tokens (the last token
is always recomputed), ratio 96/97 = 0.9897.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from conftest import BLOCK_SIZE, Loop, detached_request, fresh_prompt
from prometheus_client import REGISTRY
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine import FinishReason

from pd_orchestrator.vllm_plugin.policy import max_hit_ratio

pytestmark = pytest.mark.timeout(300)

PROMPT_LEN = 97


def assert_rejected(loop: Loop, request_id: str, phase: str) -> None:
    """Finished by the plugin: vLLM's abort status with the phase in the stop reason
    on the engine side, ``finish_reason "cache_threshold"`` on the API-server side."""
    finished = loop.finished[request_id]
    assert finished.engine.finish_reason == FinishReason.ABORT
    assert finished.engine.stop_reason == f"cache_threshold:{phase}"
    assert finished.engine.new_token_ids == []
    assert finished.text_output.finish_reason == "cache_threshold"
    assert finished.text_output.stop_reason is None
    assert request_id not in loop.scheduler.requests


def warm(loop: Loop, prompt: list[int]) -> None:
    """Run ``prompt`` once with no threshold so its full blocks are in the prefix cache."""
    loop.add("warm-up", prompt, max_tokens=1)
    loop.run(steps=3, until=["warm-up"])
    assert loop.finished["warm-up"].engine.finish_reason == FinishReason.LENGTH


# --- admission ---------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_cold_prompt_below_its_threshold_finishes_with_no_token(
    make_loop: Any, async_scheduling: bool
) -> None:
    loop = make_loop(async_scheduling=async_scheduling)
    loop.add("cold", fresh_prompt(PROMPT_LEN), extra_args={"cache_hit_threshold": 0.5})
    loop.add("plain", fresh_prompt(PROMPT_LEN))

    scheduled = loop.step()

    assert "cold" not in scheduled  # never given a block or a token
    assert scheduled["plain"] == PROMPT_LEN  # the request behind it is not held up
    assert_rejected(loop, "cold", "admission")
    assert loop.delivered["cold"] == []
    assert loop.finished["cold"].text_output.token_ids == []
    assert loop.finished["cold"].text_output.text == ""
    assert [r.request_id for r in loop.scheduler.waiting] == []


def test_warm_prompt_above_its_threshold_is_admitted_with_its_hit(make_loop: Any) -> None:
    loop = make_loop()
    prompt = fresh_prompt(PROMPT_LEN)
    warm(loop, prompt)
    best = max_hit_ratio(PROMPT_LEN, BLOCK_SIZE)
    assert best == pytest.approx(96 / 97)

    loop.add("warm", prompt, max_tokens=4, extra_args={"cache_hit_threshold": 0.9})
    loop.add("too-strict", prompt, extra_args={"cache_hit_threshold": 0.995})
    scheduled = loop.step()

    # Admitted with the 96 cached tokens counted: one token left to compute.
    assert scheduled == {"warm": PROMPT_LEN - 96}
    # The same hit is below a threshold above 96/97.
    assert_rejected(loop, "too-strict", "admission")
    loop.run(steps=6, until=["warm"])
    assert loop.finished["warm"].text_output.finish_reason == "length"
    assert len(loop.delivered["warm"]) == 4


def test_a_prefill_for_remote_decode_ignores_the_threshold(make_loop: Any) -> None:
    loop = make_loop(additional_config={"cache_hit_threshold": 0.9})
    loop.add(
        "prefill",
        fresh_prompt(PROMPT_LEN),
        max_tokens=1,
        extra_args={"cache_hit_threshold": 0.9, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert loop.step() == {"prefill": PROMPT_LEN}


# --- preemption hand-back ------------------------------------------------------------


def test_preempted_request_below_its_threshold_is_handed_back_with_its_tokens(
    make_loop: Any,
) -> None:
    """Three requests of 7 blocks fill a 21-block cache. When they all need an 8th
    block, vLLM preempts the last one admitted ("victim"); the blocks it frees are
    taken by the others, so when it is scheduled again its hit (prompt + outputs)
    is below its threshold and it finishes with the tokens it produced."""
    loop = make_loop(num_blocks=22)  # 21 usable blocks
    prompt = fresh_prompt(PROMPT_LEN)
    warm(loop, prompt)  # 96 cached tokens: the victim is admitted at 96/97
    loop.add("other-1", fresh_prompt(PROMPT_LEN), max_tokens=40)
    loop.add("other-2", fresh_prompt(PROMPT_LEN), max_tokens=40)
    victim = loop.add("victim", prompt, max_tokens=64, extra_args={"cache_hit_threshold": 0.95})

    first = loop.step()
    assert first["victim"] == PROMPT_LEN - 96  # admitted on its hit
    for _ in range(40):
        loop.step()
        if "victim" in loop.finished:
            break

    assert loop.preempted == ["victim"]
    assert_rejected(loop, "victim", "preemption")
    assert rejections(loop, "preemption") == 1.0
    produced = list(victim.output_token_ids)
    assert len(produced) >= BLOCK_SIZE - 1
    # Every token was delivered before the rejection, which adds none; the API
    # server's final output carries them all.
    assert loop.delivered["victim"] == produced
    assert list(loop.finished["victim"].text_output.token_ids) == produced
    # The others go on to their own end.
    loop.run(steps=40, until=["other-1", "other-2"])
    for name in ("other-1", "other-2"):
        assert loop.finished[name].text_output.finish_reason == "length"
        assert len(loop.delivered[name]) == 40


def test_an_admission_only_request_is_rejected_at_admission_never_at_preemption(
    make_loop: Any,
) -> None:
    """The hand-back case above, admission-only: the victim is preempted the same way,
    then resumes and recomputes as stock vLLM does, to its last token; a cold
    admission-only request is still rejected at admission."""
    loop = make_loop(num_blocks=22)
    only = {"cache_hit_threshold": 0.95, "cache_hit_admission_only": True}
    loop.add("cold", fresh_prompt(PROMPT_LEN), extra_args=only)
    prompt = fresh_prompt(PROMPT_LEN)
    warm(loop, prompt)
    assert_rejected(loop, "cold", "admission")
    loop.add("other-1", fresh_prompt(PROMPT_LEN), max_tokens=40)
    loop.add("other-2", fresh_prompt(PROMPT_LEN), max_tokens=40)
    victim = loop.add("victim", prompt, max_tokens=64, extra_args=only)
    assert loop.step()["victim"] == PROMPT_LEN - 96
    loop.run(steps=200, until=["victim", "other-1", "other-2"])
    assert set(loop.preempted) == {"victim"}
    finished = loop.finished["victim"]
    assert finished.text_output.finish_reason == "length"
    assert list(finished.text_output.token_ids) == list(victim.output_token_ids)
    assert len(victim.output_token_ids) == 64
    assert rejections(loop, "preemption") == 0.0


@pytest.mark.parametrize(
    ("request_cls", "body"),
    [
        (CompletionRequest, {"prompt": "x", "cache_hit_admission_only": True}),
        (CompletionRequest, {"prompt": "x", "vllm_xargs": {"cache_hit_admission_only": "true"}}),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}], "cache_hit_admission_only": 1},
        ),
    ],
    ids=["completions-body", "completions-xargs", "chat-body"],
)
def test_admission_only_reaches_the_engine_from_both_apis(request_cls: Any, body: Any) -> None:
    params = openai_params(request_cls, body)
    assert params.extra_args["cache_hit_admission_only"] is True


def test_admission_only_false_is_no_setting() -> None:
    params = openai_params(CompletionRequest, {"prompt": "x", "cache_hit_admission_only": False})
    assert "cache_hit_admission_only" not in (params.extra_args or {})


@pytest.mark.parametrize("value", [2, "yes", 0.5, [True]])
def test_a_bad_admission_only_value_is_a_validation_error(value: object) -> None:
    with pytest.raises(VLLMValidationError, match="cache_hit_admission_only"):
        openai_params(CompletionRequest, {"prompt": "x", "cache_hit_admission_only": value})
    with pytest.raises(VLLMValidationError, match=r"vllm_xargs\.cache_hit_admission_only"):
        openai_params(
            CompletionRequest, {"prompt": "x", "vllm_xargs": {"cache_hit_admission_only": value}}
        )


# --- resume: a structured output's grammar advanced over resumed tokens -------------

REGEX = "[0-9]{2,40}(,[a-z]{1,30}){1,5}"


def regex_params(**extra: Any) -> SamplingParams:
    """A regex constraint on xgrammar (the API server's input processor picks the
    backend; the engine core expects it picked)."""
    constraint = StructuredOutputsParams(regex=REGEX)
    constraint._backend = "xgrammar"
    return SamplingParams(
        max_tokens=8, temperature=0.0, structured_outputs=constraint, extra_args=extra or None
    )


def structured(loop: Loop, request_id: str, prompt: list[int], **extra: Any) -> Any:
    """A request with a regex constraint, its grammar compiled as the engine core does."""
    manager = loop.scheduler.structured_output_manager
    params = regex_params(**extra)
    return loop.add(request_id, prompt, sampling_params=params, before_add=manager.grammar_init)


def allowed(loop: Loop, request: Any) -> frozenset[int]:
    """The token ids ``request``'s grammar allows next."""
    manager = loop.scheduler.structured_output_manager
    bitmask = manager.backend.allocate_token_bitmask(1)
    request.structured_output_request.grammar.fill_bitmask(bitmask, 0)
    words = bitmask[0].tolist()
    return frozenset(
        word_index * 32 + bit
        for word_index, word in enumerate(words)
        for bit in range(32)
        if (word >> bit) & 1
    )


def walk(loop: Loop, request: Any, steps: int) -> list[int]:
    """``steps`` tokens the grammar allows, one after another (the smallest allowed id
    that differs from the last), accepted by ``request``'s grammar as decoding would."""
    tokens: list[int] = []
    for _ in range(steps):
        choices = sorted(allowed(loop, request) - set(tokens[-1:]))
        token = choices[len(choices) // 2]
        assert loop.scheduler.structured_output_manager.accept_tokens(request, [token])
        tokens.append(token)
    return tokens


def wait_for_grammars(loop: Loop, *requests: Any) -> None:
    for request in requests:
        for _ in range(400):
            if request.structured_output_request.grammar is not None:
                break
            time.sleep(0.01)
        else:
            raise AssertionError("the grammar never compiled")


def test_a_resumed_request_starts_from_the_grammar_state_of_an_uninterrupted_run(
    make_loop: Any,
) -> None:
    """The uninterrupted run's grammar took ``generated``; the continuation's prompt ends
    with them and says so: after its first step, both allow exactly the same next
    tokens. Without the count, the continuation's grammar starts over (the test can
    fail)."""
    loop = make_loop()
    prompt = fresh_prompt(PROMPT_LEN)
    reference = detached_request("reference", prompt, regex_params())
    loop.scheduler.structured_output_manager.grammar_init(reference)
    wait_for_grammars(loop, reference)
    generated = walk(loop, reference, 6)
    resumed = structured(loop, "resumed", [*prompt, *generated], cache_hit_resume_tokens=6)
    restarted = structured(loop, "restarted", [*prompt, *generated])
    wait_for_grammars(loop, resumed, restarted)
    scheduled = loop.scheduler.schedule().num_scheduled_tokens  # what samples next
    assert set(scheduled) == {"resumed", "restarted"}
    assert allowed(loop, resumed) == allowed(loop, reference)
    assert allowed(loop, restarted) != allowed(loop, reference)


def test_resume_tokens_the_grammar_rejects_finish_the_request_with_an_error(
    make_loop: Any,
) -> None:
    loop = make_loop()
    prompt = fresh_prompt(PROMPT_LEN)
    request = structured(loop, "bad", prompt, cache_hit_resume_tokens=4)
    too_many = structured(loop, "too-many", prompt, cache_hit_resume_tokens=PROMPT_LEN + 1)
    wait_for_grammars(loop, request, too_many)
    scheduled = loop.step()
    assert "bad" not in scheduled and "too-many" not in scheduled
    loop.run(steps=2, until=["bad", "too-many"])
    for name in ("bad", "too-many"):
        assert loop.finished[name].engine.finish_reason == FinishReason.ERROR
        assert loop.delivered[name] == []


def test_a_resume_count_on_an_unconstrained_request_changes_nothing(make_loop: Any) -> None:
    loop = make_loop()
    loop.add("plain", fresh_prompt(PROMPT_LEN), extra_args={"cache_hit_resume_tokens": 5})
    assert loop.step() == {"plain": PROMPT_LEN}


@pytest.mark.parametrize(
    ("request_cls", "body"),
    [
        (CompletionRequest, {"prompt": [1, 2, 3], "cache_hit_resume_tokens": 2}),
        (CompletionRequest, {"prompt": "x", "vllm_xargs": {"cache_hit_resume_tokens": "2"}}),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}], "cache_hit_resume_tokens": 2},
        ),
    ],
    ids=["completions-body", "completions-xargs", "chat-body"],
)
def test_the_resume_count_reaches_the_engine_from_both_apis(request_cls: Any, body: Any) -> None:
    assert openai_params(request_cls, body).extra_args["cache_hit_resume_tokens"] == 2


@pytest.mark.parametrize("value", [-1, 1.5, "many", True])
def test_a_bad_resume_count_is_a_validation_error(value: object) -> None:
    with pytest.raises(VLLMValidationError, match="cache_hit_resume_tokens"):
        openai_params(CompletionRequest, {"prompt": "x", "cache_hit_resume_tokens": value})


def test_the_plugin_says_it_resumes_grammars(make_loop: Any) -> None:
    loop = make_loop()
    model_name = loop.scheduler.vllm_config.model_config.served_model_name
    labels = {"model_name": model_name, "engine": "0"}
    assert REGISTRY.get_sample_value("vllm:cache_threshold_resume", labels) == 1.0


# --- metric ---------------------------------------------------------------------------


def rejections(loop: Loop, phase: str) -> float | None:
    """The plugin's counter for ``phase``, read from the process's Prometheus registry."""
    model_name = loop.scheduler.vllm_config.model_config.served_model_name
    return REGISTRY.get_sample_value(
        "vllm:cache_threshold_rejections_total",
        {"model_name": model_name, "engine": "0", "phase": phase},
    )


def test_the_plugin_says_it_takes_admission_only(make_loop: Any) -> None:
    loop = make_loop()
    model_name = loop.scheduler.vllm_config.model_config.served_model_name
    labels = {"model_name": model_name, "engine": "0"}
    assert REGISTRY.get_sample_value("vllm:cache_threshold_admission_only", labels) == 1.0


def test_rejections_are_counted_by_phase(make_loop: Any) -> None:
    loop = make_loop()
    assert rejections(loop, "admission") == 0.0  # a fresh stat logger starts at 0
    loop.add("cold-1", fresh_prompt(PROMPT_LEN), extra_args={"cache_hit_threshold": 0.5})
    loop.add("cold-2", fresh_prompt(PROMPT_LEN), extra_args={"cache_hit_threshold": 0.5})
    loop.add("plain", fresh_prompt(PROMPT_LEN), max_tokens=1)
    loop.run(steps=4, until=["cold-1", "cold-2", "plain"])
    assert rejections(loop, "admission") == 2.0
    assert rejections(loop, "preemption") == 0.0


# --- server default and per-request value --------------------------------------------


def flag_config(model: Path, *argv: str) -> dict[str, Any]:
    """``additional_config`` as vLLM's own CLI parsing builds it, plugin flag included."""
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    engine_args = EngineArgs.from_cli_args(parser.parse_args(["--model", str(model), *argv]))
    return dict(engine_args.additional_config)


def test_the_global_flag_becomes_the_server_default(make_loop: Any, model_dir: Path) -> None:
    additional = flag_config(model_dir, "--global-cache-hit-threshold", "0.5")
    assert additional == {"cache_hit_threshold": 0.5}
    loop = make_loop(additional_config=additional)
    loop.add("default", fresh_prompt(PROMPT_LEN))
    loop.add("opt-out", fresh_prompt(PROMPT_LEN), extra_args={"cache_hit_threshold": 0.0})

    scheduled = loop.step()

    assert_rejected(loop, "default", "admission")
    assert scheduled == {"opt-out": PROMPT_LEN}


def test_the_flag_conflicting_with_additional_config_is_an_error(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="conflicts with --additional-config"):
        flag_config(
            model_dir, "--global-cache-hit-threshold", "0.5",
            "--additional-config", '{"cache_hit_threshold": 0.25}',
        )  # fmt: skip


def test_the_environment_default_is_the_lowest_precedence(
    make_loop: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDO_GLOBAL_CACHE_HIT_THRESHOLD", "0.5")
    loop = make_loop()
    loop.add("from-env", fresh_prompt(PROMPT_LEN))
    assert loop.step() == {}
    assert_rejected(loop, "from-env", "admission")
    overridden = make_loop(additional_config={"cache_hit_threshold": 0.0})
    overridden.add("from-config", fresh_prompt(PROMPT_LEN))
    assert overridden.step() == {"from-config": PROMPT_LEN}


def openai_params(request_cls: Any, body: dict[str, Any]) -> Any:
    """The SamplingParams vLLM's OpenAI server builds from a request body."""
    request = request_cls.model_validate({"model": "tiny", **body})
    return request.to_sampling_params(max_tokens=8, default_sampling_params={})


@pytest.mark.parametrize(
    ("request_cls", "body"),
    [
        (CompletionRequest, {"prompt": "x", "cache_hit_threshold": 0.0}),
        (CompletionRequest, {"prompt": "x", "vllm_xargs": {"cache_hit_threshold": 0}}),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": "x"}], "cache_hit_threshold": 0},
        ),
    ],
    ids=["completions", "completions-vllm_xargs", "chat"],
)
def test_a_request_body_overrides_the_server_default(
    make_loop: Any, request_cls: Any, body: dict[str, Any]
) -> None:
    params = openai_params(request_cls, body)
    assert params.extra_args["cache_hit_threshold"] == 0.0
    loop = make_loop(additional_config={"cache_hit_threshold": 0.8})
    loop.add("cold-but-allowed", fresh_prompt(PROMPT_LEN), sampling_params=params)
    assert loop.step() == {"cold-but-allowed": PROMPT_LEN}


def test_a_request_body_threshold_applies_without_a_server_default(make_loop: Any) -> None:
    params = openai_params(CompletionRequest, {"prompt": "x", "cache_hit_threshold": 0.3})
    loop = make_loop()
    loop.add("strict", fresh_prompt(PROMPT_LEN), sampling_params=params)
    assert loop.step() == {}
    assert_rejected(loop, "strict", "admission")


@pytest.mark.parametrize("value", [1.5, -0.1, "high", True])
def test_a_bad_request_value_is_a_validation_error(value: object) -> None:
    with pytest.raises(VLLMValidationError, match="cache_hit_threshold"):
        openai_params(CompletionRequest, {"prompt": "x", "cache_hit_threshold": value})
