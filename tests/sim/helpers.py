"""Virtual-time driving of a simulator engine for tests."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pd_orchestrator.model.hardware import get_profile
from pd_orchestrator.sim.engine import (
    Engine,
    EngineConfig,
    EngineRequest,
    FinishReason,
    HeldTransfer,
    SamplingSpec,
)
from pd_orchestrator.sim.tokenizer import SimTokenizer

TOK = SimTokenizer()


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    cached: int = 0
    external: int = 0
    transfer: HeldTransfer | None = None
    first_token_at: float | None = None
    finished_at: float | None = None


def make_engine(profile: str = "instant", **overrides: object) -> Engine:
    settings: dict[str, object] = {"block_size": 4, "num_kv_blocks": 256, "kv_connector": "nixl"}
    settings.update(overrides)
    config = EngineConfig(profile=get_profile(profile), model="m", **settings)  # type: ignore[arg-type]
    return Engine(config)


def request(
    rid: str,
    prompt: str | list[int],
    max_tokens: int = 8,
    *,
    ignore_eos: bool = True,
    **fields: object,
) -> EngineRequest:
    ids = TOK.encode(prompt) if isinstance(prompt, str) else prompt
    sampling = SamplingSpec(max_tokens=max_tokens, ignore_eos=ignore_eos)
    return EngineRequest(rid, ids, sampling, **fields)  # type: ignore[arg-type]


def run(engine: Engine, requests: Iterable[EngineRequest], now: float = 0.0) -> dict[str, Result]:
    """Add ``requests`` together and step until the engine is idle."""
    results: dict[str, Result] = {}
    for req in requests:
        engine.add_request(req)
        results[req.request_id] = Result()
    steps = 0
    while engine.has_work():
        step = engine.step(now)
        now += step.duration
        steps += 1
        assert steps < 100_000, "engine did not drain"
        for out in step.outputs:
            res = results[out.request_id]
            if out.new_token_ids and res.first_token_at is None:
                res.first_token_at = now
            res.tokens += out.new_token_ids
            if out.finished:
                res.finish_reason = out.finish_reason
                res.cached = out.num_cached_tokens
                res.external = out.num_external_tokens
                res.transfer = out.transfer
                res.finished_at = now
    return results
