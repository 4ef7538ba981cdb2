"""Builders of candidates and contexts for policy tests."""

from __future__ import annotations

from collections.abc import Sequence

from pd_orchestrator.config.policy import PolicySpec
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.load import Candidate, LoadSnapshot
from pd_orchestrator.policies import ThresholdContext, ThresholdPolicy, build_policy
from pd_orchestrator.policies.base import Given
from pd_orchestrator.policies.plugins import builtin_registry


def load(running: int = 0, waiting: int = 0, kv: float = 0.0, at: float = 0.0) -> LoadSnapshot:
    return LoadSnapshot(running=running, waiting=waiting, kv_usage=kv, observed_at=at)


def decoder(
    name: str = "d0",
    *,
    pool: str = "decode",
    in_flight: int = 0,
    reading: LoadSnapshot | None = None,
    healthy: bool = True,
    backlog: int = 0,
) -> Candidate:
    endpoint = Endpoint(name, f"http://{name}:8000", Role.DECODE, "h200", pool=pool)
    return Candidate(endpoint, healthy, in_flight, reading, backlog)


def prefiller(
    name: str = "p0",
    *,
    in_flight: int = 0,
    reading: LoadSnapshot | None = None,
    healthy: bool = True,
    backlog: int = 0,
    role: Role = Role.PREFILL,
    spill: bool = False,
) -> Candidate:
    endpoint = Endpoint(name, f"http://{name}:8000", role, "h200", pool="prefill", spill=spill)
    return Candidate(endpoint, healthy, in_flight, reading, backlog)


IDLE_PREFILL = (prefiller(reading=load()),)


def context(
    *,
    tokens: int = 1000,
    model: str = "m",
    dec: Candidate | None = None,
    prefillers: Sequence[Candidate] = IDLE_PREFILL,
    client: float | None = None,
    now: float = 0.0,
    peers: Sequence[Candidate] = (),
    cached: int | None = None,
) -> ThresholdContext:
    chosen = dec or decoder()
    held = {} if cached is None else {chosen.endpoint.name: cached}
    return ThresholdContext(
        model=model,
        decoder=chosen,
        prompt_tokens=tokens,
        prompt_chars=4 * tokens,
        client_threshold=client,
        now=now,
        reads=Given(tuple(prefillers), tuple(peers), held),
    )


def build(spec: dict[str, object]) -> ThresholdPolicy:
    """A policy built through the built-in registry from a YAML-shaped spec."""
    return build_policy(builtin_registry(), PolicySpec.model_validate(spec), "threshold.policy")
