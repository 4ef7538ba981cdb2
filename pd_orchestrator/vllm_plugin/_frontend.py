"""API-server side: the CLI flag, the request field, the finish reason, streams, metrics.

Imported only inside vLLM (by :func:`pd_orchestrator.vllm_plugin.register`). Every
patch wraps a vLLM method (the same ones in 0.32 and 0.33 unless said) and calls
the original:

* ``EngineArgs.add_cli_args`` / ``EngineArgs.from_cli_args``: the
  ``--global-cache-hit-threshold`` flag. vLLM loads general plugins before it
  builds its argument parser, so the flag is a real flag; its value is merged into
  ``additional_config["cache_hit_threshold"]``, which reaches the engine process.
* ``CompletionRequest.to_sampling_params`` / ``ChatCompletionRequest.to_sampling_params``:
  copy the body's ``cache_hit_threshold`` (or ``vllm_xargs.cache_hit_threshold``)
  into ``SamplingParams.extra_args``; a value outside ``[0, 1]`` is a 400. The same
  for ``cache_hit_admission_only`` (true or false; anything else is a 400), stored
  only when true; and for ``cache_hit_resume_tokens`` (an integer >= 0).
* ``RequestState._new_completion_output``: an output the scheduler finished with a
  ``cache_threshold:<phase>`` stop reason gets ``finish_reason = "cache_threshold"``
  and no stop reason.
* vLLM 0.32 only: ``OpenAIServingCompletion.completion_stream_generator`` /
  ``OpenAIServingChat.chat_completion_stream_generator``: vLLM drops outputs that
  carry no token for a choice that has not streamed any, so a request rejected on
  admission would end with no choice at all. The wrapper watches the engine
  outputs and, for such a choice, emits a final chunk (completions: empty text;
  chat: empty delta, after vLLM's role chunk) with ``finish_reason:
  "cache_threshold"`` before the usage chunk and ``[DONE]``. vLLM 0.33 sends that
  chunk itself (its empty-chunk guards let a finished output through); the
  release's hook lists the guards, which are checked instead of patched.
* ``PrometheusStatLogger.__init__`` / ``.record``: the counter
  ``vllm:cache_threshold_rejections_total{model_name, engine, phase}``, created
  after vLLM has cleared its own ``vllm:`` collectors and incremented from the
  finished-request stats of the engine that finished the request; and the gauge
  ``vllm:cache_threshold_admission_only{model_name, engine}`` = 1, which tells a
  gateway scraping ``/metrics`` that this plugin honours ``cache_hit_admission_only``,
  and ``vllm:cache_threshold_resume{model_name, engine}`` = 1: it advances a
  structured output's grammar over ``cache_hit_resume_tokens``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import inspect
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from pd_orchestrator.vllm_plugin._contract import check_markers
from pd_orchestrator.vllm_plugin.policy import (
    ADMISSION_ONLY_KEY,
    EXTRA_ARGS_KEY,
    FINISH_REASON,
    RESUME_KEY,
    InvalidThresholdError,
    Phase,
    PluginContractError,
    parse_threshold,
    phase_of_stop_reason,
    request_admission_only,
    request_resume_tokens,
    request_threshold,
    with_flag_threshold,
)
from pd_orchestrator.vllm_plugin.versions import VLLMHook

__all__ = ["ADMISSION_ONLY_METRIC", "METRIC_NAME", "RESUME_METRIC", "install"]

METRIC_NAME = "vllm:cache_threshold_rejections"
ADMISSION_ONLY_METRIC = "vllm:cache_threshold_admission_only"
RESUME_METRIC = "vllm:cache_threshold_resume"
_FLAG = "--global-cache-hit-threshold"
_MAX_NOTED = 4096

_log = logging.getLogger("pd_orchestrator.vllm_plugin")


def _mark(function: Callable[..., Any]) -> Callable[..., Any]:
    function._pdo_wrapped = True  # type: ignore[attr-defined]
    return function


def _wrapped(function: object) -> bool:
    return bool(getattr(function, "_pdo_wrapped", False))


# --- CLI flag -----------------------------------------------------------------------


def _flag_value(text: str) -> float:
    try:
        value = parse_threshold(text, _FLAG)
    except InvalidThresholdError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert value is not None
    return value


def _install_cli() -> None:
    from vllm.engine.arg_utils import EngineArgs

    add_original = EngineArgs.add_cli_args
    if _wrapped(add_original):
        return

    def add_cli_args(parser: Any) -> Any:
        parser = add_original(parser)
        if _FLAG not in parser._option_string_actions:
            group = parser.add_argument_group("pd-orchestrator cache-hit threshold")
            group.add_argument(
                _FLAG,
                type=_flag_value,
                default=None,
                help="Server-wide minimum share of prompt tokens served from the prefix "
                "cache or the KV connector (0..1; 0 disables). Requests below it finish "
                "with finish_reason 'cache_threshold'. A request's cache_hit_threshold "
                "field overrides it. Same as --additional-config "
                "'{\"cache_hit_threshold\": X}'.",
            )
        return parser

    from_original = EngineArgs.from_cli_args.__func__

    def from_cli_args(cls: Any, args: argparse.Namespace) -> Any:
        engine_args = from_original(cls, args)
        value = getattr(args, "global_cache_hit_threshold", None)
        if value is not None:
            engine_args.additional_config = with_flag_threshold(
                engine_args.additional_config, value
            )
        return engine_args

    EngineArgs.add_cli_args = staticmethod(_mark(add_cli_args))
    EngineArgs.from_cli_args = classmethod(from_cli_args)


# --- request field ------------------------------------------------------------------


def _wrap_to_sampling_params(request_cls: Any) -> None:
    original = request_cls.to_sampling_params
    if _wrapped(original):
        return

    @functools.wraps(original)
    def to_sampling_params(self: Any, *args: Any, **kwargs: Any) -> Any:
        params = original(self, *args, **kwargs)
        extra: dict[str, Any] = {}
        for key, read in _REQUEST_FIELDS:
            try:
                value = read(self.model_extra, params.extra_args)
            except InvalidThresholdError as exc:
                from vllm.exceptions import VLLMValidationError

                raise VLLMValidationError(
                    str(exc), parameter=key, value=_raw_value(self, params, key)
                ) from None
            if value is not None and value is not False:
                extra[key] = value
        if extra:
            params.extra_args = {**(params.extra_args or {}), **extra}
        return params

    request_cls.to_sampling_params = _mark(to_sampling_params)


_REQUEST_FIELDS: tuple[tuple[str, Callable[[Any, Any], object]], ...] = (
    (EXTRA_ARGS_KEY, request_threshold),
    (ADMISSION_ONLY_KEY, request_admission_only),
    (RESUME_KEY, request_resume_tokens),
)
"""The plugin's request fields, each with its reader (body first, then ``vllm_xargs``)."""


def _raw_value(request: Any, params: Any, key: str) -> object:
    extra = request.model_extra or {}
    if extra.get(key) is not None:
        return extra[key]
    return (params.extra_args or {}).get(key)


def _install_request_fields() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    _wrap_to_sampling_params(CompletionRequest)
    _wrap_to_sampling_params(ChatCompletionRequest)


# --- finish reason and rejection bookkeeping ------------------------------------------


class _NotedRejections:
    """Rejections seen by the output processor, until the stats logger counts them."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._phases: collections.OrderedDict[str, list[Phase]] = collections.OrderedDict()

    def note(self, request_id: str, phase: Phase) -> None:
        self._phases.setdefault(request_id, []).append(phase)
        while len(self._phases) > self._limit:
            self._phases.popitem(last=False)

    def take(self, request_id: str | None) -> Phase | None:
        if request_id is None:
            return None
        phases = self._phases.get(request_id)
        if not phases:
            return None
        phase = phases.pop(0)
        if not phases:
            del self._phases[request_id]
        return phase


_NOTED = _NotedRejections(_MAX_NOTED)


def _install_finish_reason() -> None:
    from vllm.v1.engine.output_processor import RequestState

    original = RequestState._new_completion_output
    if _wrapped(original):
        return

    @functools.wraps(original)
    def _new_completion_output(
        self: Any, token_ids: Any, finish_reason: Any, stop_reason: Any
    ) -> Any:
        output = original(self, token_ids, finish_reason, stop_reason)
        phase = phase_of_stop_reason(stop_reason)
        if phase is not None and output.finish_reason is not None:
            output.finish_reason = FINISH_REASON
            output.stop_reason = None
            _NOTED.note(self.external_req_id, phase)
        return output

    RequestState._new_completion_output = _mark(_new_completion_output)


# --- streams ------------------------------------------------------------------------


class _StreamWatch:
    """Tracks, per choice, whether anything was streamed; queues the missing finish chunks.

    A chunk is queued when an output finishes with ``cache_threshold`` for a choice
    that has produced no text and no token. It becomes ready to send only once the
    stream generator asks for the next engine output, i.e. after it has written
    whatever it writes for the current one (the chat role chunk comes first).
    """

    def __init__(self, make_chunk: Callable[[int, Any, Any], str], skip: bool) -> None:
        self._make_chunk = make_chunk
        self._skip = skip
        self._produced: set[tuple[int, int]] = set()
        self._observed: list[str] = []
        self._ready: list[str] = []

    def observe(self, prompt_index: int, result: Any) -> None:
        for output in result.outputs:
            key = (prompt_index, output.index)
            if output.token_ids or output.text:
                self._produced.add(key)
            elif (
                output.finish_reason == FINISH_REASON
                and key not in self._produced
                and not self._skip
            ):
                self._observed.append(self._make_chunk(prompt_index, output, result))

    def release(self) -> None:
        self._ready.extend(self._observed)
        self._observed.clear()

    def take_ready(self) -> list[str]:
        ready, self._ready = self._ready, []
        return ready

    async def tap(self, source: AsyncIterator[Any], keyed: bool) -> AsyncGenerator[Any, None]:
        iterator = aiter(source)
        while True:
            self.release()
            try:
                item = await anext(iterator)
            except StopAsyncIteration:
                return
            prompt_index, result = item if keyed else (0, item)
            self.observe(prompt_index, result)
            yield item


def _wrap_stream(
    serving_cls: Any,
    method: str,
    keyed: bool,
    make_watch: Callable[[inspect.BoundArguments], _StreamWatch],
    needs: tuple[str, ...],
) -> None:
    original = getattr(serving_cls, method)
    if _wrapped(original):
        return
    signature = inspect.signature(original)
    missing = [name for name in needs if name not in signature.parameters]
    if missing:
        raise PluginContractError(
            f"vLLM's {serving_cls.__name__}.{method}() has no parameter(s) {missing}; "
            f"the cache-hit threshold plugin does not support this vLLM build"
        )

    @functools.wraps(original)
    async def stream(*args: Any, **kwargs: Any) -> AsyncGenerator[str, None]:
        bound = signature.bind(*args, **kwargs)
        watch = make_watch(bound)
        tap = watch.tap(bound.arguments["result_generator"], keyed)
        bound.arguments["result_generator"] = tap
        try:
            async with contextlib.aclosing(original(*bound.args, **bound.kwargs)) as inner:
                async for data in inner:
                    for extra in watch.take_ready():
                        yield extra
                    yield data
        finally:
            await tap.aclose()

    setattr(serving_cls, method, _mark(stream))


def _completion_watch(bound: inspect.BoundArguments) -> _StreamWatch:
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionResponseStreamChoice,
        CompletionStreamResponse,
    )

    arguments = bound.arguments
    request = arguments["request"]
    num_choices = 1 if request.n is None else request.n

    def make_chunk(prompt_index: int, output: Any, result: Any) -> str:
        with_ids = bool(request.return_token_ids)
        choice = CompletionResponseStreamChoice(
            index=output.index + prompt_index * num_choices,
            text="",
            logprobs=None,
            finish_reason=FINISH_REASON,
            stop_reason=None,
            prompt_token_ids=list(result.prompt_token_ids or []) if with_ids else None,
            token_ids=[] if with_ids else None,
        )
        chunk = CompletionStreamResponse(
            id=arguments["request_id"],
            object="text_completion",
            created=arguments["created_time"],
            model=arguments["model_name"],
            choices=[choice],
        )
        return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"

    # With echo, vLLM writes a chunk (the prompt) even for an empty output.
    return _StreamWatch(make_chunk, skip=bool(request.echo))


def _chat_watch(bound: inspect.BoundArguments) -> _StreamWatch:
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
        DeltaMessage,
    )

    arguments = bound.arguments
    request = arguments["request"]
    created = int(time.time())

    def make_chunk(prompt_index: int, output: Any, result: Any) -> str:
        choice = ChatCompletionResponseStreamChoice(
            index=output.index,
            delta=DeltaMessage(),
            logprobs=None,
            finish_reason=FINISH_REASON,
            stop_reason=None,
            token_ids=[] if request.return_token_ids else None,
        )
        chunk = ChatCompletionStreamResponse(
            id=arguments["request_id"],
            object="chat.completion.chunk",
            created=created,
            model=arguments["model_name"],
            choices=[choice],
        )
        return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"

    return _StreamWatch(make_chunk, skip=False)


def _install_streams(hook: VLLMHook) -> None:
    if hook.native_empty_finish_chunk:
        for spec in hook.stream_guards:
            check_markers(spec, hook)
        return
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    _wrap_stream(
        OpenAIServingCompletion,
        "completion_stream_generator",
        True,
        _completion_watch,
        ("request", "result_generator", "request_id", "created_time", "model_name"),
    )
    _wrap_stream(
        OpenAIServingChat,
        "chat_completion_stream_generator",
        False,
        _chat_watch,
        ("request", "result_generator", "request_id", "model_name"),
    )


# --- metrics ------------------------------------------------------------------------


_CAPABILITIES = (
    (
        ADMISSION_ONLY_METRIC,
        "1: this server's cache-hit threshold plugin honours cache_hit_admission_only "
        "(checked at admission only, never at preemption).",
    ),
    (
        RESUME_METRIC,
        "1: this server's cache-hit threshold plugin honours cache_hit_resume_tokens "
        "(a structured output's grammar is advanced over the resumed output tokens).",
    ),
)
"""The plugin's capability gauges (name, help), each 1 per engine."""
_OUR_METRICS = (METRIC_NAME, *(name for name, _ in _CAPABILITIES))


def _install_metrics() -> None:
    from prometheus_client import REGISTRY, Counter, Gauge
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    init_original = PrometheusStatLogger.__init__
    if _wrapped(init_original):
        return
    record_original = PrometheusStatLogger.record
    record_signature = inspect.signature(record_original)

    @functools.wraps(init_original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init_original(self, *args, **kwargs)
        # vLLM has just unregistered every "vllm:" collector; a second logger in the
        # same process (tests) may still find ours registered.
        for collector in list(REGISTRY._collector_to_names):
            if getattr(collector, "_name", None) in _OUR_METRICS:
                REGISTRY.unregister(collector)
        for name, meaning in _CAPABILITIES:
            supported = Gauge(name, meaning, labelnames=["model_name", "engine"])
            for values in self.per_engine_labelvalues.values():
                supported.labels(*[str(v) for v in values]).set(1)
        counter = Counter(
            METRIC_NAME,
            "Requests finished with finish_reason cache_threshold, by phase "
            "(admission: a new request below its threshold; preemption: a preempted "
            "request below its threshold when resumed).",
            labelnames=["model_name", "engine", "phase"],
        )
        self._pdo_rejections = {
            engine: {
                phase: counter.labels(*[str(v) for v in values], phase.value) for phase in Phase
            }
            for engine, values in self.per_engine_labelvalues.items()
        }

    @functools.wraps(record_original)
    def record(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = record_original(self, *args, **kwargs)
        bound = record_signature.bind(self, *args, **kwargs)
        iteration_stats = bound.arguments.get("iteration_stats")
        engine = bound.arguments.get("engine_idx", 0)
        per_phase = getattr(self, "_pdo_rejections", {}).get(engine)
        if iteration_stats is not None and per_phase is not None:
            for finished in iteration_stats.finished_requests:
                phase = _NOTED.take(finished.request_id)
                if phase is not None:
                    per_phase[phase].inc()
        return result

    PrometheusStatLogger.__init__ = _mark(__init__)
    PrometheusStatLogger.record = record


def install(hook: VLLMHook) -> None:
    """Apply every API-server patch ``hook``'s release needs.

    Idempotent; harmless in engine and worker processes.
    """
    _install_cli()
    _install_request_fields()
    _install_finish_reason()
    _install_streams(hook)
    _install_metrics()
    _log.debug("cache-hit threshold API patches installed")
