"""What the gateway reports about one answered request: its span's attributes and
its access-log line (both built only when tracing, or the access log, is on).

The access log (``logging.access_log``) writes one line per answered request on the
``pd_orchestrator.access`` logger, after its answer ended: method, route, status,
decision, decoder, prefiller and duration (the request id comes with every line);
in JSON the same as fields.
"""

from __future__ import annotations

import logging
from typing import Any

from pd_orchestrator.flows.flow import Flow
from pd_orchestrator.model.records import record
from pd_orchestrator.model.route import threshold_of
from pd_orchestrator.telemetry.logs import ACCESS_LOGGER

__all__ = ["Answered", "log_access", "span_attributes"]

access_logger = logging.getLogger(ACCESS_LOGGER)


@record
class Answered:
    """One answered request as the access log and the request span see it.

    ``flow`` is None when the request was refused before it had one (admission).
    """

    method: str
    route: str
    status: int
    flow: Flow | None
    error: str | None = None

    @property
    def decision(self) -> str:
        """``error`` for a failed answer, ``none`` for a route that decides nothing."""
        if self.status >= 400:
            return "error"
        return "none" if self.flow is None else self.flow.decision


def span_attributes(answered: Answered) -> dict[str, Any]:
    """The request span's attributes: decision, endpoints, threshold, tokens."""
    flow = answered.flow
    attributes: dict[str, Any] = {"pd.decision": answered.decision}
    if flow is None:
        return attributes
    request, plan, transcript = flow.request, flow.plan, flow.transcript
    attributes.update(
        {
            "pd.request_id": request.request_id,
            "gen_ai.request.model": request.model,
            "pd.decoder": flow.decoder.name,
            "pd.threshold": threshold_of(plan.route),
            "pd.threshold.policy": plan.route.policy,
            "pd.threshold.reason": plan.route.reason,
            "pd.handbacks": transcript.handbacks,
            "gen_ai.usage.output_tokens": transcript.completion_tokens,
        }
    )
    if flow.prefiller is not None:
        attributes["pd.prefiller"] = flow.prefiller.name
    if transcript.prompt_tokens is not None:
        attributes["gen_ai.usage.input_tokens"] = transcript.prompt_tokens
    return attributes


def log_access(answered: Answered, seconds: float) -> None:
    """Write the access-log line of ``answered`` (see the module docstring)."""
    flow = answered.flow
    decoder = flow.decoder.name if flow is not None else "-"
    prefiller = flow.prefiller.name if flow is not None and flow.prefiller is not None else "-"
    fields = {
        "method": answered.method,
        "route": answered.route,
        "status": answered.status,
        "decision": answered.decision,
        "decoder": decoder,
        "prefiller": prefiller,
        "duration": round(seconds, 6),
    }
    access_logger.info(
        "%s %s %d decision=%s decoder=%s prefiller=%s duration=%.3fs",
        answered.method,
        answered.route,
        answered.status,
        answered.decision,
        decoder,
        prefiller,
        seconds,
        extra={"fields": fields},
    )
