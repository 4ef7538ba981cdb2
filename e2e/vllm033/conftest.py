"""The plugin on vLLM 0.33's own scheduler and output processor, inside the vLLM 0.33 venv.

This suite runs with the python of the cached venv that ``e2e/vllm_cpu/build-env.sh
e2e/vllm033`` builds (the vllm 0.33.0 wheel, CPU torch, no CUDA packages), from
``make plugin-vllm033``; the project's own pytest does not collect it. The plugin
is the copy installed in that venv (a wheel of this clone), loaded through its
``vllm.general_plugins`` entry point as vLLM loads it.

No model runs: a :class:`Loop` drives the scheduler the way vLLM's engine core
does -- ``schedule()``, a model-runner output, ``update_from_output()`` -- with
a stand-in sampler that returns fixed token ids, and hands the engine outputs to
vLLM's ``OutputProcessor`` as the API server does. The scheduler and the model
config are built the way vLLM 0.33's ``tests/v1/core/utils.py`` builds them
(``SchedulerConfig``, ``CacheConfig``, ``ModelConfig``, ``VllmConfig``, a
one-group ``KVCacheConfig`` of full-attention blocks), over the project's tiny
Llama (``PDO_E2E_VLLM_MODEL``, built by ``e2e/vllm_cpu/tiny_model.py``), but the
scheduler class comes from ``SchedulerConfig.get_scheduler_cls()``, as in the
engine core, so it is the plugin's subclass.
"""

from __future__ import annotations

import itertools
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

# Before vLLM is imported: its CPU platform, no hub, a private cache.
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.pop("PDO_GLOBAL_CACHE_HIT_THRESHOLD", None)

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
PLUGIN_NAME = "pd_orchestrator_threshold"


def load_plugin() -> None:
    """Call the plugin's registered entry point, as vLLM's plugin loader does."""
    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == PLUGIN_NAME]
    entry.load()()


load_plugin()

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.tokenizers import cached_tokenizer_from_config  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest  # noqa: E402
from vllm.v1.engine.output_processor import OutputProcessor  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.metrics.loggers import PrometheusStatLogger  # noqa: E402
from vllm.v1.metrics.stats import IterationStats  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

init_none_hash(sha256)
BLOCK_HASHER = get_request_block_hasher(BLOCK_SIZE, sha256)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    value = os.environ.get("PDO_E2E_VLLM_MODEL")
    if not value:
        pytest.fail("PDO_E2E_VLLM_MODEL is not set (run `make plugin-vllm033`)")
    path = Path(value)
    if not (path / "config.json").is_file():
        pytest.fail(f"PDO_E2E_VLLM_MODEL={path} holds no config.json")
    return path


@pytest.fixture(scope="session")
def model_config(model_dir: Path) -> ModelConfig:
    return ModelConfig(model=str(model_dir), dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def tokenizer(model_config: ModelConfig) -> Any:
    return cached_tokenizer_from_config(model_config)


def make_vllm_config(
    model_config: ModelConfig,
    *,
    additional_config: dict[str, Any] | None = None,
    async_scheduling: bool = False,
) -> VllmConfig:
    """A VllmConfig as vLLM's scheduler tests build it, prefix caching on."""
    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=MAX_MODEL_LEN,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
        is_encoder_decoder=model_config.is_encoder_decoder,
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    return VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        additional_config=additional_config or {},
    )


def make_scheduler(vllm_config: VllmConfig, num_blocks: int = 1000) -> Any:
    """The scheduler class the engine core would build (the plugin's subclass).

    ``num_blocks`` counts vLLM's reserved null block: ``num_blocks - 1`` are usable.
    """
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


_prompt_seeds = itertools.count(1)


def fresh_prompt(num_tokens: int) -> list[int]:
    """Token ids no other prompt of the session starts with (vocabulary 4096)."""
    seed = next(_prompt_seeds)
    return [(seed * 7919 + i * 31) % 4000 + 50 for i in range(num_tokens)]


def engine_core_request(
    request_id: str, prompt: list[int], params: SamplingParams
) -> EngineCoreRequest:
    """The request the API server hands the engine core."""
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        external_req_id=request_id,
    )


def detached_request(request_id: str, prompt: list[int], params: SamplingParams) -> Request:
    """An engine request no scheduler holds (to compare a scheduled one against)."""
    return Request.from_engine_core_request(
        engine_core_request(request_id, prompt, params), BLOCK_HASHER
    )


@dataclass
class Finished:
    """What one request ended with: the engine's last output and the API server's."""

    engine: EngineCoreOutput
    text_output: Any  # vllm.outputs.CompletionOutput of the final RequestOutput


@dataclass
class Loop:
    """vLLM's engine-core step with a stand-in model, plus the API server's output processor.

    Each step: ``schedule()``; every scheduled request whose prompt (plus outputs)
    is complete after this step samples the next token of a fixed sequence;
    ``update_from_output()``; the engine outputs go through ``OutputProcessor``,
    and its stats, with the scheduler's, into vLLM's Prometheus stat logger.
    """

    scheduler: Any
    processor: OutputProcessor
    stat_logger: PrometheusStatLogger
    delivered: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    finished: dict[str, Finished] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    scheduled: list[dict[str, int]] = field(default_factory=list)
    _tokens: Iterator[int] = field(default_factory=lambda: itertools.cycle(range(100, 160)))

    def add(
        self,
        request_id: str,
        prompt: list[int],
        *,
        max_tokens: int = 8,
        extra_args: dict[str, Any] | None = None,
        sampling_params: SamplingParams | None = None,
        before_add: Callable[[Request], None] | None = None,
    ) -> Request:
        """Submit a request to both sides, as the API server and the engine core do
        (``before_add``: what the engine core does to it first, e.g. start its grammar)."""
        params = sampling_params or SamplingParams(
            max_tokens=max_tokens, temperature=0.0, extra_args=extra_args
        )
        core_request = engine_core_request(request_id, prompt, params)
        self.processor.add_request(core_request, prompt=None)
        request = Request.from_engine_core_request(core_request, BLOCK_HASHER)
        if before_add is not None:
            before_add(request)
        self.scheduler.add_request(request)
        return request

    def step(self) -> dict[str, int]:
        """One engine step; returns the tokens scheduled per request."""
        output = self.scheduler.schedule()
        scheduled = dict(output.num_scheduled_tokens)
        self.scheduled.append(scheduled)
        self.preempted.extend(getattr(output, "preempted_req_ids", None) or ())
        req_ids = list(scheduled)
        sampled = [self._sample(req_id) for req_id in req_ids]
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        per_client = self.scheduler.update_from_output(output, runner_output)
        engine_outputs = [o for outputs in per_client.values() for o in outputs.outputs]
        iteration_stats = IterationStats()
        processed = self.processor.process_outputs(
            engine_outputs, time.monotonic(), iteration_stats
        )
        scheduler_stats = next(
            (o.scheduler_stats for o in per_client.values() if o.scheduler_stats), None
        )
        self.stat_logger.record(scheduler_stats, iteration_stats, engine_idx=0)
        finals = {r.request_id: r for r in processed.request_outputs if r.finished}
        for engine_output in engine_outputs:
            self.delivered[engine_output.request_id].extend(engine_output.new_token_ids)
            if engine_output.finish_reason is not None:
                final = finals[engine_output.request_id]
                self.finished[engine_output.request_id] = Finished(engine_output, final.outputs[0])
        return scheduled

    def _sample(self, req_id: str) -> list[int]:
        request = self.scheduler.requests[req_id]
        # A prefill chunk that stops short of the last known token samples nothing.
        return [] if request.is_prefill_chunk else [next(self._tokens)]

    def run(self, steps: int, until: Iterable[str] = ()) -> None:
        """Step until every request in ``until`` finished (at most ``steps`` steps)."""
        wanted = set(until)
        for _ in range(steps):
            if wanted and wanted <= set(self.finished):
                return
            self.step()
        if wanted and not wanted <= set(self.finished):
            raise AssertionError(f"not finished after {steps} steps: {wanted - set(self.finished)}")


@pytest.fixture
def make_loop(model_config: ModelConfig, tokenizer: Any) -> Any:
    """``make_loop(additional_config=..., num_blocks=..., async_scheduling=...)``."""

    def factory(
        *,
        additional_config: dict[str, Any] | None = None,
        num_blocks: int = 1000,
        async_scheduling: bool = False,
    ) -> Loop:
        vllm_config = make_vllm_config(
            model_config, additional_config=additional_config, async_scheduling=async_scheduling
        )
        scheduler = make_scheduler(vllm_config, num_blocks)
        processor = OutputProcessor(tokenizer, log_stats=True)
        return Loop(scheduler, processor, PrometheusStatLogger(vllm_config))

    return factory
