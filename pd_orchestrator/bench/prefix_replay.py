"""Prefix-routing replays in virtual time (pure: no I/O beyond reading a trace).

A fleet of simulated decoders (:class:`~pd_orchestrator.sim.engine.Engine`, stepped
by a discrete-event loop in virtual time) serves a workload routed by a decode
profile. At each arrival the profile ranks the decoders from fresh load readings
(running, waiting, KV usage); the request goes to the pick and the profile
observes the decision. For the precise router every engine records its cache
events, which go through the wire codec (encode, then decode) into the precise
index after each step, as a live subscriber would receive them.

Measured per router (:class:`ReplayResult`): the token hit rate (prompt tokens the
chosen decoder had cached at admission / all prompt tokens), the share of
requests of the busiest decoder against the fair share, how often a follow-up turn
went to the decoder of the previous turn, decision times (CPU time of the thread
around ``Profile.run``, which other processes on a shared machine do not inflate)
and the memory of the router's state. :func:`global_hit_rate` is
the bound: one infinite cache shared by all decoders.

Workloads: :func:`mooncake_workload` turns the Mooncake conversation trace into
token prompts (each 512-token hash block becomes ``block_tokens`` tokens derived
from its id) and :func:`shared_prefix_workload` builds groups of users sharing a
system prompt, each user holding a multi-turn conversation.
"""

from __future__ import annotations

import heapq
import json
import random
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pd_orchestrator.config.routing import RoutingConfig
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.hardware import get_profile
from pd_orchestrator.model.load import Candidate, LoadSnapshot
from pd_orchestrator.model.records import record
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.prefix.codec import EventBatch, decode_batch, encode_batch
from pd_orchestrator.prefix.hashing import VllmBlockHasher
from pd_orchestrator.prefix.index import PreciseIndex
from pd_orchestrator.routing.engine import Profile
from pd_orchestrator.routing.profiles import build_profile
from pd_orchestrator.routing.types import RoutingRequest
from pd_orchestrator.sim.engine import Engine, EngineConfig, EngineRequest, SamplingSpec
from pd_orchestrator.sim.kv_events import wire_events
from pd_orchestrator.sim.tokenizer import NUM_WORDS, WORD_BASE, SimTokenizer

__all__ = [
    "ROUTERS",
    "FleetSpec",
    "ReplayResult",
    "TraceRequest",
    "global_hit_rate",
    "mooncake_workload",
    "replay",
    "shared_prefix_workload",
]

MODEL = "sim-model"

# Decode profiles of the compared routers (the ``routing.decode`` YAML shape).
ROUTERS: dict[str, dict[str, Any]] = {
    "round-robin": {"scorers": []},
    "least-loaded": {"scorers": [{"type": "queue-depth"}]},
    "approximate": {
        "scorers": [
            {"type": "approximate-prefix", "weight": 3},
            {"type": "queue-depth", "weight": 2},
            {"type": "kv-usage", "weight": 2},
        ]
    },
    "precise": {
        "scorers": [
            {"type": "precise-prefix", "weight": 3},
            {"type": "kv-usage", "weight": 2},
        ]
    },
    "precise-any-match": {
        "scorers": [
            {"type": "precise-prefix", "weight": 3, "params": {"min_match_ratio": 0.0}},
            {"type": "kv-usage", "weight": 2},
        ]
    },
    "precise+queue": {
        "scorers": [
            {"type": "precise-prefix", "weight": 3},
            {"type": "kv-usage", "weight": 2},
            {"type": "queue-depth", "weight": 2},
        ]
    },
    "affinity": {"scorers": [{"type": "prefix-affinity"}]},
}


@record
class TraceRequest:
    """One request of a workload: arrival (seconds), prompt tokens and text, output
    length and the conversation it belongs to (``turn`` counts from 0)."""

    arrival: float
    tokens: tuple[int, ...]
    text: str
    output_tokens: int
    conversation: str
    turn: int = 0


@record
class FleetSpec:
    """The simulated decoders: count, latency profile, KV capacity and block size."""

    decoders: int = 4
    profile: str = "h200-llama3-8b"
    kv_tokens: int = 50_000
    block_size: int = 16
    max_num_seqs: int = 256


@record
class ReplayResult:
    """What one router achieved on one workload; see the module docstring."""

    router: str
    requests: int
    hit_rate: float
    max_share: float
    fair_share: float
    sticky: float
    decision_p50: float
    decision_p99: float
    memory_bytes: int
    per_decoder: tuple[int, ...]
    virtual_seconds: float


def _block_tokens(block_id: int, count: int, salt: str) -> list[int]:
    rng = random.Random(f"{salt}:{block_id}")
    return [WORD_BASE + rng.randrange(NUM_WORDS) for _ in range(count)]


def _texted(tokens: list[int], tokenizer: SimTokenizer) -> tuple[tuple[int, ...], str]:
    return tuple(tokens), tokenizer.decode(tokens)


def mooncake_workload(
    path: Path,
    *,
    limit: int,
    block_tokens: int = 32,
    time_scale: float = 1.0,
    max_output: int = 64,
) -> list[TraceRequest]:
    """The first ``limit`` requests of a Mooncake trace, scaled down.

    Hash block ``b`` becomes ``block_tokens`` word tokens drawn from ``b``; input
    and output lengths shrink by ``512 / block_tokens`` (output at most
    ``max_output``); arrivals are divided by ``time_scale``. Requests whose first
    hash block they share count as one conversation.
    """
    scale = 512 / block_tokens
    tokenizer = SimTokenizer()
    workload: list[TraceRequest] = []
    seen_first: dict[int, int] = {}
    with path.open() as lines:
        for line in lines:
            if len(workload) >= limit:
                break
            row = json.loads(line)
            length = max(1, round(row["input_length"] / scale))
            tokens: list[int] = []
            for block in row["hash_ids"]:
                tokens += _block_tokens(block, block_tokens, "mooncake")
            ids = row["hash_ids"]
            key = ids[1] if len(ids) > 1 else ids[0]  # the first block is a shared preamble
            turn = seen_first.get(key, -1) + 1
            seen_first[key] = turn
            prompt, text = _texted(tokens[:length], tokenizer)
            workload.append(
                TraceRequest(
                    arrival=row["timestamp"] / 1000 / time_scale,
                    tokens=prompt,
                    text=text,
                    output_tokens=max(1, min(max_output, round(row["output_length"] / scale))),
                    conversation=f"c{key}",
                    turn=turn,
                )
            )
    return workload


def shared_prefix_workload(
    *,
    groups: int = 8,
    users: int = 12,
    turns: int = 3,
    system_tokens: tuple[int, int] = (2000, 6000),
    question_tokens: tuple[int, int] = (256, 1200),
    answer_tokens: int = 48,
    rate: float = 8.0,
    think_seconds: float = 20.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """``groups`` x ``users`` conversations of ``turns`` turns; every user of a group
    shares the group's system prompt. Conversations start as a Poisson process of
    ``rate`` per second; turns follow after exponential think times. A follow-up
    prompt is the previous prompt, an answer of ``answer_tokens`` and a new question."""
    rng = random.Random(seed)
    tokenizer = SimTokenizer()

    def words(count: int) -> list[int]:
        return [WORD_BASE + rng.randrange(NUM_WORDS) for _ in range(count)]

    systems = [words(rng.randint(*system_tokens)) for _ in range(groups)]
    workload: list[TraceRequest] = []
    start = 0.0
    for user in rng.sample(range(groups * users), groups * users):
        group = user % groups
        start += rng.expovariate(rate)
        arrival, history = start, list(systems[group])
        for turn in range(turns):
            history += words(rng.randint(*question_tokens))
            prompt, text = _texted(history, tokenizer)
            workload.append(
                TraceRequest(arrival, prompt, text, answer_tokens, f"g{group}u{user}", turn)
            )
            history += words(answer_tokens)
            arrival += rng.expovariate(1 / think_seconds)
    workload.sort(key=lambda r: r.arrival)
    return workload


def global_hit_rate(workload: Iterable[TraceRequest], block_size: int) -> float:
    """Hit rate of one infinite prefix cache shared by every decoder (full blocks,
    at most ``len(prompt) - 1`` tokens, like an engine's admission)."""
    hasher = VllmBlockHasher(block_size)
    seen: set[bytes] = set()
    hits = total = 0
    for request in workload:
        hashes = hasher.block_hashes(request.tokens)
        cap = (len(request.tokens) - 1) // block_size
        held = next((i for i, h in enumerate(hashes[:cap]) if h not in seen), min(cap, len(hashes)))
        hits += held * block_size
        total += len(request.tokens)
        seen.update(hashes)
    return hits / total if total else 0.0


@dataclass
class _Fleet:
    engines: list[Engine]
    endpoints: list[Endpoint]
    index: PreciseIndex | None
    next_step: list[float | None] = field(default_factory=list)

    def candidates(self, now: float) -> list[Candidate]:
        return [
            Candidate(
                endpoint,
                in_flight=engine.num_running + engine.num_waiting,
                load=LoadSnapshot(engine.num_running, engine.num_waiting, engine.pool.usage, now),
            )
            for endpoint, engine in zip(self.endpoints, self.engines, strict=True)
        ]

    def step(self, i: int, now: float) -> list[tuple[str, int]]:
        """Step engine ``i``; returns ``(request id, cached tokens)`` of first outputs."""
        engine = self.engines[i]
        result = engine.step(now)
        self._publish(i)
        self.next_step[i] = now + max(result.duration, 1e-4) if engine.has_work() else None
        return [(o.request_id, o.num_cached_tokens) for o in result.outputs]

    def _publish(self, i: int) -> None:
        pool = self.engines[i].pool
        if self.index is None or not pool.events:
            return
        events, pool.events = pool.events, []
        payload = encode_batch(EventBatch(0.0, wire_events(events)))
        self.index.apply(self.endpoints[i].name, decode_batch(payload))


def _fleet(spec: FleetSpec, precise: bool) -> _Fleet:
    config = EngineConfig(
        profile=get_profile(spec.profile),
        model=MODEL,
        block_size=spec.block_size,
        num_kv_blocks=spec.kv_tokens // spec.block_size,
        max_num_seqs=spec.max_num_seqs,
        record_events=precise,
    )
    engines = [Engine(config) for _ in range(spec.decoders)]
    endpoints = [
        Endpoint(f"d{i}", f"http://d{i}:8000", Role.DECODE, "h200", MODEL)
        for i in range(spec.decoders)
    ]
    index = PreciseIndex(VllmBlockHasher(spec.block_size)) if precise else None
    return _Fleet(engines, endpoints, index, [None] * spec.decoders)


def _profile(router: Mapping[str, Any], index: PreciseIndex | None) -> Profile:
    config = RoutingConfig.model_validate({"decode": router})
    return build_profile("decode", config.decode, builtin_registry(index))


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _memory(profile: Profile) -> int:
    total = 0
    for plugin in profile.plugins():
        size = getattr(plugin, "memory_bytes", None)
        if callable(size):
            total += int(size())
    return total


def replay(
    workload: Sequence[TraceRequest], name: str, router: Mapping[str, Any], fleet: FleetSpec
) -> ReplayResult:
    """Serve ``workload`` on a simulated fleet routed by ``router``; see the module
    docstring. Deterministic for a given workload, router and fleet."""
    precise = any(s.get("type") == "precise-prefix" for s in router.get("scorers", []))
    sim = _fleet(fleet, precise)
    profile = _profile(router, sim.index)
    steps: list[tuple[float, int]] = []
    prompt_tokens: dict[str, int] = {}
    cached: dict[str, int] = {}
    routed = [0] * fleet.decoders
    decisions: list[float] = []
    last_decoder: dict[str, int] = {}
    sticky = follow_ups = 0
    now = 0.0
    for sequence, item in enumerate(workload):
        now = _advance(sim, steps, item.arrival, cached, prompt_tokens)
        request = RoutingRequest(
            Role.DECODE, now, model=MODEL, prompt=item.text, token_ids=item.tokens
        )
        request = replace(request, sequence=sequence)
        candidates = sim.candidates(now)
        started = time.thread_time()
        result = profile.run(request, candidates)
        decisions.append(time.thread_time() - started)
        chosen = int(result.endpoints[0].name[1:])
        profile.observe(request, result.endpoints[0])
        routed[chosen] += 1
        if item.turn > 0 and item.conversation in last_decoder:
            follow_ups += 1
            sticky += last_decoder[item.conversation] == chosen
        last_decoder[item.conversation] = chosen
        request_id = f"r{sequence}"
        prompt_tokens[request_id] = len(item.tokens)
        sampling = SamplingSpec(max_tokens=item.output_tokens, ignore_eos=True)
        sim.engines[chosen].add_request(EngineRequest(request_id, item.tokens, sampling))
        if sim.next_step[chosen] is None:
            sim.next_step[chosen] = now
            heapq.heappush(steps, (now, chosen))
    now = _advance(sim, steps, float("inf"), cached, prompt_tokens)
    total = sum(prompt_tokens.values())
    return ReplayResult(
        router=name,
        requests=len(workload),
        hit_rate=sum(cached.values()) / total if total else 0.0,
        max_share=max(routed) / max(1, len(workload)),
        fair_share=1 / fleet.decoders,
        sticky=sticky / follow_ups if follow_ups else 0.0,
        decision_p50=statistics.median(decisions) if decisions else 0.0,
        decision_p99=_percentile(decisions, 0.99),
        memory_bytes=_memory(profile),
        per_decoder=tuple(routed),
        virtual_seconds=now,
    )


def _advance(
    sim: _Fleet,
    steps: list[tuple[float, int]],
    until: float,
    cached: dict[str, int],
    prompt_tokens: dict[str, int],
) -> float:
    """Run every engine step due before ``until``; returns the virtual time reached."""
    now = 0.0 if until == float("inf") else until
    while steps and steps[0][0] <= until:
        at, i = heapq.heappop(steps)
        if sim.next_step[i] != at:
            continue
        for request_id, cached_tokens in sim.step(i, at):
            if request_id in prompt_tokens and request_id not in cached:
                cached[request_id] = cached_tokens
        following = sim.next_step[i]
        if following is not None:
            heapq.heappush(steps, (following, i))
        now = max(now, at)
    return now
