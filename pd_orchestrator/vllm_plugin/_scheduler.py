"""Engine-core side: the cache-hit threshold mixed into vLLM's v1 scheduler.

Imported only inside vLLM (by :func:`pd_orchestrator.vllm_plugin.register`).

How it hooks in (vLLM 0.32 and 0.33; :mod:`.versions` has what differs):

* ``SchedulerConfig.get_scheduler_cls`` is wrapped: whatever class vLLM picked
  (``AsyncScheduler`` on GPU, ``Scheduler`` on CPU, or a ``--scheduler-cls``) is
  returned as a subclass built by :func:`threshold_scheduler`, so no flag is needed.
* Admission: ``Scheduler.schedule()`` calls ``_ec_transfer_pending(request, n)``
  for a waiting request once the local prefix-cache hit and the KV connector's
  loadable tokens are summed and before any block is allocated; returning True
  makes ``schedule()`` skip the request for this step. ``n`` is that sum in 0.32
  (``num_computed_tokens``) and the same less a bounded sliding-window replay in
  0.33 (``ec_computed_tokens``). Both also call it for a waiting request whose KV
  has already arrived (``num_computed_tokens > 0``), which the subclass leaves
  alone: it only checks requests with nothing computed. The subclass answers True
  for a request below its threshold and records it. This is a private method
  meant for encoder transfers:
  :func:`check_contract` verifies the shape of ``schedule()`` against the release's
  hook when the class is built, and the e2e suites run it too.
* After ``schedule()`` returns, recorded requests (back in the waiting queue) are
  finished with ``FINISHED_ABORTED`` and a stop reason naming the phase
  (``cache_threshold:admission`` or ``cache_threshold:preemption``); their outputs
  (no new tokens) ride on the next ``update_from_output``. The API-server side
  (:mod:`._frontend`) turns that stop reason into ``finish_reason:
  "cache_threshold"``: vLLM's ``FinishReason`` is an IntEnum checked across the
  process boundary, so no new value can be added.
* Preemption: ``_preempt_request`` puts the request back in ``waiting`` with
  ``num_computed_tokens = 0`` and status ``PREEMPTED``, so resuming goes through
  the same hook, with prompt + output tokens as the denominator. The output tokens
  already produced stay with the request and are returned with the rejection. A
  request sent admission-only (``cache_hit_admission_only``) is never rejected
  there: it resumes as stock vLLM resumes it, recomputing what it lost.

* Resume: the first time the hook sees a request with nothing computed and keeps
  it, a request whose ``cache_hit_resume_tokens`` is n > 0 and that uses a
  structured output has its grammar advanced over the prompt's last n tokens
  (``StructuredOutputManager.accept_tokens``, as ``update_from_output`` advances it
  over each step's new tokens; it also handles a reasoning parser's end). The
  request only reaches the hook once its grammar is compiled (``schedule()``
  handles ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`` first) and before any token is
  sampled for it. Done once per request (a preempted request keeps its advanced
  grammar, as stock vLLM does). An n above the prompt's length, or tokens the
  grammar rejects, finish the request with ``FINISHED_ERROR`` instead of
  scheduling it.

Semantics: the check runs at every scheduling attempt of a request that has
nothing computed yet (as the project's simulator does), so a request that waits
for memory while other requests evict its cached blocks can be rejected later.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from pd_orchestrator.vllm_plugin._contract import check_markers, resolve
from pd_orchestrator.vllm_plugin.policy import (
    ADMISSION_ONLY_KEY,
    EXTRA_ARGS_KEY,
    RESUME_KEY,
    InvalidThresholdError,
    Phase,
    PluginContractError,
    below_threshold,
    global_threshold,
    is_remote_decode_prefill,
    parse_threshold,
    resolve_threshold,
    stop_reason_for,
)
from pd_orchestrator.vllm_plugin.versions import VLLMHook, hook_for

__all__ = [
    "PluginContractError",
    "ThresholdGate",
    "check_contract",
    "install",
    "threshold_scheduler",
]

_log = logging.getLogger("pd_orchestrator.vllm_plugin")


class ThresholdGate:
    """Per-scheduler threshold state: the server default and the requests to reject."""

    def __init__(self, default_threshold: float) -> None:
        self.default_threshold = default_threshold
        self._rejected: dict[str, Phase] = {}
        self._failed: list[str] = []

    def threshold_for(self, request: Any) -> float:
        """The threshold of one engine request (see :func:`policy.resolve_threshold`)."""
        params = getattr(request, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        try:
            own = parse_threshold(extra.get(EXTRA_ARGS_KEY), EXTRA_ARGS_KEY)
        except InvalidThresholdError as exc:
            _log.warning("request %s: %s; using the server default", request.request_id, exc)
            own = None
        return resolve_threshold(
            own,
            self.default_threshold,
            remote_decode_prefill=is_remote_decode_prefill(request.kv_transfer_params),
        )

    def rejects(self, request: Any, num_cached_tokens: int) -> bool:
        """Whether ``request`` (nothing computed yet) is below its threshold; records it.
        A preempted admission-only request is never rejected."""
        resumed = request.status == RequestStatus.PREEMPTED
        if resumed and _admission_only(request):
            return False
        threshold = self.threshold_for(request)
        if not below_threshold(num_cached_tokens, request.num_tokens, threshold):
            return False
        self._rejected[request.request_id] = Phase.PREEMPTION if resumed else Phase.ADMISSION
        _log.debug(
            "request %s rejected (%s): %d/%d cached, threshold %.3f",
            request.request_id,
            self._rejected[request.request_id].value,
            num_cached_tokens,
            request.num_tokens,
            threshold,
        )
        return True

    def take_rejected(self) -> dict[str, Phase]:
        """The requests recorded since the last call."""
        rejected, self._rejected = self._rejected, {}
        return rejected

    def resume(self, request: Any, manager: Any) -> bool:
        """Advance ``request``'s grammar over its resumed output tokens (see the module
        docstring), once; False (and recorded as failed) when they cannot be."""
        if getattr(request, "_pdo_resumed", False):
            return True
        request._pdo_resumed = True
        count = _resume_tokens(request)
        if not count or not request.use_structured_output:
            return True
        prompt = request.prompt_token_ids or []
        if count > len(prompt) or not manager.accept_tokens(request, list(prompt[-count:])):
            _log.error(
                "request %s: the grammar cannot take its %d resumed tokens; finishing it",
                request.request_id,
                count,
            )
            self._failed.append(request.request_id)
            return False
        return True

    def take_failed(self) -> list[str]:
        """The requests whose resume failed since the last call."""
        failed, self._failed = self._failed, []
        return failed


def _admission_only(request: Any) -> bool:
    """Whether the front end marked ``request`` admission-only (it validated the value)."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    return extra.get(ADMISSION_ONLY_KEY) is True


def _resume_tokens(request: Any) -> int:
    """The request's ``cache_hit_resume_tokens`` (the front end validated it), else 0."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    value = extra.get(RESUME_KEY)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _finish_rejected(scheduler: Any) -> None:
    """Finish the requests the gate recorded during ``schedule()``; stash their outputs."""
    gate = scheduler._pdo_gate
    failed = gate.take_failed()
    if failed:
        _stash(scheduler, scheduler.finish_requests(failed, RequestStatus.FINISHED_ERROR), {})
    rejected = gate.take_rejected()
    if rejected:
        finished = scheduler.finish_requests(list(rejected), RequestStatus.FINISHED_ABORTED)
        _stash(scheduler, finished, rejected)


def _stash(scheduler: Any, finished: Any, rejected: dict[str, Phase]) -> None:
    """Stash the outputs of requests finished outside a step (a rejection's stop reason
    names its phase)."""
    for request in finished:
        phase = rejected.get(request.request_id)
        scheduler._pdo_outputs.append(
            (
                request.client_index,
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    stop_reason=None if phase is None else stop_reason_for(phase),
                    events=request.take_events(),
                    trace_headers=request.trace_headers,
                ),
            )
        )


def _merge_outputs(outputs: dict[int, Any], stashed: list[tuple[int, Any]]) -> dict[int, Any]:
    for client_index, output in stashed:
        per_client = outputs.get(client_index)
        if per_client is None:
            outputs[client_index] = EngineCoreOutputs(outputs=[output])
        else:
            per_client.outputs.append(output)
    return outputs


@functools.cache
def threshold_scheduler(base: type[Any], hook: VLLMHook) -> type[Any]:
    """A subclass of the scheduler class ``base`` with the cache-hit threshold.

    Raises :class:`PluginContractError` unless the installed scheduler has the shape
    ``hook`` (the installed release's) was verified on.
    """
    check_contract(hook)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        default = global_threshold(self.vllm_config.additional_config, os.environ)
        self._pdo_gate = ThresholdGate(default)
        self._pdo_outputs = []
        _log.info("cache-hit threshold active; server default %.3f", default)

    def _ec_transfer_pending(self: Any, request: Any, num_computed_tokens: int) -> bool:
        # num_computed_tokens: the hit the waiting loop computed (hook.hit_argument)
        # for a request with nothing computed; its KV-arrived call passes through.
        if request.num_computed_tokens == 0:
            gate = self._pdo_gate
            if gate.rejects(request, num_computed_tokens):
                return True
            if not gate.resume(request, self.structured_output_manager):
                return True
        return bool(base._ec_transfer_pending(self, request, num_computed_tokens))

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = base.schedule(self, *args, **kwargs)
        _finish_rejected(self)
        return output

    def update_from_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        outputs = base.update_from_output(self, *args, **kwargs)
        stashed, self._pdo_outputs = self._pdo_outputs, []
        return _merge_outputs(outputs, stashed) if stashed else outputs

    members = {
        "__init__": __init__,
        "__module__": __name__,
        "__doc__": f"{base.__name__} with the RFC 24256 cache-hit threshold.",
        "_ec_transfer_pending": _ec_transfer_pending,
        "schedule": schedule,
        "update_from_output": update_from_output,
    }
    return type(f"CacheThreshold{base.__name__}", (base,), members)


def check_contract(hook: VLLMHook | None = None) -> None:
    """Raise :class:`PluginContractError` unless vLLM's scheduler has the shape ``hook`` needs.

    ``hook`` defaults to the installed vLLM's (an unsupported version raises
    :class:`~.policy.UnsupportedVLLMVersionError`). Checked, in the release's own
    terms (:mod:`.versions`): in ``Scheduler.schedule()``, for a waiting request
    with nothing computed, the local hit lookup, then the connector's matched
    tokens, then their sum, then the ``_ec_transfer_pending`` call whose True
    answer skips the request, all before the waiting request's ``allocate_slots``;
    skipped requests are put back in ``waiting``; ``_preempt_request`` marks
    ``PREEMPTED`` and resets ``num_computed_tokens``; ``finish_requests``,
    ``update_from_output`` and ``_ec_transfer_pending`` exist, and so does
    ``StructuredOutputManager.accept_tokens``.
    """
    if hook is None:
        import vllm

        hook = hook_for(vllm.__version__)
    for spec in hook.scheduler:
        check_markers(spec, hook)
    scheduler = resolve("vllm.v1.core.sched.scheduler", "Scheduler")
    for name in ("finish_requests", "update_from_output", "_ec_transfer_pending"):
        if not callable(getattr(scheduler, name, None)):
            raise PluginContractError(f"vLLM's Scheduler has no method {name}()")
    manager = resolve("vllm.v1.structured_output", "StructuredOutputManager")
    if not callable(getattr(manager, "accept_tokens", None)):
        raise PluginContractError("vLLM's StructuredOutputManager has no method accept_tokens()")


def install(hook: VLLMHook) -> None:
    """Wrap ``SchedulerConfig.get_scheduler_cls`` for ``hook``'s release (idempotent)."""
    from vllm.config.scheduler import SchedulerConfig

    original = SchedulerConfig.get_scheduler_cls
    if getattr(original, "_pdo_wrapped", False):
        return

    @functools.wraps(original)
    def get_scheduler_cls(self: Any) -> type[Any]:
        return threshold_scheduler(original(self), hook)

    get_scheduler_cls._pdo_wrapped = True  # type: ignore[attr-defined]
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls
