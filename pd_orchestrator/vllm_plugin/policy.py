"""The plugin's decisions, free of vLLM: threshold resolution, hit ratio, its errors.

Everything here is pure so it is unit-tested without vLLM installed, and shared by
every supported vLLM release (:mod:`.versions` holds what differs between them);
the modules that patch vLLM (:mod:`._scheduler`, :mod:`._frontend`) call into it.

Contracts:

* A threshold is a float in ``[0, 1]``; 0 disables the check.
* Resolution: the request's ``cache_hit_threshold`` if it set one, else the server
  default; a prefill request (``kv_transfer_params.do_remote_decode`` true) always
  gets 0, whatever it asked for.
* Hit ratio = cached tokens / tokens to compute, where cached tokens are the local
  prefix-cache hit plus what the KV connector can load, and tokens to compute are
  the prompt (prompt + output tokens for a preempted request being resumed). An
  empty sequence counts as fully cached (ratio 1.0): there is nothing to compute.
* A request is rejected when ``threshold > 0`` and ``ratio < threshold``.
* Admission only: a request that sets ``cache_hit_admission_only`` true (the body or
  ``vllm_xargs``) is checked when first admitted only; once admitted, a preempted
  request is recomputed as stock vLLM does and never rejected (handed back). The
  gateway sets it on requests a continuation could not honour (tools, structured
  outputs, logprobs).
* Resume: a continuation of a structured output (the gateway resubmits prompt +
  output tokens after a hand-back) sets ``cache_hit_resume_tokens`` to the number of
  trailing prompt tokens that are output already generated. Before the request's
  first new token, its structured-output grammar is advanced over them, once, so
  the continued answer is constrained exactly as the uninterrupted one would be. A
  count that is not an integer >= 0 is a validation error; one above the prompt's
  length, or tokens the grammar rejects, finish the request with an error.
* Only full blocks are cached, and vLLM always recomputes the last token, so the
  best reachable ratio is ``floor((n - 1) / block_size) * block_size / n``
  (:func:`max_hit_ratio`): a threshold above it rejects even a fully warm prompt.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from typing import TypeVar

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "ADMISSION_ONLY_KEY",
    "ENV_GLOBAL_THRESHOLD",
    "EXTRA_ARGS_KEY",
    "FINISH_REASON",
    "RESUME_KEY",
    "InvalidThresholdError",
    "Phase",
    "PluginContractError",
    "UnsupportedVLLMVersionError",
    "below_threshold",
    "global_threshold",
    "hit_ratio",
    "is_remote_decode_prefill",
    "max_hit_ratio",
    "parse_count",
    "parse_flag",
    "parse_threshold",
    "phase_of_stop_reason",
    "request_admission_only",
    "request_resume_tokens",
    "request_threshold",
    "resolve_threshold",
    "stop_reason_for",
    "with_flag_threshold",
]

#: The OpenAI ``finish_reason`` of a rejected request (RFC 24256).
FINISH_REASON = "cache_threshold"

#: Key of the request field, and of its copy in ``SamplingParams.extra_args``.
EXTRA_ARGS_KEY = "cache_hit_threshold"

#: Key of the admission-only request field, and of its copy in ``SamplingParams.extra_args``.
ADMISSION_ONLY_KEY = "cache_hit_admission_only"

#: Key of the resume request field (output tokens at the prompt's end), and of its copy
#: in ``SamplingParams.extra_args``.
RESUME_KEY = "cache_hit_resume_tokens"

#: Environment variable holding the server-wide default threshold.
ENV_GLOBAL_THRESHOLD = "PDO_GLOBAL_CACHE_HIT_THRESHOLD"

#: Key of the server-wide default in ``--additional-config``.
ADDITIONAL_CONFIG_KEY = "cache_hit_threshold"

_STOP_REASON_PREFIX = FINISH_REASON + ":"


class UnsupportedVLLMVersionError(RuntimeError):
    """The installed vLLM is not a release this plugin supports (see :mod:`.versions`)."""


class PluginContractError(RuntimeError):
    """The installed vLLM no longer has the shape the plugin's patches rely on."""


class InvalidThresholdError(ValueError):
    """A threshold that is not a number within ``[0, 1]``, a flag that is not a
    boolean, or a token count that is not an integer >= 0."""


class Phase(enum.StrEnum):
    """Where a rejection happened: on first admission or when resuming a preempted request."""

    ADMISSION = "admission"
    PREEMPTION = "preemption"


def parse_threshold(value: object, source: str) -> float | None:
    """Validate a threshold from ``source`` (named in errors); ``None`` means unset.

    Accepts ints, floats and numeric strings (environment variables) within
    ``[0, 1]``; rejects booleans, NaN and anything else with
    :class:`InvalidThresholdError`.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidThresholdError(f"{source} must be a number in [0, 1], got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise InvalidThresholdError(
                f"{source} must be a number in [0, 1], got {value!r}"
            ) from None
    if not isinstance(value, int | float):
        raise InvalidThresholdError(f"{source} must be a number in [0, 1], got {value!r}")
    number = float(value)
    if math.isnan(number) or not 0.0 <= number <= 1.0:
        raise InvalidThresholdError(f"{source} must be within [0, 1], got {value!r}")
    return number


_FLAG_WORDS = {"true": True, "false": False}


def parse_flag(value: object, source: str) -> bool | None:
    """Validate a boolean setting from ``source`` (named in errors); ``None`` means unset.

    Accepts booleans, and for ``vllm_xargs`` (whose values vLLM may coerce) the ints
    0 and 1 and the strings ``"true"`` and ``"false"``; anything else raises
    :class:`InvalidThresholdError`.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _FLAG_WORDS:
        return _FLAG_WORDS[value.lower()]
    raise InvalidThresholdError(f"{source} must be true or false, got {value!r}")


def parse_count(value: object, source: str) -> int | None:
    """Validate a token count from ``source`` (named in errors); ``None`` means unset.

    Accepts integers >= 0, and for ``vllm_xargs`` strings of digits; rejects
    booleans, floats, negatives and anything else with :class:`InvalidThresholdError`.
    """
    if value is None:
        return None
    if isinstance(value, str) and value.isdecimal():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidThresholdError(f"{source} must be an integer >= 0, got {value!r}")
    return value


def global_threshold(additional_config: object, environ: Mapping[str, str]) -> float:
    """The server-wide default threshold.

    ``additional_config`` (vLLM's ``--additional-config`` JSON) key
    ``cache_hit_threshold`` wins over the ``PDO_GLOBAL_CACHE_HIT_THRESHOLD``
    environment variable; neither set means 0 (disabled). Invalid values raise.
    """
    if isinstance(additional_config, Mapping):
        configured = parse_threshold(
            additional_config.get(ADDITIONAL_CONFIG_KEY),
            f"--additional-config {ADDITIONAL_CONFIG_KEY}",
        )
        if configured is not None:
            return configured
    from_env = parse_threshold(environ.get(ENV_GLOBAL_THRESHOLD) or None, ENV_GLOBAL_THRESHOLD)
    return 0.0 if from_env is None else from_env


def is_remote_decode_prefill(kv_transfer_params: object) -> bool:
    """Whether a request is a P/D prefill (``kv_transfer_params.do_remote_decode`` true)."""
    return isinstance(kv_transfer_params, Mapping) and bool(
        kv_transfer_params.get("do_remote_decode")
    )


def resolve_threshold(
    request_value: float | None, global_value: float, *, remote_decode_prefill: bool
) -> float:
    """The threshold that applies to one request (see the module docstring)."""
    if remote_decode_prefill:
        return 0.0
    return global_value if request_value is None else request_value


def hit_ratio(hit_tokens: int, num_tokens: int) -> float:
    """Cached share of the tokens to compute; 1.0 for an empty sequence."""
    if num_tokens <= 0:
        return 1.0
    return min(max(hit_tokens, 0), num_tokens) / num_tokens


def below_threshold(hit_tokens: int, num_tokens: int, threshold: float) -> bool:
    """Whether a request with this hit must be rejected (never when ``threshold`` is 0)."""
    return threshold > 0.0 and hit_ratio(hit_tokens, num_tokens) < threshold


def max_hit_ratio(num_tokens: int, block_size: int) -> float:
    """Best ratio a fully cached sequence of ``num_tokens`` can reach with this block size.

    Only full blocks are cached, and the last token is always recomputed, so at
    most ``floor((n - 1) / block_size)`` blocks hit. A sequence of at most one
    block can therefore never hit (ratio 0.0); an empty one has ratio 1.0.
    """
    if block_size < 1:
        raise ValueError("block size must be >= 1")
    if num_tokens <= 0:
        return 1.0
    return (num_tokens - 1) // block_size * block_size / num_tokens


def stop_reason_for(phase: Phase) -> str:
    """The internal stop reason the scheduler sets on a rejected request."""
    return _STOP_REASON_PREFIX + phase.value


def phase_of_stop_reason(stop_reason: object) -> Phase | None:
    """The phase encoded by :func:`stop_reason_for`, or ``None`` for any other stop reason."""
    if not isinstance(stop_reason, str) or not stop_reason.startswith(_STOP_REASON_PREFIX):
        return None
    try:
        return Phase(stop_reason.removeprefix(_STOP_REASON_PREFIX))
    except ValueError:
        return None


T = TypeVar("T")


def _request_field(
    key: str,
    parse: Callable[[object, str], T | None],
    body_extra: Mapping[str, object] | None,
    extra_args: Mapping[str, object] | None,
) -> T | None:
    """Field ``key`` of an OpenAI request read with ``parse``: the body's (its fields
    unknown to vLLM, ``body_extra``) wins over ``vllm_xargs``' (``extra_args``, as
    vLLM built them); ``None`` when neither sets it. Errors name where it was read."""
    if body_extra is not None and body_extra.get(key) is not None:
        return parse(body_extra[key], key)
    if extra_args is not None:
        return parse(extra_args.get(key), f"vllm_xargs.{key}")
    return None


def request_threshold(
    body_extra: Mapping[str, object] | None, extra_args: Mapping[str, object] | None
) -> float | None:
    """The per-request threshold of an OpenAI request, or ``None`` when it sets none.

    ``body_extra`` holds the request body's fields unknown to vLLM (where a
    top-level ``cache_hit_threshold`` lands); ``extra_args`` is what vLLM built from
    ``vllm_xargs``. The top-level field wins. Invalid values raise
    :class:`InvalidThresholdError`.
    """
    return _request_field(EXTRA_ARGS_KEY, parse_threshold, body_extra, extra_args)


def request_admission_only(
    body_extra: Mapping[str, object] | None, extra_args: Mapping[str, object] | None
) -> bool | None:
    """The request's ``cache_hit_admission_only`` (the body's, else ``vllm_xargs``'),
    or ``None`` when it sets none; invalid values raise :class:`InvalidThresholdError`."""
    return _request_field(ADMISSION_ONLY_KEY, parse_flag, body_extra, extra_args)


def request_resume_tokens(
    body_extra: Mapping[str, object] | None, extra_args: Mapping[str, object] | None
) -> int | None:
    """The request's ``cache_hit_resume_tokens`` (the body's, else ``vllm_xargs'``),
    or ``None`` when it sets none; invalid values raise :class:`InvalidThresholdError`."""
    return _request_field(RESUME_KEY, parse_count, body_extra, extra_args)


def with_flag_threshold(additional_config: object, flag_value: float) -> dict[str, object]:
    """``additional_config`` with ``--global-cache-hit-threshold`` merged in.

    Raises :class:`InvalidThresholdError` when ``--additional-config`` already sets
    a different ``cache_hit_threshold`` (two sources disagreeing is a mistake).
    """
    merged: dict[str, object] = (
        dict(additional_config) if isinstance(additional_config, Mapping) else {}
    )
    existing = parse_threshold(
        merged.get(ADDITIONAL_CONFIG_KEY), f"--additional-config {ADDITIONAL_CONFIG_KEY}"
    )
    if existing is not None and existing != flag_value:
        raise InvalidThresholdError(
            f"--global-cache-hit-threshold {flag_value} conflicts with --additional-config "
            f"{ADDITIONAL_CONFIG_KEY}={existing}; set one of them"
        )
    merged[ADDITIONAL_CONFIG_KEY] = flag_value
    return merged
