"""vLLM general plugin: the RFC 24256 cache-hit threshold for vLLM 0.32 (v1 engine).

Installed with this package, it registers the entry point
``vllm.general_plugins: pd_orchestrator_threshold``; vLLM calls :func:`register` in
every process it starts (API server, engine core, workers).

Surface:

* Server default: the flag ``--global-cache-hit-threshold X`` (added to vLLM's own
  parser), or ``--additional-config '{"cache_hit_threshold": X}'``, or the
  environment variable ``PDO_GLOBAL_CACHE_HIT_THRESHOLD`` (lowest precedence).
  Default 0 (disabled).
* Per request: the body field ``cache_hit_threshold`` (0..1) on
  ``/v1/completions`` and ``/v1/chat/completions`` (or
  ``vllm_xargs.cache_hit_threshold``) overrides the server default; values outside
  ``[0, 1]`` answer 400. Ignored for prefill requests carrying
  ``kv_transfer_params.do_remote_decode``.
* Rejection: HTTP 200, ``finish_reason: "cache_threshold"``, zero completion tokens
  on admission; a preempted request found below its threshold when resumed
  returns the tokens it generated so far with the same finish reason.
* Metric: ``vllm:cache_threshold_rejections_total{model_name, engine, phase}``.

The decision logic lives in :mod:`.policy` (no vLLM import); :mod:`._scheduler`
and :mod:`._frontend` patch vLLM and are imported only by :func:`register`.
"""

from __future__ import annotations

import logging

from pd_orchestrator.vllm_plugin.policy import (
    FINISH_REASON,
    SUPPORTED_VLLM_VERSION,
    UnsupportedVLLMVersionError,
    check_vllm_version,
)

__all__ = [
    "FINISH_REASON",
    "SUPPORTED_VLLM_VERSION",
    "UnsupportedVLLMVersionError",
    "register",
]

_log = logging.getLogger("pd_orchestrator.vllm_plugin")


def register() -> None:
    """vLLM's plugin hook: check the vLLM version, then install the patches.

    Raises :class:`UnsupportedVLLMVersionError` (which stops vLLM) on any vLLM
    other than 0.32.0. Safe to call more than once.
    """
    import vllm

    check_vllm_version(vllm.__version__)
    from pd_orchestrator.vllm_plugin import _frontend, _scheduler

    _scheduler.install()
    _frontend.install()
    _log.debug("pd-orchestrator cache-hit threshold plugin registered")
