"""Built-in scorers: ``queue-depth``, ``kv-usage`` and ``hardware-weight``.

Each returns one score per candidate, higher meaning better. They already stay
within [0, 1]; the engine clamps regardless and applies the configured weight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pd_orchestrator.model.load import Candidate
from pd_orchestrator.model.records import record
from pd_orchestrator.routing.interfaces import PluginContext
from pd_orchestrator.routing.plugin_params import HardwareWeightParams, KvUsageParams
from pd_orchestrator.routing.registry import SCORER, NoParams, PluginType
from pd_orchestrator.routing.types import RoutingRequest

__all__ = [
    "HARDWARE_WEIGHT",
    "KV_USAGE",
    "QUEUE_DEPTH",
    "HardwareWeightParams",
    "HardwareWeightScorer",
    "KvUsageParams",
    "KvUsageScorer",
    "QueueDepthScorer",
    "queue_depth",
]


def queue_depth(candidate: Candidate) -> int:
    """Requests on the candidate: its reading's running + waiting, or the gateway's
    own in-flight count when that is larger (a reading is up to a poll old, and a
    burst sent since must count) or when there is no reading."""
    if candidate.load is None:
        return candidate.in_flight
    return max(candidate.load.queue_depth, candidate.in_flight)


@record
class QueueDepthScorer:
    """``queue-depth``: fewer queued requests score higher.

    Scores are min-max normalised over the candidates: ``(deepest - depth) /
    (deepest - shallowest)`` with the depth of :func:`queue_depth`, so the
    shallowest scores 1 and the deepest 0; all equal score 1. No parameters.
    """

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Sequence[float]:
        depths = [queue_depth(c) for c in candidates]
        if not depths:
            return []
        shallowest, deepest = min(depths), max(depths)
        if deepest == shallowest:
            return [1.0] * len(depths)
        return [(deepest - depth) / (deepest - shallowest) for depth in depths]


@record
class KvUsageScorer:
    """``kv-usage``: lower KV-cache usage scores higher: ``1 - kv_usage``.

    A candidate without a load reading scores ``missing`` (see :class:`KvUsageParams`).
    """

    missing: float

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Sequence[float]:
        return [self.missing if c.load is None else 1.0 - c.load.kv_usage for c in candidates]


@record
class HardwareWeightScorer:
    """``hardware-weight``: a fixed preference per hardware label.

    The score is the label's weight divided by the largest weight configured
    (``default`` included), so the preferred hardware scores 1 and scores stay
    within [0, 1] whatever the candidates; all-zero weights score 0.
    """

    weights: Mapping[str, float]
    default: float

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Sequence[float]:
        return [self.weights.get(c.endpoint.hardware, self.default) for c in candidates]


def _queue_depth(params: NoParams, context: PluginContext) -> QueueDepthScorer:
    return QueueDepthScorer()


def _kv_usage(params: KvUsageParams, context: PluginContext) -> KvUsageScorer:
    return KvUsageScorer(params.missing)


def _hardware_weight(params: HardwareWeightParams, context: PluginContext) -> HardwareWeightScorer:
    top = max([params.default, *params.weights.values()])
    if top == 0.0:
        return HardwareWeightScorer({}, 0.0)
    normalised = {label: weight / top for label, weight in params.weights.items()}
    return HardwareWeightScorer(normalised, params.default / top)


QUEUE_DEPTH = PluginType("queue-depth", SCORER, NoParams, _queue_depth)
KV_USAGE = PluginType("kv-usage", SCORER, KvUsageParams, _kv_usage)
HARDWARE_WEIGHT = PluginType("hardware-weight", SCORER, HardwareWeightParams, _hardware_weight)
