"""The plugin's contract with the installed vLLM, checked inside the vLLM venv.

These run the vLLM venv's python (``PDO_E2E_VLLM_PYTHON``) in a subprocess, from a
folder outside the clone so the installed copy of the plugin is the one imported.
They fail when vLLM's ``Scheduler.schedule()`` (or the other methods the plugin
wraps) changes shape, before any server is started.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(480)


def run_in_vllm(python: Path, code: str, cwd: Path) -> str:
    result = subprocess.run(
        [str(python), "-c", textwrap.dedent(code)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=420,  # importing vLLM on a busy 2-core machine is slow
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def test_scheduler_has_the_shape_the_plugin_relies_on(vllm_python: Path, tmp_path: Path) -> None:
    out = run_in_vllm(
        vllm_python,
        """
        from pd_orchestrator.vllm_plugin._scheduler import check_contract
        check_contract()
        print("contract ok")
        """,
        tmp_path,
    )
    assert "contract ok" in out


def test_entry_point_is_registered_and_wraps_both_scheduler_bases(
    vllm_python: Path, tmp_path: Path
) -> None:
    out = run_in_vllm(
        vllm_python,
        """
        from importlib.metadata import entry_points
        (ep,) = [e for e in entry_points(group="vllm.general_plugins")
                 if e.name == "pd_orchestrator_threshold"]
        ep.load()()
        from vllm.config import SchedulerConfig
        for async_scheduling in (False, True):
            config = SchedulerConfig(
                max_model_len=512, is_encoder_decoder=False, async_scheduling=async_scheduling
            )
            cls = config.get_scheduler_cls()
            print(cls.__name__, cls.__mro__[1].__name__)
        """,
        tmp_path,
    )
    assert "CacheThresholdScheduler Scheduler" in out
    assert "CacheThresholdAsyncScheduler AsyncScheduler" in out


def test_plugin_wraps_every_patched_method(vllm_python: Path, tmp_path: Path) -> None:
    out = run_in_vllm(
        vllm_python,
        """
        from pd_orchestrator.vllm_plugin import register
        register()
        register()  # idempotent
        from vllm.engine.arg_utils import EngineArgs
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
        from vllm.v1.engine.output_processor import RequestState
        from vllm.v1.metrics.loggers import PrometheusStatLogger
        import vllm
        from pd_orchestrator.vllm_plugin.versions import hook_for
        wrapped = [
            EngineArgs.add_cli_args,
            CompletionRequest.to_sampling_params,
            ChatCompletionRequest.to_sampling_params,
            RequestState._new_completion_output,
            PrometheusStatLogger.__init__,
        ]
        streams = [
            OpenAIServingCompletion.completion_stream_generator,
            OpenAIServingChat.chat_completion_stream_generator,
        ]
        # vLLM 0.32 needs the stream patch; from 0.33 vLLM sends the chunk itself.
        patched = not hook_for(vllm.__version__).native_empty_finish_chunk
        print(all(getattr(f, "_pdo_wrapped", False) for f in wrapped)
              and all(getattr(f, "_pdo_wrapped", False) == patched for f in streams))
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        args = parser.parse_args(["--global-cache-hit-threshold", "0.25"])
        print(EngineArgs.from_cli_args(args).additional_config)
        """,
        tmp_path,
    )
    lines = out.strip().splitlines()
    assert lines[-2] == "True"
    assert lines[-1] == "{'cache_hit_threshold': 0.25}"
