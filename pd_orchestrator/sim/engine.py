"""The simulator's engine: one vLLM instance as a pure state machine.

No I/O and no clock of its own: a driver calls :meth:`Engine.step` with the current
time, waits ``StepResult.duration`` (real or virtual seconds), then delivers the
step's outputs. The HTTP server drives it in real time; a fleet simulator can drive
many engines in virtual time.

Scheduling follows vLLM's v1 scheduler:

1. Running requests first, in admission order: a decoding request needs one token,
   a prefilling one the rest of its prompt up to the step's token budget
   (``max_num_batched_tokens``, chunked prefill). When no block can be allocated,
   the most recently admitted running request is preempted: its blocks are freed
   (their cached hashes stay until evicted), ``num_computed`` drops to 0 and it
   goes back to the head of the waiting queue with the tokens it generated.
2. Then, if nothing was preempted, waiting requests in FCFS order while fewer than
   ``max_num_seqs`` run. For each: local hit = longest cached prefix of full blocks
   (capped at ``num_tokens - 1``); external hit = tokens the KV connector can load
   beyond it. The cache-hit threshold (RFC 24256) is checked here, before any
   allocation: ``(local + external) / num_tokens < threshold`` finishes the request
   with ``cache_threshold`` (a resumed request returns what it generated so far; an
admission-only request is checked on admission only, and recomputed on resumption).
   The check runs at every admission attempt: a request blocked on memory is
   checked again next step. A request that then does not fit stays waiting.
3. Scheduled tokens are computed; newly full blocks enter the prefix cache (decode
   blocks too); a request whose every token is computed samples its next token.

Threshold resolution: per-request value, else the engine's global value; ignored
(treated as 0) for producer requests (``do_remote_decode``). An empty token
sequence has hit ratio 1.0 (nothing to compute), so it is never rejected.

KV pulled from a producer (``external_tokens``) serves the first admission only; a
preempted request that re-enters counts its local hits (and shared storage) alone.

A request may carry a :class:`~pd_orchestrator.sim.digest.PromptDigest` instead of
its prompt tokens (an opt-in fast path for fleet simulations): the engine then
uses the digest's block hashes and generation state and keeps only the tokens after
the last full prompt block. Such requests cannot be used with ``record_events``
(the events carry the blocks' tokens).

A constrained request (``EngineRequest.constraint``: a structured output or a tool
choice) answers its constraint's document (:mod:`~pd_orchestrator.sim.constrained`),
then EOS, whatever ``ignore_eos`` and ``min_tokens`` say (as a grammar that only
allows EOS once it is complete); the document is seeded by the generation state
after the prompt less its last ``resume_tokens``, so a continuation carries on with
the same document.

A finished producer request that ended by length keeps its blocks referenced under
a lease until :meth:`Engine.release` (a consumer took them) or expiry. It holds them
under its ``hold_keys`` (what the consumer names it by: its request id for a NIXL
pull, a transfer id for Mooncake, ...); releasing any of its keys releases all.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pd_orchestrator.model.hardware import LatencyProfile
from pd_orchestrator.model.hashing import HashAlgo
from pd_orchestrator.model.records import record
from pd_orchestrator.prefix.hashing import BlockExtras
from pd_orchestrator.sim.blocks import BlockHasher, BlockPool
from pd_orchestrator.sim.constrained import Constraint
from pd_orchestrator.sim.digest import PromptDigest
from pd_orchestrator.sim.generation import advance, advance_all, initial_state, next_token
from pd_orchestrator.sim.tokenizer import EOS_TOKEN_ID

__all__ = [
    "ComposedKV",
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "EngineStats",
    "ExternalKV",
    "FinishReason",
    "HeldTransfer",
    "PromptDigest",
    "PulledKV",
    "RequestOutput",
    "SamplingSpec",
    "StepResult",
    "hit_ratio",
]


class FinishReason(enum.StrEnum):
    """Why a request finished (the OpenAI ``finish_reason`` strings)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    CACHE_THRESHOLD = "cache_threshold"


@record
class SamplingSpec:
    """The sampling fields the simulator honours (output is always deterministic)."""

    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False


@record
class EngineRequest:
    """One request as the engine sees it.

    ``external_tokens`` is what a transfer connector (NIXL, Mooncake, ...) already
    fetched for this request: the number of leading prompt tokens whose KV is
    loadable. ``hold_keys``: the keys a producer's finished blocks are held under
    for a consumer (None: its request id when it is a producer and the engine's
    connector is ``nixl``). ``digest``: the prompt as a digest (then
    ``prompt_token_ids`` is ignored and may be empty); see the module docstring.
    ``constraint``: what shapes the output (a structured output or a tool choice), its
    document seeded by the generation state after the prompt less its last
    ``resume_tokens`` (a continuation's output so far, which must be the document's
    start: ``ValueError`` otherwise); it carries on where they leave it.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    sampling: SamplingSpec
    cache_hit_threshold: float | None = None
    admission_only: bool = False
    do_remote_decode: bool = False
    external_tokens: int = 0
    force_reject: bool = False
    extras: BlockExtras | None = None
    digest: PromptDigest | None = None
    hold_keys: tuple[str, ...] | None = None
    constraint: Constraint | None = None
    resume_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length, from the digest when there is one."""
        if self.digest is not None:
            return self.digest.num_tokens
        return len(self.prompt_token_ids)


@record
class HeldTransfer:
    """KV blocks a producer holds for a consumer to take, under ``keys``."""

    request_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    num_tokens: int
    deadline: float
    keys: tuple[str, ...] = ()


@record
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_external_tokens: int
    num_output_tokens: int
    transfer: HeldTransfer | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@record
class StepResult:
    """A step's duration in (unscaled) seconds and its outputs."""

    duration: float
    outputs: tuple[RequestOutput, ...]
    progressed: bool


class ExternalKV(Protocol):
    """A KV connector's view for the engine: what can be loaded, what to save."""

    def loadable_tokens(self, request: EngineRequest, block_hashes: Sequence[bytes]) -> int:
        """Leading tokens of ``request`` whose KV the connector can load."""
        ...

    def save(self, request: EngineRequest, block_hashes: Sequence[bytes]) -> None:
        """Called once a request's prompt is fully computed."""
        ...


class PulledKV:
    """Connector view for transfers: only what the driver already fetched."""

    def loadable_tokens(self, request: EngineRequest, block_hashes: Sequence[bytes]) -> int:
        return request.external_tokens

    def save(self, request: EngineRequest, block_hashes: Sequence[bytes]) -> None:
        return None


class ComposedKV:
    """Several connector views in order (vLLM's MultiConnector): the first that can
    load anything loads; every one saves."""

    def __init__(self, parts: Sequence[ExternalKV]) -> None:
        self.parts = tuple(parts)

    def loadable_tokens(self, request: EngineRequest, block_hashes: Sequence[bytes]) -> int:
        for part in self.parts:
            tokens = part.loadable_tokens(request, block_hashes)
            if tokens > 0:
                return tokens
        return 0

    def save(self, request: EngineRequest, block_hashes: Sequence[bytes]) -> None:
        for part in self.parts:
            part.save(request, block_hashes)


@record
class EngineConfig:
    """Static engine settings."""

    profile: LatencyProfile
    model: str
    block_size: int = 16
    num_kv_blocks: int = 4096
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    global_cache_hit_threshold: float = 0.0
    seed: int = 0
    hash_seed: str | None = None
    hash_algo: HashAlgo = "sha256"
    lease_seconds: float = 30.0
    record_events: bool = False
    kv_connector: str | None = None


@dataclass
class EngineStats:
    """Monotonic counters, read by the metrics exporter."""

    prefix_queries: int = 0
    prefix_hits: int = 0
    external_queries: int = 0
    external_hits: int = 0
    preemptions: int = 0
    threshold_rejections_admission: int = 0
    threshold_rejections_preemption: int = 0
    prompt_tokens: int = 0
    prefill_computed_tokens: int = 0
    generation_tokens: int = 0
    tokenized_tokens: int = 0
    """Prompt tokens the API server tokenized (text prompts, rendered chats,
    ``/tokenize``); counted by the HTTP front, which does the tokenizing."""
    finished: dict[str, int] = field(default_factory=dict)


class _Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"


@dataclass(eq=False)
class _Req:
    spec: EngineRequest
    tokens: list[int]
    num_prompt: int
    state: int
    hashes: list[bytes]
    admit_seq: int = -1
    status: _Status = _Status.WAITING
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_blocks: int = 0
    cached_tokens: int | None = None
    external_tokens: int = 0
    prompt_saved: bool = False
    load_seconds: float = 0.0
    offset: int = 0
    """Position of ``tokens[0]``: 0, or the digest's tokens covered by block hashes."""
    document: tuple[int, ...] | None = None
    """A constrained request's whole output, then EOS (None: free generation)."""
    document_start: int = 0
    """Tokens of ``document`` already in the prompt (a continuation's)."""

    @property
    def num_tokens(self) -> int:
        return self.offset + len(self.tokens)

    @property
    def num_output(self) -> int:
        return self.offset + len(self.tokens) - self.num_prompt

    @property
    def decoding(self) -> bool:
        num_tokens = self.offset + len(self.tokens)
        return num_tokens > self.num_prompt and self.num_computed == num_tokens - 1


def hit_ratio(hit_tokens: int, num_tokens: int) -> float:
    """Cache-hit ratio; an empty sequence counts as fully cached (ratio 1.0)."""
    if num_tokens <= 0:
        return 1.0
    return hit_tokens / num_tokens


class Engine:
    """A simulated vLLM engine; see the module docstring for the rules."""

    def __init__(self, config: EngineConfig, external: ExternalKV | None = None) -> None:
        self.config = config
        self.hasher = BlockHasher(config.block_size, config.hash_seed, config.hash_algo)
        self.pool = BlockPool(config.num_kv_blocks, config.block_size, config.record_events)
        self.external: ExternalKV = external or PulledKV()
        self.stats = EngineStats()
        self._root_state = initial_state(config.seed, config.model)
        self._requests: dict[str, _Req] = {}
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._held: dict[str, HeldTransfer] = {}
        self._admissions = itertools.count()

    # -- queries -------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_held(self) -> int:
        return len({id(held) for held in self._held.values()})

    def has_work(self) -> bool:
        """Whether a step could make progress or change state."""
        return bool(self._running or self._waiting)

    def next_deadline(self) -> float | None:
        """Earliest lease expiry, if any block is held for a transfer."""
        return min((held.deadline for held in self._held.values()), default=None)

    def holds(self, key: str) -> bool:
        """Whether blocks are held under ``key`` now."""
        return key in self._held

    def capacity_tokens(self) -> int:
        return self.config.num_kv_blocks * self.config.block_size

    def prompt_hashes(
        self, token_ids: Sequence[int], extras: BlockExtras | None = None
    ) -> list[bytes]:
        """Chained hashes of the full blocks of ``token_ids``."""
        return self.hasher.extend([], token_ids, extras)

    def local_hit_tokens(self, token_ids: Sequence[int], extras: BlockExtras | None = None) -> int:
        """Tokens of ``token_ids`` the local prefix cache holds now (capped like admission)."""
        hashes = self.prompt_hashes(token_ids, extras)
        return self.local_hit_tokens_of(hashes, len(token_ids))

    def local_hit_tokens_of(self, block_hashes: Sequence[bytes], num_tokens: int) -> int:
        """Like :meth:`local_hit_tokens` for a prompt given by its block hashes
        (a :class:`~pd_orchestrator.sim.digest.PromptDigest`'s, for instance)."""
        return self._local_hit_blocks_count(block_hashes, num_tokens) * self.config.block_size

    # -- request lifecycle ---------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue ``request``; ``ValueError`` if its id is in use, it cannot ever fit, or
        its digest does not match the block size (or events are recorded)."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError("the prompt must not be empty")
        needed = num_prompt + request.sampling.max_tokens
        if needed > self.capacity_tokens():
            raise ValueError(
                f"prompt plus max_tokens is {needed} tokens, more than this instance's "
                f"KV capacity of {self.capacity_tokens()} tokens"
            )
        req = self._new_req(request) if request.digest is None else self._digest_req(request)
        self._requests[request.request_id] = req
        self._waiting.append(req)

    def _new_req(self, request: EngineRequest) -> _Req:
        tokens = list(request.prompt_token_ids)
        resumed = request.resume_tokens if request.constraint is not None else 0
        if not 0 <= resumed <= len(tokens):
            raise ValueError("cache_hit_resume_tokens exceeds the prompt")
        before = advance_all(self._root_state, tokens[: len(tokens) - resumed])
        req = _Req(
            spec=request,
            tokens=tokens,
            num_prompt=len(tokens),
            state=advance_all(before, tokens[len(tokens) - resumed :]),
            hashes=self.prompt_hashes(tokens, request.extras),
        )
        if request.constraint is not None:
            req.document = request.constraint.tokens(before)
            req.document_start = resumed
            if resumed and (req.document or ())[:resumed] != tuple(tokens[-resumed:]):
                raise ValueError(
                    "cache_hit_resume_tokens: the prompt's last tokens are not the start "
                    "of this constraint's output"
                )
        return req

    def _digest_req(self, request: EngineRequest) -> _Req:
        digest = request.digest
        assert digest is not None
        digest.check(self.config.block_size)
        if self.config.record_events:
            raise ValueError("requests with a prompt digest cannot be used with record_events")
        return _Req(
            spec=request,
            tokens=list(digest.tail),
            num_prompt=digest.num_tokens,
            state=digest.state,
            hashes=list(digest.block_hashes),
            offset=digest.offset,
        )

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request and free its blocks; False if unknown."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if req in self._running:
            self._running.remove(req)
        elif req in self._waiting:
            self._waiting.remove(req)
        self.pool.free(req.blocks)
        req.blocks = []
        self._count_finish(FinishReason.ABORT)
        return True

    def release(self, key: str) -> HeldTransfer | None:
        """Hand over (and free) the blocks a producer holds under ``key``."""
        held = self._held.pop(key, None)
        if held is not None:
            for alias in held.keys:
                self._held.pop(alias, None)
            self.pool.free(held.block_ids)
        return held

    def reset_prefix_cache(self) -> bool:
        """Clear the prefix cache if no block is in use (vLLM's ``/reset_prefix_cache``)."""
        return self.pool.reset()

    # -- the step -----------------------------------------------------------------
    def step(self, now: float) -> StepResult:
        """Schedule and run one step starting at ``now``; see the module docstring."""
        self.expire_leases(now)
        outputs: list[RequestOutput] = []
        budget = self.config.max_num_batched_tokens
        scheduled, budget, preempted = self._schedule_running(budget)
        if not preempted:
            scheduled += self._schedule_waiting(budget, outputs)
        duration = self._step_seconds(scheduled)
        for req, count in scheduled:
            output = self._compute(req, count, now + duration)
            if output is not None:
                outputs.append(output)
        return StepResult(duration, tuple(outputs), bool(scheduled or outputs or preempted))

    def _schedule_running(self, budget: int) -> tuple[list[tuple[_Req, int]], int, bool]:
        scheduled: list[tuple[_Req, int]] = []
        preempted = False
        index = 0
        while index < len(self._running):
            req = self._running[index]
            count = 1 if req.decoding else min(req.num_tokens - req.num_computed, budget)
            if count <= 0:
                index += 1
                continue
            while not self._grow(req, count):
                victim = self._running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    return scheduled, budget, preempted
            scheduled.append((req, count))
            budget -= count
            index += 1
        return scheduled, budget, preempted

    def _schedule_waiting(
        self, budget: int, outputs: list[RequestOutput]
    ) -> list[tuple[_Req, int]]:
        scheduled: list[tuple[_Req, int]] = []
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            req = self._waiting[0]
            admitted = self._try_admit(req, budget, outputs)
            if admitted is None:
                break
            self._waiting.popleft()
            if admitted > 0:
                scheduled.append((req, admitted))
                budget -= admitted
        return scheduled

    def _try_admit(self, req: _Req, budget: int, outputs: list[RequestOutput]) -> int | None:
        """Admit, reject (returns 0) or leave waiting (returns None) the head request."""
        num_tokens = req.num_tokens
        hit_blocks = self.pool.longest_hit(req.hashes, self._max_hit_blocks(num_tokens))
        local = len(hit_blocks) * self.config.block_size
        external = self._external_beyond(req, local, num_tokens)
        if self._rejects(req, local + external, num_tokens):
            self._count_queries(req, local, external)
            if req.status is _Status.PREEMPTED:
                self.stats.threshold_rejections_preemption += 1
            else:
                self.stats.threshold_rejections_admission += 1
            outputs.append(self._finish(req, FinishReason.CACHE_THRESHOLD, ()))
            return 0
        computed = local + external
        count = min(num_tokens - computed, budget)
        needed = self._blocks_for(computed + count) - len(hit_blocks)
        reusable_free = sum(1 for b in hit_blocks if self.pool.is_free(b))
        if needed > self.pool.num_free - reusable_free:
            return None
        self._count_queries(req, local, external)
        self.pool.touch(hit_blocks)
        req.blocks = hit_blocks + self.pool.allocate(needed)
        req.num_cached_blocks = len(hit_blocks)
        req.num_computed = computed
        self._cache_full_blocks(req)
        if external and not req.spec.external_tokens:
            req.load_seconds = self.config.profile.transfer_seconds(external)
        if req.cached_tokens is None:
            self.stats.prompt_tokens += req.num_prompt
            req.cached_tokens = computed
            req.external_tokens = external
        req.status = _Status.RUNNING
        req.admit_seq = next(self._admissions)
        self._running.append(req)
        return count

    def _rejects(self, req: _Req, hit: int, num_tokens: int) -> bool:
        spec = req.spec
        if spec.do_remote_decode:
            return False
        resumed = req.status is _Status.PREEMPTED
        if resumed and spec.admission_only:
            return False  # recomputed where it is, as stock vLLM does
        if spec.force_reject:
            return True
        threshold = spec.cache_hit_threshold
        if threshold is None:
            threshold = self.config.global_cache_hit_threshold
        if resumed and threshold <= 0.0:
            return False
        return threshold > 0.0 and hit_ratio(hit, num_tokens) < threshold

    def _external_beyond(self, req: _Req, local: int, num_tokens: int) -> int:
        if num_tokens == 0 or (req.status is _Status.PREEMPTED and req.spec.external_tokens):
            return 0  # pulled KV is consumed by the first admission
        loadable = self.external.loadable_tokens(req.spec, req.hashes)
        return max(0, min(loadable, num_tokens - 1) - local)

    def _count_queries(self, req: _Req, local: int, external: int) -> None:
        stats = self.stats
        stats.prefix_queries += req.num_tokens
        stats.prefix_hits += local
        if self.config.kv_connector is not None:
            stats.external_queries += req.num_tokens - local
            stats.external_hits += external

    def _max_hit_blocks(self, num_tokens: int) -> int:
        return max(0, num_tokens - 1) // self.config.block_size

    def _local_hit_blocks_count(self, hashes: Sequence[bytes], num_tokens: int) -> int:
        return len(self.pool.longest_hit(hashes, self._max_hit_blocks(num_tokens)))

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _grow(self, req: _Req, count: int) -> bool:
        """Allocate blocks so ``req`` can compute ``count`` more tokens."""
        needed = self._blocks_for(req.num_computed + count) - len(req.blocks)
        if needed <= 0:
            return True
        if needed > self.pool.num_free:
            return False
        req.blocks += self.pool.allocate(needed)
        return True

    def _preempt(self, req: _Req) -> None:
        self.pool.free(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_cached_blocks = 0
        req.status = _Status.PREEMPTED
        self._waiting.appendleft(req)
        self.stats.preemptions += 1

    def _step_seconds(self, scheduled: Sequence[tuple[_Req, int]]) -> float:
        profile = self.config.profile
        context = 0
        decoding = 0
        load = 0.0
        chunks: list[tuple[int, int]] = []
        for req, count in scheduled:
            load += req.load_seconds
            req.load_seconds = 0.0
            if req.decoding:
                decoding += 1
                context += req.num_computed + 1
            else:
                chunks.append((count, req.num_computed))
        return profile.step_seconds(context, decoding, chunks, load)

    def _compute(self, req: _Req, count: int, finish_time: float) -> RequestOutput | None:
        was_decoding = req.decoding
        req.num_computed += count
        if not was_decoding:
            self.stats.prefill_computed_tokens += count
        self._cache_full_blocks(req)
        if req.num_computed < req.num_tokens:
            return None
        if not req.prompt_saved and req.num_computed >= req.num_prompt:
            req.prompt_saved = True
            self.external.save(req.spec, req.hashes[: req.num_prompt // self.config.block_size])
        return self._sample(req, finish_time)

    def _sample(self, req: _Req, finish_time: float) -> RequestOutput:
        sampling = req.spec.sampling
        if req.document is not None:  # the constraint's document, then EOS
            index = req.document_start + req.num_output
            token = req.document[index] if index < len(req.document) else EOS_TOKEN_ID
        else:
            allow_eos = not sampling.ignore_eos and req.num_output >= sampling.min_tokens
            token = next_token(req.state, allow_eos=allow_eos)
        req.tokens.append(token)
        req.state = advance(req.state, token)
        self.hasher.extend(req.hashes, req.tokens, req.spec.extras, req.offset)
        self.stats.generation_tokens += 1
        if token == EOS_TOKEN_ID:
            return self._finish(req, FinishReason.STOP, (token,))
        if req.num_output >= sampling.max_tokens:
            return self._finish(req, FinishReason.LENGTH, (token,), finish_time)
        return self._output(req, (token,), None)

    def _cache_full_blocks(self, req: _Req) -> None:
        full = min(req.num_computed // self.config.block_size, len(req.hashes), len(req.blocks))
        if full > req.num_cached_blocks:
            self.pool.cache_blocks(
                req.blocks, req.hashes, req.num_cached_blocks, full, req.tokens, req.spec.extras
            )
            req.num_cached_blocks = full

    def _finish(
        self,
        req: _Req,
        reason: FinishReason,
        new_tokens: tuple[int, ...],
        now: float | None = None,
    ) -> RequestOutput:
        if req in self._running:
            self._running.remove(req)
        del self._requests[req.spec.request_id]
        transfer = None
        if self._holds_for_transfer(req, reason) and now is not None:
            transfer = self._hold(req, now)
        else:
            self.pool.free(req.blocks)
        req.blocks = []
        self._count_finish(reason)
        return self._output(req, new_tokens, reason, transfer)

    def _hold_keys(self, spec: EngineRequest) -> tuple[str, ...]:
        if spec.hold_keys is not None:
            return spec.hold_keys
        pull_based = self.config.kv_connector == "nixl"
        return (spec.request_id,) if pull_based and spec.do_remote_decode else ()

    def _holds_for_transfer(self, req: _Req, reason: FinishReason) -> bool:
        """Producers keep their blocks for a consumer when they ended by length."""
        return bool(self._hold_keys(req.spec)) and reason is FinishReason.LENGTH

    def _hold(self, req: _Req, now: float) -> HeldTransfer:
        held = HeldTransfer(
            request_id=req.spec.request_id,
            block_ids=tuple(req.blocks),
            block_hashes=tuple(req.hashes[: req.num_prompt // self.config.block_size]),
            num_tokens=req.num_prompt,
            deadline=now + self.config.lease_seconds,
            keys=self._hold_keys(req.spec),
        )
        for key in held.keys:
            self._held[key] = held
        return held

    def expire_leases(self, now: float) -> None:
        """Free the blocks of every lease whose deadline is ``now`` or earlier."""
        for key in [key for key, held in self._held.items() if held.deadline <= now]:
            self.release(key)

    def _count_finish(self, reason: FinishReason) -> None:
        finished = self.stats.finished
        finished[reason.value] = finished.get(reason.value, 0) + 1

    def _output(
        self,
        req: _Req,
        new_tokens: tuple[int, ...],
        reason: FinishReason | None,
        transfer: HeldTransfer | None = None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=req.spec.request_id,
            new_token_ids=new_tokens,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt,
            num_cached_tokens=req.cached_tokens or 0,
            num_external_tokens=req.external_tokens,
            num_output_tokens=req.num_output,
            transfer=transfer,
        )
