"""A virtual-time fleet: simulator engines, the routing pipeline and the threshold
policies, driven by an event loop instead of a clock.

One :class:`~pd_orchestrator.sim.engine.Engine` per instance, with its latency
profile. Events sit in a heap ordered by (time, sequence). An engine steps as the
HTTP simulator's runner steps it: a step starts when the engine has work, its
outputs are delivered ``duration`` later, and the next step starts then; requests
added meanwhile wait for that next step.

Flows (what the gateway does, in virtual time; ``hop`` is one HTTP leg's one-way
latency, the same for every leg). Every request is driven through the gateway's own
flow machine (:class:`~pd_orchestrator.flows.machine.FlowMachine`): what follows the
attempt, P/D or the decoder alone, each hand-back and what continues it are its
decisions, as in :class:`~pd_orchestrator.flows.flow.Flow`; this module only carries
them out on the engines (``_Flow``), so a change to the flow is made once:

* decode-first: the gateway's own planner
  (:class:`~pd_orchestrator.planner.plan.Planner`) plans each request -- decoder,
  compatible prefillers and the policy's threshold -- over candidates that carry load
  snapshots polled from the engines every ``load_interval`` and the flows' own
  in-flight counts (like the live scraper and fleet state); the attempt goes to the
  plan's decoder (at threshold 1, which no prompt meets, there is no attempt: straight
  to the prefiller, as the gateway does). Admitted: it is served there (``decode``).
  Rejected (``cache_threshold`` with no token): the plan's first prefiller for that
  decoder (the prefill profile, with the compatibility filter), or among those the
  one the strategy's system picks (:attr:`Strategy.prefill_pick`: Dynamo's KV-aware
  prefill router for the ``dynamo`` strategies, llm-d's prefix and queue scorers for
  ``llm-d``, vllm-router's ``cache_aware`` for ``always-pd``), which prefills with
  ``do_remote_decode`` and one output token and holds the KV; the decode leg goes
  to the decoder with threshold 0, which first pulls the KV (a side-channel round
  trip, then ``transfer_seconds`` of the tokens it lacks, as the HTTP simulator
  does) and decodes (``pd``). A request preempted on a decoder and rejected there
  after it produced tokens is handed back: prompt + generated tokens are prefilled
  and decoded again with the remaining ``max_tokens`` on the plan's decoder, as the
  gateway does (after ``handback.max_handbacks`` hand-backs, straight on the decoder
  with threshold 0). A decoder no prefiller can reach serves the request alone, as the
  gateway's ``upstream.prefill_fallback: local`` does. A finished request is fed back to the planner
  (:meth:`~pd_orchestrator.planner.plan.Planner.learn`), as the gateway does. With
  ``prefix_index`` on (the default), the planner's
  :class:`~pd_orchestrator.planner.plan.CachedPrefix` is what a gateway's precise
  prefix index, fed by the engines' KV events, would hold: each engine's prefix
  cache at the moment of planning (:class:`_KvIndex`; the events' delay is not
  modelled), or the leading blocks of the prompts in flight there before their
  first output, the more, as the gateway holds them pending
  (:class:`~pd_orchestrator.prefix.pending.PendingBlocks`).
* prefill-first (``always-pd``): a decoder and then a compatible prefiller are
  picked, then prefill and the decode leg as above (``pd``).
* spill: on a fleet whose prefill pool spills, a strategy whose policy has no spill
  rule of its own (every one but ``goodput``, whose policy sends :class:`Whole`)
  takes the bench's plain rule (:mod:`~pd_orchestrator.bench.spill`) after planning:
  when the plan's decoder is queued or crowded, the request is served whole, at
  threshold 0, on the least-loaded compatible spilling prefiller (``decode``; reason
  ``plain-spill:<why>``).
* decode-only: every instance is a decoder and the threshold is 0 (``decode``).

Not modelled: HTTP and gateway CPU time beyond the fixed ``hop`` (a real gateway
under load adds queueing), network contention between transfers (each transfer
gets the link's full bandwidth), the prefiller's discarded first token reaching
the client, failures, retries and health checks, streaming of the client's
response (tokens count as received ``hop`` after the step that made them).

Prompts are :class:`~pd_orchestrator.sim.digest.PromptDigest` built from the
workload's segments (:func:`~pd_orchestrator.bench.workloads.digest_segments`), so
no engine hashes or folds prompt tokens: the whole Mooncake trace replays over 16
instances in minutes on one core.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import time
from array import array
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field, replace
from functools import partial
from typing import assert_never

from pd_orchestrator.bench.belief import ProfileError
from pd_orchestrator.bench.fleet import FleetSpec, InstanceSpec
from pd_orchestrator.bench.prefill_picks import (
    PrefillLoad,
    PrefillPick,
    cache_aware_pick,
    dynamo_pick,
    llm_d_pick,
)
from pd_orchestrator.bench.results import RequestRecord, RunResult
from pd_orchestrator.bench.spill import SpillLoad, plain_spill
from pd_orchestrator.bench.strategies import Mode, Strategy
from pd_orchestrator.bench.workloads import (
    BenchRequest,
    Segment,
    Workload,
    content_key,
    digest_segments,
    materialize,
)
from pd_orchestrator.config.load import LoadConfig
from pd_orchestrator.config.settings import HandbackConfig, UpstreamConfig
from pd_orchestrator.flows.machine import (
    Alone,
    AtLimit,
    Done,
    FlowMachine,
    Serve,
    Step,
    ThroughPD,
    skips_attempt,
)
from pd_orchestrator.flows.request import TOKEN_ID_CHARS
from pd_orchestrator.flows.sink import GatewayError
from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.hit_window import HitWindow
from pd_orchestrator.model.load import Candidate, LoadSnapshot
from pd_orchestrator.model.records import record
from pd_orchestrator.model.route import Whole, threshold_of
from pd_orchestrator.planner.plan import (
    NoCandidateError,
    Plan,
    Planner,
    RequestFacts,
    Served,
    after_prefill,
    leg_seconds,
)
from pd_orchestrator.policies.calibration import Probe, Timed
from pd_orchestrator.policies.threshold import ThresholdResolver
from pd_orchestrator.prefix.pending import PendingBlocks
from pd_orchestrator.routing import RoutingProfiles
from pd_orchestrator.routing.types import RoutingRequest
from pd_orchestrator.sim.blocks import BlockHasher
from pd_orchestrator.sim.digest import PromptDigest
from pd_orchestrator.sim.engine import (
    Engine,
    EngineConfig,
    EngineRequest,
    FinishReason,
    HeldTransfer,
    RequestOutput,
    SamplingSpec,
)

__all__ = ["AFFINITY_TOKENS", "VirtualFleet", "VirtualOptions", "affinity_key"]

Handler = Callable[[float, RequestOutput], None]
Action = Callable[[float], None]

AFFINITY_TOKENS = 1024
"""The gateway keys a token-id prompt's affinity on its first 1024 tokens."""


@record
class VirtualOptions:
    """``hop``: one-way latency of one HTTP leg (seconds). ``load_interval``: seconds
    between two load snapshots (the scraper's poll interval). ``handback``: the
    gateway's hand-back settings, ``upstream`` its upstream settings (what the flow
    machine reads of them: ``prefill_fallback``). ``prefix_index``: the planner knows each engine's
    cached prefix of a prompt, as a gateway with a precise prefix index does (off: as
    a gateway without one). ``profile_error``: the ``goodput`` policy starts from a
    belief this far off (:mod:`~pd_orchestrator.bench.belief`; None: right)."""

    hop: float = 0.002
    load_interval: float = LoadConfig().interval
    handback: HandbackConfig = field(default_factory=HandbackConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    prefix_index: bool = True
    profile_error: ProfileError | None = None


class _KvIndex:
    """The planner's :class:`~pd_orchestrator.planner.plan.CachedPrefix` in virtual
    time: the leading tokens of the prompt being planned (:attr:`prompt`, set by the
    fleet around each plan) that an engine's prefix cache holds, as a precise index
    of its KV events would report them, or that its prompts in flight hold
    (:attr:`pending`), the more (at most what the engine could hit)."""

    def __init__(self, instances: Mapping[str, _Instance], pending: PendingBlocks[bytes]) -> None:
        self.instances = instances
        self.pending = pending
        self.prompt: PromptDigest | None = None

    def cached_tokens(self, request: RoutingRequest, decoder: Endpoint) -> int | None:
        prompt, instance = self.prompt, self.instances.get(decoder.name)
        if prompt is None or instance is None:
            return None
        hashes, tokens = prompt.block_hashes, prompt.num_tokens
        engine = instance.engine
        size = engine.config.block_size
        cap = max(0, tokens - 1) // size
        pending = min(self.pending.leading(hashes, decoder.name), cap) * size
        return max(engine.local_hit_tokens_of(hashes, tokens), pending)

    def blocks(self, request: RoutingRequest) -> Sequence[int]:
        """Empty: each instance holds its requests' block hashes pending itself
        (:meth:`_Instance.enter`)."""
        return ()


def affinity_key(digest: PromptDigest, block_size: int) -> str:
    """A key equal for prompts whose first :data:`AFFINITY_TOKENS` tokens are equal."""
    blocks = AFFINITY_TOKENS // block_size
    hashes = digest.block_hashes
    if len(hashes) >= blocks:
        return hashes[blocks - 1].hex()
    last = hashes[-1].hex() if hashes else ""
    return f"{last}:{','.join(map(str, digest.tail))}"


class _Instance:
    """One engine with its handlers, in-flight count and latest load snapshot."""

    def __init__(self, spec: InstanceSpec, fleet: FleetSpec, pending: PendingBlocks[bytes]) -> None:
        self.spec = spec
        self.name = spec.name
        self.endpoint = spec.endpoint()
        self.profile = spec.latency
        config = EngineConfig(
            profile=self.profile,
            model=self.profile.model,
            block_size=fleet.block_size,
            num_kv_blocks=max(1, fleet.capacity(spec) // fleet.block_size),
            max_num_seqs=fleet.max_num_seqs,
            max_num_batched_tokens=fleet.max_num_batched_tokens,
            kv_connector="nixl",
        )
        self.engine = Engine(config)
        self.handlers: dict[str, Handler] = {}
        self.stepping = False
        self.expiry_at: float | None = None
        self.in_flight = 0
        self.backlog = 0
        self.routed = 0
        self._awaiting: dict[str, tuple[int, Sequence[bytes]]] = {}
        self.pending = pending
        self.busy = 0.0
        self.load: LoadSnapshot | None = None
        self._seen = (0, 0, 0)
        self._window: HitWindow[tuple[int, int]] = HitWindow(LoadConfig().hit_rate_tokens)

    def poll(self, now: float) -> None:
        """Take a load snapshot, as the scraper does from ``/metrics`` (the hit rate
        over the same window, :class:`~pd_orchestrator.model.hit_window.HitWindow`)."""
        engine, stats = self.engine, self.engine.stats
        queries, hits = stats.prefix_queries, stats.prefix_hits
        first, held, _ = self._seen
        first, held = self._window.start(queries) or (first, held)
        self._window.moved(queries, (queries, hits))
        preemptions = stats.preemptions - self._seen[2]
        self._seen = (queries, hits, stats.preemptions)
        self.load = LoadSnapshot(
            running=engine.num_running,
            waiting=engine.num_waiting,
            kv_usage=min(1.0, max(0.0, engine.pool.usage)),
            observed_at=now,
            prefix_hit_rate=(hits - held) / (queries - first) if queries > first else None,
            preemptions=preemptions,
        )

    def rebase(self) -> None:
        """Start the next hit-rate window now, after the start-up timing's prompts (as
        the gateway's scraper does, :meth:`~pd_orchestrator.fleet.scraper.LoadScraper.
        rebase`); the snapshot held gives no hit rate until then."""
        stats = self.engine.stats
        self._seen = (stats.prefix_queries, stats.prefix_hits, stats.preemptions)
        self._window.restart(stats.prefix_queries, self._seen[:2])
        if self.load is not None:
            self.load = replace(self.load, prefix_hit_rate=None)

    def candidate(self) -> Candidate:
        return Candidate(self.endpoint, True, self.in_flight, self.load, self.backlog)

    def spill_load(self) -> SpillLoad:
        """What the plain spill rule reads of this instance
        (:mod:`~pd_orchestrator.bench.spill`)."""
        load = self.load
        if load is None:
            return SpillLoad(self.name, active_tokens=self.backlog, in_flight=self.in_flight)
        return SpillLoad(self.name, load.waiting, load.kv_usage, self.backlog, self.in_flight)

    def enter(self, request: EngineRequest) -> None:
        """One more request in flight, its prompt in the backlog (and in ``routed``, all
        prompt tokens sent here) and its block hashes pending until its first output
        (as the gateway counts them)."""
        self.in_flight += 1
        tokens = max(0, request.num_prompt_tokens - request.external_tokens)
        digest = request.digest
        hashes = digest.block_hashes if tokens and digest is not None else ()
        self._awaiting[request.request_id] = (tokens, hashes)
        self.backlog += tokens
        self.routed += tokens
        if hashes:
            self.pending.hold(self.name, hashes)

    def answered(self, request_id: str) -> None:
        """The request's first output (or its end) came back: out of the backlog, its
        hashes no longer pending."""
        awaited = self._awaiting.pop(request_id, None)
        if awaited is None:
            return
        tokens, hashes = awaited
        self.backlog -= tokens
        if hashes:
            self.pending.release(self.name, hashes)


class VirtualFleet:
    """Runs one strategy over a workload in virtual time; see the module docstring."""

    def __init__(
        self,
        fleet: FleetSpec,
        strategy: Strategy,
        routing: RoutingProfiles,
        options: VirtualOptions | None = None,
    ) -> None:
        self.spec = fleet.aggregated() if strategy.mode is Mode.DECODE_ONLY else fleet
        self.strategy = strategy
        self.routing = routing
        self.options = options or VirtualOptions()
        self.model = self.spec.model
        self.decisions: Counter[str] = Counter()
        self.hasher = BlockHasher(self.spec.block_size)
        pending: PendingBlocks[bytes] = PendingBlocks()
        self.instances = [_Instance(spec, self.spec, pending) for spec in self.spec.instances]
        self._by_name = {i.name: i for i in self.instances}
        self.kv_index = _KvIndex(self._by_name, pending)
        cache = self.kv_index if self.options.prefix_index else None
        self.planner = Planner(routing, strategy.resolver(), cache=cache)
        error, resolver = self.options.profile_error, self.planner.threshold
        if error is not None and resolver is not None:
            error.apply(resolver.policy, [i.endpoint for i in self.instances])
        self.decoders = [i for i in self.instances if i.spec.role.decodes]
        self.prefillers = [i for i in self.instances if i.spec.role.prefills]
        resolver = self.planner.threshold
        own_spill = resolver is not None and resolver.ranks_spill
        self.spills_plainly = not own_spill and any(i.spec.spill for i in self.prefillers)
        self.itl_samples: array[float] = array("d")
        self.warm_up = 0
        """Requests before this index are a warm-up (:attr:`Workload.warm_up`): the
        others arrive from ``pause`` seconds after its last one has finished."""
        self.pause = 0.0
        self._warming = 0
        self._measured_requests: Sequence[BenchRequest] = ()
        self.kv_bytes = 0
        self._events: list[tuple[float, int, Action]] = []
        self._seq = itertools.count()
        self._ordinals = itertools.count()
        self._followers: dict[int, list[BenchRequest]] = defaultdict(list)
        self._histories: dict[int, tuple[PromptDigest, list[int]]] = {}
        self._records: list[RequestRecord] = []
        self._remaining = 0
        self._progress: Callable[[int], None] | None = None
        self._ran = False

    # -- the event loop ---------------------------------------------------------------------
    def at(self, when: float, action: Action) -> None:
        """Run ``action(when)`` at virtual time ``when``."""
        heapq.heappush(self._events, (when, next(self._seq), action))

    def run(self, workload: Workload, progress: Callable[[int], None] | None = None) -> RunResult:
        """Replay ``workload``; ``progress(n)`` is called as each request completes.

        A fleet runs once (its engines keep their state); ``RuntimeError`` otherwise.
        Objects alive at the start are kept out of garbage collection while it runs
        (``gc.freeze``; the engines' block pools are large and long-lived).
        """
        if self._ran:
            raise RuntimeError("a virtual fleet runs once; build a new one")
        self._ran = True
        started = time.perf_counter()
        gc.freeze()
        self._progress = progress
        self._remaining = len(workload)
        warm = self.warm_up = self._warming = workload.warm_up
        self.pause = workload.pause
        self._measured_requests = workload.requests[warm:]
        first = workload.requests[:warm] if warm else self._measured_requests
        polls = min((r.arrival for r in workload.requests), default=None)
        self._calibrate(partial(self._begin, first, polls))
        try:
            while self._events:
                when, _, action = heapq.heappop(self._events)
                action(when)
        finally:
            gc.unfreeze()
        return self._result(workload, time.perf_counter() - started)

    def _calibrate(self, then: Callable[[float], None]) -> None:
        """Time the cold prompts the threshold policies ask for at start-up, as the
        gateway does (:mod:`~pd_orchestrator.policies.calibration`; one endpoint after
        another, from time 0), then ``then(t)`` at the last one's answer (``then(0.0)``
        at once when none is asked for): the workload arrives after them."""
        resolver = self.planner.threshold
        candidates = [instance.candidate() for instance in self.instances]
        probes = [] if resolver is None else resolver.probes(candidates)
        if resolver is None or not probes:
            then(0.0)
            return
        numbered = iter(enumerate(probes))

        def next_probe(now: float) -> None:
            number, probe = next(numbered, (-1, None))
            if probe is None:
                then(now)
            else:
                _Probing(self, resolver, probe, number, next_probe).send(now)

        next_probe(0.0)

    def _begin(self, requests: Sequence[BenchRequest], polls: float | None, start: float) -> None:
        """The workload starts at ``start``: its first ``requests`` arrive from then, and
        the load polls start ``polls`` seconds after it (the workload's first arrival;
        None: none arrives). So each run, with or without a start-up timing before it,
        polls in the same phase as its arrivals: on a cold burst of 400 requests within
        0.6 s the phase alone moved goodput by a third (shared-prefix draw 5 on 12:4,
        x10.8 against x16.7)."""
        self._schedule(requests, start)
        if polls is not None:
            self.at(start + polls, self._poll)

    def _schedule(self, requests: Sequence[BenchRequest], start: float) -> None:
        """Arrive ``requests`` at ``start`` plus their arrival times (a request that
        follows another waits for it)."""
        for request in requests:
            if request.after is None:
                self.at(start + request.arrival, partial(self._arrive, request))
            else:
                self._followers[request.after].append(request)

    def _result(self, workload: Workload, wall: float) -> RunResult:
        stats = [i.engine.stats for i in self.instances]
        return RunResult(
            strategy=self.strategy.name,
            mode=self.strategy.mode.value,
            workload=workload.name,
            fleet=self.spec.name,
            runner="virtual",
            records=self._measured(),
            itl_samples=self.itl_samples,
            prefill_tokens=sum(s.prefill_computed_tokens for s in stats),
            kv_bytes=self.kv_bytes,
            preemptions=sum(s.preemptions for s in stats),
            wall_seconds=wall,
            reasons=dict(self.decisions),
            busy_seconds=self._busy(),
        )

    def _measured(self) -> list[RequestRecord]:
        """The records of the requests after the warm-up, in order, indexed from 0."""
        warm = self.warm_up
        records = sorted(self._records, key=lambda r: r.index)[warm:]
        for one in records:
            one.index -= warm
        return records

    def _busy(self) -> dict[str, tuple[float, int]]:
        """Per pool: engine-seconds spent stepping, and how many instances it has."""
        pools: dict[str, tuple[float, int]] = {}
        for instance in self.instances:
            seconds, count = pools.get(instance.endpoint.pool, (0.0, 0))
            pools[instance.endpoint.pool] = (seconds + instance.busy, count + 1)
        return pools

    def _poll(self, now: float) -> None:
        for instance in self.instances:
            instance.poll(now)
        if self._remaining > 0:
            self.at(now + self.options.load_interval, self._poll)

    # -- requests ---------------------------------------------------------------------------
    def _arrive(self, request: BenchRequest, now: float) -> None:
        digest = self._prompt(request)
        record = RequestRecord(request.index, request.session, now, digest.num_tokens)
        self._records.append(record)
        _Flow(self, request, digest, record).start(now)

    def _prompt(self, request: BenchRequest) -> PromptDigest:
        if not request.extends or request.after is None:
            return digest_segments(request.segments, self.spec.block_size)
        previous, output = self._histories.pop(request.after)
        return previous.extend([*output, *materialize(request.segments)], self.hasher)

    def complete(self, flow: _Flow, now: float) -> None:
        """A request finished (or failed): start the turns that follow it."""
        self._remaining -= 1
        if self._progress is not None:
            self._progress(1)
        if flow.request.index < self.warm_up:
            self._warming -= 1
            if self._warming == 0:  # the warm-up is over: the measured requests start
                self._schedule(self._measured_requests, now + self.pause)
        for follower in self._followers.pop(flow.request.index, ()):
            if follower.extends:
                self._histories[flow.request.index] = (flow.digest, flow.generated)
            self.at(now + follower.think_time, partial(self._arrive, follower))

    # -- planning ---------------------------------------------------------------------------
    def plan(self, now: float, digest: PromptDigest) -> tuple[Plan, RequestFacts] | None:
        """The gateway planner's plan for a prompt (None when no decoder can take it)."""
        facts = RequestFacts(
            model=self.model,
            prompt_chars=TOKEN_ID_CHARS * digest.num_tokens,
            affinity_key=affinity_key(digest, self.spec.block_size),
            prompt_tokens=digest.num_tokens,
        )
        candidates = [instance.candidate() for instance in self.instances]
        self.kv_index.prompt = digest
        try:
            plan = self.planner.plan(facts, candidates, now, next(self._ordinals))
        except NoCandidateError:
            return None
        finally:
            self.kv_index.prompt = None
        if self.planner.threshold is not None:
            route = plan.route
            self.decisions[f"{route.policy}:{route.reason}"] += 1
        return plan, facts

    def instance(self, name: str) -> _Instance:
        return self._by_name[name]

    def spilled(self, plan: Plan) -> Plan:
        """``plan``, or the plan that serves the request whole on a spilling prefiller
        by the bench's plain spill rule (:mod:`~pd_orchestrator.bench.spill`): for a
        strategy whose policy has no spill rule of its own, on a fleet whose prefill
        pool spills, when the rule does not keep the plan's decoder. The spilled plan
        is the one a policy's :class:`~pd_orchestrator.model.route.Whole` makes: the
        prefiller its only decoder, at threshold 0."""
        if not self.spills_plainly or plan.decoder.spill:
            return plan
        decoder = self.instance(plan.decoder.name)
        spills = [self.instance(e.name) for e in plan.prefillers_for(plan.decoder) if e.spill]
        picked = plain_spill(decoder.spill_load(), [i.spill_load() for i in spills])
        if picked is None:
            return plan
        name, why = picked
        self.decisions[f"plain-spill:{why}"] += 1
        target = self.instance(name).endpoint
        route = Whole("plain-spill", why, name)
        return replace(plan, decoders=(target,), asked=(target,), route=route, width=None)

    def prefiller_for(self, ranked: Sequence[Endpoint], digest: PromptDigest) -> _Instance:
        """The prefiller of a P/D leg for ``digest`` among ``ranked`` (the prefill
        profile's ranking, non-empty), picked as the strategy's system picks it
        (:class:`~pd_orchestrator.bench.prefill_picks.PrefillPick`)."""
        instances = [self.instance(endpoint.name) for endpoint in ranked]
        if self.strategy.prefill_pick is PrefillPick.PROFILE:
            return instances[0]
        hashes, tokens = digest.block_hashes, digest.num_tokens
        loads = [
            PrefillLoad(
                i.name,
                i.backlog,
                i.engine.local_hit_tokens_of(hashes, tokens),
                0 if i.load is None else i.load.waiting,
                i.in_flight,
                i.routed,
            )
            for i in instances
        ]
        match self.strategy.prefill_pick:
            case PrefillPick.DYNAMO_KV:
                name = dynamo_pick(loads, tokens, self.spec.block_size)
            case PrefillPick.LLM_D:
                name = llm_d_pick(loads, tokens, self.spec.block_size)
            case PrefillPick.CACHE_AWARE:
                name = cache_aware_pick(loads, tokens)
            case PrefillPick.PROFILE:
                name = loads[0].name
            case _:
                assert_never(self.strategy.prefill_pick)
        return self.instance(name)

    # -- engines ----------------------------------------------------------------------------
    def submit(
        self,
        instance: _Instance,
        when: float,
        request: EngineRequest,
        handler: Handler,
        refused: Callable[[float, str], None],
    ) -> None:
        """Add ``request`` to ``instance``'s engine at ``when``; outputs go to ``handler``,
        an engine refusal (``ValueError``: too long for the instance) to ``refused``."""
        instance.enter(request)

        def add(now: float) -> None:
            try:
                instance.engine.add_request(request)
            except ValueError as exc:
                instance.in_flight -= 1
                instance.answered(request.request_id)
                refused(now, str(exc))
                return
            instance.handlers[request.request_id] = handler
            self.kick(instance, now)

        self.at(when, add)

    def kick(self, instance: _Instance, now: float) -> None:
        """Start a step on an idle engine that has work (or wait for its next lease)."""
        if instance.stepping:
            return
        if not instance.engine.has_work():
            self._watch_leases(instance, now)
            return
        result = instance.engine.step(now)
        if not result.progressed:
            self._watch_leases(instance, now)
            return
        instance.stepping = True
        instance.busy += result.duration
        self.at(now + result.duration, partial(self._deliver, instance, result.outputs))

    def _deliver(self, instance: _Instance, outputs: Sequence[RequestOutput], now: float) -> None:
        instance.stepping = False
        handlers = instance.handlers
        for output in outputs:
            instance.answered(output.request_id)
            if output.finish_reason is None:
                handlers[output.request_id](now, output)
                continue
            instance.in_flight -= 1
            handlers.pop(output.request_id)(now, output)
        self.kick(instance, now)

    def _watch_leases(self, instance: _Instance, now: float) -> None:
        deadline = instance.engine.next_deadline()
        if deadline is None or instance.expiry_at == deadline:
            return
        instance.expiry_at = deadline

        def expire(when: float) -> None:
            instance.expiry_at = None
            instance.engine.expire_leases(when)
            self.kick(instance, when)

        self.at(max(now, deadline), expire)

    def release(self, instance: _Instance, transfer: HeldTransfer, now: float) -> None:
        """A consumer pulled ``transfer``: free the producer's blocks."""
        instance.engine.release(transfer.request_id)
        self.kick(instance, now)


class _Probing:
    """One start-up probe (:class:`~pd_orchestrator.policies.calibration.Probe`) on its
    endpoint's engine: each length a fresh cold prompt (a content no workload uses),
    ``max_tokens`` 1, then the decode step prompts, each sent when the one before was
    answered while the probe's ``seconds`` have not passed; each answer, timed from
    its send to its arrival back (two hops), and a step prompt's mean gap between its
    tokens after the first, is told to the policies; after the last
    (or after a prompt the engine refuses) the instance's hit-rate window starts
    afresh, then ``done(t)``."""

    def __init__(
        self,
        fleet: VirtualFleet,
        resolver: ThresholdResolver,
        probe: Probe,
        number: int,
        done: Callable[[float], None],
    ) -> None:
        self.fleet, self.resolver, self.probe = fleet, resolver, probe
        self.number, self.done = number, done
        self.instance = fleet.instance(probe.endpoint.name)
        self.prompts = probe.prompts()
        self.sent = self.started = 0.0
        self.step = 0
        self.queued: bool | None = None
        self.alone: bool | None = None
        self.first: tuple[float, int] | None = None  # the prompt's first output, tokens by then

    def send(self, now: float) -> None:
        """Send the next prompt (:meth:`Probe.prompts`) at ``now`` (``done`` when none
        is left or the probe's ``seconds`` have passed)."""
        if self.step == 0:
            self.started = now
        if self.step >= len(self.prompts) or now - self.started >= self.probe.seconds:
            self._end(now)
            return
        length, output = self.prompts[self.step]
        key = content_key("probe", self.number, self.step)
        digest = digest_segments((Segment(key, length),), self.fleet.spec.block_size)
        self.step += 1
        engine = self.instance.engine
        self.queued = engine.num_waiting > 0
        self.alone = engine.num_running == 0 and not self.queued
        self.sent = now
        request = EngineRequest(
            request_id=f"probe.{self.number}.{self.step}",
            prompt_token_ids=(),
            sampling=SamplingSpec(max_tokens=output, ignore_eos=True),
            digest=digest,
        )
        hop = self.fleet.options.hop
        self.fleet.submit(self.instance, now + hop, request, self.answered, self.refused)

    def answered(self, now: float, output: RequestOutput) -> None:
        """One step's output of the prompt out: its first token's time kept (a step
        prompt's tokens stream, as the gateway times them), its last learnt."""
        if self.first is None:
            self.first = (now, output.num_output_tokens)
        if output.finish_reason is None:
            return
        back = now + self.fleet.options.hop
        at, before = self.first
        after = output.num_output_tokens - before
        timed = Timed(
            output.num_prompt_tokens,
            output.num_cached_tokens,
            back - self.sent,
            queued=self.queued,
            alone=self.alone,
            output=output.num_output_tokens,
            gap=(now - at) / after if after > 0 else None,
        )
        self.first = None
        self.resolver.calibrate(self.probe, timed)
        self.send(back)

    def refused(self, now: float, why: str) -> None:
        self._end(now)

    def _end(self, now: float) -> None:
        """The probe is over: the endpoint's next hit-rate window starts now and the
        policies forget the one they hold (as the gateway does), then ``done``."""
        self.instance.rebase()
        self.resolver.calibrated(self.probe.endpoint.name)
        self.done(now)


class _Flow:
    """One client request, driven through the gateway's own flow machine
    (:class:`~pd_orchestrator.flows.machine.FlowMachine`) in virtual time: the
    machine decides every step (P/D or not, hand-backs, the decoder alone), this
    driver carries it out on the engines."""

    def __init__(
        self,
        fleet: VirtualFleet,
        request: BenchRequest,
        digest: PromptDigest,
        record: RequestRecord,
    ) -> None:
        self.fleet = fleet
        self.request = request
        self.digest = digest
        self.record = record
        self.hop = fleet.options.hop
        self.generated: list[int] = []
        self.first_at: float | None = None
        self.prefilled_at: float | None = None
        self.prefill_sent: float | None = None
        self.prefiller: Endpoint | None = None
        self.prefill_cached: int | None = None
        self.last_at = 0.0
        self.legs = 0
        self.decoder: _Instance | None = None
        self.planned: tuple[Plan, RequestFacts] | None = None
        self.machine: FlowMachine | None = None
        self.attempting = True

    # -- start ------------------------------------------------------------------------------
    def start(self, now: float) -> None:
        """Plan the request and send its attempt (or, with no attempt to send, what
        the machine says a rejected one leads to)."""
        fleet = self.fleet
        self.planned = fleet.plan(now, self.digest)
        if self.planned is None:
            self.fail(now, "no decoder")
            return
        plan = fleet.spilled(self.planned[0])
        self.machine = FlowMachine(plan, fleet.options.handback, fleet.options.upstream)
        decoder = self.decoder = fleet.instance(plan.decoder.name)
        self.record.decoder = decoder.name
        if fleet.strategy.mode is Mode.PREFILL_FIRST:  # vllm-router's P/D mode: no attempt
            self.start_pd(now)
            return
        threshold = self.record.threshold = threshold_of(plan.route)
        if skips_attempt(plan.route):  # nothing admits it: P/D at once, as the gateway does
            self.start_pd(now)
            return
        attempt = self.leg(self.digest, self.request.max_tokens, threshold)
        fleet.submit(decoder, now + self.hop, attempt, self.on_output, self.fail)

    def start_pd(self, now: float) -> None:
        """No attempt: the machine hears of a rejection at once."""
        assert self.machine is not None
        self.attempting = False
        step = self.machine.attempted(self.machine.decoder, admitted=False)
        self.carry(now, step, self.digest, 0)

    def leg(
        self,
        digest: PromptDigest,
        max_tokens: int,
        threshold: float,
        *,
        producer: bool = False,
        external: int = 0,
    ) -> EngineRequest:
        self.legs += 1
        return EngineRequest(
            request_id=f"{self.request.index}.{self.legs}",
            prompt_token_ids=(),
            sampling=SamplingSpec(max_tokens=max_tokens, ignore_eos=True),
            cache_hit_threshold=threshold,
            do_remote_decode=producer,
            external_tokens=external,
            digest=digest,
        )

    # -- the machine's steps ----------------------------------------------------------------
    def carry(self, now: float, step: Step, digest: PromptDigest, generated: int) -> None:
        """Carry out ``step`` for ``digest`` (the prompt, plus the ``generated`` tokens
        it continues after), the gateway having learnt what led to it at ``now``."""
        assert self.machine is not None
        self.record.decision = self.machine.decision
        match step:
            case ThroughPD(decoder=decoder, threshold=threshold):
                self.decoder = self.fleet.instance(decoder.name)
                self.prefill(now, digest, generated, threshold)
            case Alone(decoder=decoder):
                instance = self.decoder = self.fleet.instance(decoder.name)
                request = self.leg(digest, self.request.max_tokens - generated, 0.0)
                self.fleet.submit(instance, now + self.hop, request, self.on_output, self.fail)
            case Done() | AtLimit():
                self.finish(now)
            case Serve():
                pass
            case _:
                assert_never(step)

    # -- outputs ----------------------------------------------------------------------------
    def on_output(self, now: float, output: RequestOutput) -> None:
        """An output of a leg that answers the client (the attempt, a decode leg, the
        decoder alone); the first decisive one of the attempt is the machine's
        ``attempted``, a finish its ``leg_ended``."""
        machine = self.machine
        assert machine is not None and self.decoder is not None
        handed_back = output.finish_reason is FinishReason.CACHE_THRESHOLD
        if self.attempting and (output.new_token_ids or output.finish_reason is not None):
            self.attempting = False
            admitted = not (handed_back and not output.new_token_ids)
            step = machine.attempted(self.decoder.endpoint, admitted=admitted)
            if not isinstance(step, Serve):
                self.carry(now + self.hop, step, self.digest, 0)
                return
        if not handed_back:
            self.take(now, output)
        if output.finish_reason is None:
            return
        ended = machine.leg_ended(
            handed_back=handed_back,
            remaining=self.request.max_tokens - len(self.generated),
            next_decoder=None,
        )
        self.record.handbacks = machine.handbacks
        if not handed_back:
            self.carry(now + self.hop, ended, self.digest, 0)
            return
        continuation = self.digest.extend(self.generated, self.fleet.hasher)
        self.carry(now + self.hop, ended, continuation, len(self.generated))

    def take(self, now: float, output: RequestOutput) -> None:
        """The client gets ``output``'s tokens ``hop`` later."""
        if not output.new_token_ids:
            return
        seen = now + self.hop
        if self.first_at is None:
            self.first_at = seen
            self.record.ttft = seen - self.record.arrival
            self.record.cached_tokens = output.num_cached_tokens
        elif self.record.index >= self.fleet.warm_up:  # a warm-up's gaps are not counted
            self.fleet.itl_samples.append(seen - self.last_at)
        self.last_at = seen
        self.generated += output.new_token_ids

    # -- P/D --------------------------------------------------------------------------------
    def prefill(self, now: float, digest: PromptDigest, generated: int, threshold: float) -> None:
        """Prefill ``digest`` (after ``generated`` tokens) on a prefiller a hop after
        ``now``, then decode what is left of ``max_tokens`` with ``threshold``; with no
        prefiller that can reach the decoder, what the machine says (the decoder
        alone)."""
        assert self.decoder is not None and self.machine is not None
        prefillers = self.machine.plan.prefillers_for(self.decoder.endpoint)
        if not prefillers:
            try:
                step = self.machine.without_prefiller(original_prompt=not generated)
            except GatewayError as exc:
                self.fail(now, exc.message)
                return
            self.carry(now, step, digest, generated)
            return
        max_tokens = self.request.max_tokens - generated
        prefiller = self.fleet.prefiller_for(prefillers, digest)
        self.record.prefiller = prefiller.name
        self.prefiller = prefiller.endpoint

        def on_prefill(when: float, output: RequestOutput) -> None:
            if self.prefilled_at is None:
                self.prefilled_at = when + self.hop  # the answer at the gateway
                self.prefill_cached = output.num_cached_tokens
            if output.transfer is None:
                self.on_output(when, output)  # finished without KV: its answer is the answer
            else:
                pulled = when + 2 * self.hop
                self.fleet.at(
                    pulled,
                    partial(self.pull, prefiller, output.transfer, digest, max_tokens, threshold),
                )

        request = self.leg(digest, 1, 0.0, producer=True)
        if self.prefilled_at is None:  # the original prompt's prefill leg
            self.prefill_sent = now
        self.fleet.submit(prefiller, now + self.hop, request, on_prefill, self.fail)

    def pull(
        self,
        prefiller: _Instance,
        transfer: HeldTransfer,
        digest: PromptDigest,
        max_tokens: int,
        threshold: float,
        now: float,
    ) -> None:
        """The decoder pulls the KV it lacks (side-channel round trip, then the transfer)."""
        decoder = self.decoder
        assert decoder is not None
        now += 2 * self.hop
        self.fleet.release(prefiller, transfer, now)
        local = decoder.engine.local_hit_tokens_of(digest.block_hashes, digest.num_tokens)
        moved = max(0, digest.num_tokens - local)
        kv_bytes = moved * decoder.profile.kv_bytes_per_token
        self.record.kv_bytes += kv_bytes
        self.fleet.kv_bytes += kv_bytes
        request = self.leg(digest, max_tokens, threshold, external=digest.num_tokens)
        ready = now + decoder.profile.transfer_seconds(moved)
        self.fleet.submit(decoder, ready, request, self.on_output, self.fail)

    # -- end --------------------------------------------------------------------------------
    def finish(self, now: float) -> None:
        record = self.record
        record.e2e = now - record.arrival
        record.output_tokens = len(self.generated)
        if len(self.generated) > 1 and self.first_at is not None:
            record.tpot = (self.last_at - self.first_at) / (len(self.generated) - 1)
        if self.decoder is not None and self.planned is not None:
            plan, facts = self.planned
            served = Served(
                self.decoder.endpoint,
                now,
                record.ttft,
                record.tpot,
                record.prompt_tokens,
                cached_tokens=record.cached_tokens,
                output_tokens=record.output_tokens,
                remote=record.decision == "pd",
                after_prefill=after_prefill(record.arrival, record.ttft, self.prefilled_at),
                prefiller=self.prefiller,
                prefill_cached=self.prefill_cached,
                prefill_seconds=leg_seconds(self.prefill_sent, self.prefilled_at),
            )
            self.fleet.planner.learn(plan, facts, served)
        self.fleet.complete(self, now)

    def fail(self, now: float, why: str) -> None:
        self.record.error = why
        self.fleet.complete(self, now)
