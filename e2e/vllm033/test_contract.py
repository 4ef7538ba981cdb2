"""The plugin's contract with vLLM 0.33: the shape its hook needs, and every patch in place.

``conftest.py`` has already loaded the plugin through its entry point.
"""

from __future__ import annotations

import inspect
from importlib.metadata import distribution, entry_points

import pytest
import vllm
from conftest import PLUGIN_NAME
from vllm.config import SchedulerConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.output_processor import RequestState
from vllm.v1.metrics.loggers import PrometheusStatLogger

import pd_orchestrator
from pd_orchestrator.vllm_plugin import register
from pd_orchestrator.vllm_plugin._scheduler import check_contract
from pd_orchestrator.vllm_plugin.policy import PluginContractError
from pd_orchestrator.vllm_plugin.versions import HOOKS, hook_for

pytestmark = pytest.mark.timeout(120)


def test_this_is_the_vllm_0_33_wheel_and_the_installed_plugin() -> None:
    assert vllm.__version__ == "0.33.0"
    assert distribution("vllm").version == "0.33.0"
    assert hook_for(vllm.__version__) is HOOKS["0.33.0"]
    # The copy installed in this venv, not the clone's sources.
    assert "site-packages" in pd_orchestrator.__file__


def test_the_entry_point_is_registered() -> None:
    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == PLUGIN_NAME]
    assert entry.value == "pd_orchestrator.vllm_plugin:register"


def test_the_scheduler_has_the_shape_the_0_33_hook_relies_on() -> None:
    check_contract()
    check_contract(HOOKS["0.33.0"])


def test_the_0_32_hook_does_not_fit_0_33() -> None:
    with pytest.raises(PluginContractError, match=r"_get_local_prefix_cache_hit\(request\)"):
        check_contract(HOOKS["0.32.0"])


def test_the_hit_count_the_hook_receives_is_the_encoder_cache_count() -> None:
    """0.33 calls _ec_transfer_pending twice in the waiting loop: with
    ``ec_computed_tokens`` for a request with nothing computed (the plugin's
    check), with ``num_computed_tokens`` for one whose KV already arrived."""
    source = inspect.getsource(Scheduler.schedule)
    calls = [line.strip() for line in source.splitlines() if "self._ec_transfer_pending(" in line]
    assert calls == [
        "if self._ec_transfer_pending(request, ec_computed_tokens):",
        "if self._ec_transfer_pending(request, num_computed_tokens):",
    ]


@pytest.mark.parametrize(
    ("async_scheduling", "base"),
    [(False, Scheduler), (True, AsyncScheduler)],
    ids=["Scheduler", "AsyncScheduler"],
)
def test_get_scheduler_cls_returns_the_threshold_subclass(
    async_scheduling: bool, base: type
) -> None:
    config = SchedulerConfig(
        max_model_len=512, is_encoder_decoder=False, async_scheduling=async_scheduling
    )
    cls = config.get_scheduler_cls()
    assert cls.__name__ == f"CacheThreshold{base.__name__}"
    assert cls.__mro__[1] is base


def test_every_api_server_patch_is_applied_and_register_is_idempotent() -> None:
    register()
    wrapped = [
        EngineArgs.add_cli_args,
        CompletionRequest.to_sampling_params,
        ChatCompletionRequest.to_sampling_params,
        RequestState._new_completion_output,
        PrometheusStatLogger.__init__,
    ]
    assert all(getattr(f, "_pdo_wrapped", False) for f in wrapped)
    assert not getattr(CompletionRequest.to_sampling_params.__wrapped__, "_pdo_wrapped", False)


def test_the_stream_generators_are_left_alone_on_0_33() -> None:
    """vLLM 0.33 sends the final chunk of a choice finished without a token."""
    assert not getattr(OpenAIServingCompletion.completion_stream_generator, "_pdo_wrapped", False)
    assert not getattr(OpenAIServingChat.chat_completion_stream_generator, "_pdo_wrapped", False)
    completion = inspect.getsource(OpenAIServingCompletion.completion_stream_generator)
    assert "and finish_reason is None" in completion
    chat = inspect.getsource(OpenAIServingChat.chat_completion_stream_generator_raw)
    assert "and output.finish_reason is None" in chat
