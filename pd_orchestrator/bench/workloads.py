"""Benchmark workloads: deterministic request lists with realistic prefix reuse.

A prompt is a tuple of :class:`Segment`: ``length`` tokens of content ``key``.
The tokens of a content are a pure function of its key (:func:`token_at`), so two
prompts share exactly the segments they have in common, and a prompt can be turned
into token ids (:func:`materialize`, for HTTP runs) or into a
:class:`~pd_orchestrator.sim.digest.PromptDigest` without ever building its tokens
(:func:`digest_segments`, for the virtual fleet).

A :class:`BenchRequest` arrives at ``arrival`` seconds (open loop), or -- when
``after`` names an earlier request of its session -- ``think_time`` seconds after
that request finished (closed loop within a conversation). With ``extends`` its
prompt is the earlier request's prompt, that request's output tokens and then its
own segments, as a chat client re-sends the history with the model's answer.
Output lengths are fixed (``max_tokens`` with ``ignore_eos``).

Generators (every one seeded; the same arguments give the same list):

* :func:`mooncake` -- the Mooncake conversation trace: hash id ``b`` is the
  content of one trace block (512 tokens, or ``512 * size_scale``), a prompt is its
  hash ids' blocks truncated to the (scaled) input length; timestamps are scaled by
  ``time_scale``; output lengths are kept (scaled by ``size_scale``). The seed picks
  the window: seed ``k`` replays trace lines ``k * requests + 1`` to ``(k + 1) *
  requests``, its clock starting at the window's first timestamp, so draws of one
  trace are disjoint stretches of it (seed 0: the trace's start); ``trace_offset``
  moves every window that many lines further. The trace's timestamps come in steps
  (3 s in the conversation trace), so a literal replay sends each step's requests
  as one burst: by default each step's requests are spread uniformly (seeded, in
  their trace order) over ``[t, t + step)``, the step detected from the window's
  distinct timestamps (:func:`timestamp_step`); ``bursts`` replays them as they are.
* :func:`shared_prefix` -- groups x users: a system prompt of 2048-6000 tokens per
  group, a question of 256-1200 tokens per user, 256 output tokens, Poisson
  arrivals.
* :func:`multi_turn` -- conversations of 5-20 turns on a common short system
  prompt, starting open loop (Poisson); each turn re-sends the history plus a new
  user message after the previous answer and a think time; a request budget keeps
  the first turns in nominal time, so it spans many conversations. The first message
  (704-1600 tokens, context pasted by the user) puts the conversation's own tokens
  within its first 1024, the prefix a gateway keys a token prompt's affinity on.
* :func:`long_doc` -- documents of 8k-32k tokens with a short question; a small
  share of requests ask about a document seen before.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from pd_orchestrator.model.records import record
from pd_orchestrator.sim.digest import PromptDigest
from pd_orchestrator.sim.generation import advance, advance_all
from pd_orchestrator.sim.tokenizer import NUM_WORDS, WORD_BASE

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "MOONCAKE_DEVELOPMENT_LINES",
    "WORKLOADS",
    "BenchRequest",
    "Segment",
    "Workload",
    "WorkloadOptions",
    "build_workload",
    "content_key",
    "digest_segments",
    "long_doc",
    "materialize",
    "mooncake",
    "multi_turn",
    "shared_prefix",
    "timestamp_step",
    "token_at",
    "warm_up_options",
    "warmed",
]

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per hash id in the Mooncake trace."""

MOONCAKE_DEVELOPMENT_LINES = 2400
"""The trace lines the benchmarks were developed on (``--requests 600 --seeds 4``:
lines 1-2400); a window past them is held out (docs/benchmarks.md)."""

WORKLOADS = ("mooncake", "shared-prefix", "multi-turn", "long-doc")

_ROOT = b"pd-orchestrator/bench/digest"
_KEY_POS = struct.Struct("<QI")
_PIECE = struct.Struct("<QII")
_INDEX = struct.Struct("<I")


@record
class Segment:
    """``length`` tokens of the content ``key``, from the content's first token."""

    key: int
    length: int

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError("a segment has at least one token")


@record
class BenchRequest:
    """One request of a workload; see the module docstring for the timing rules."""

    index: int
    session: str
    turn: int
    segments: tuple[Segment, ...]
    max_tokens: int
    arrival: float = 0.0
    after: int | None = None
    think_time: float = 0.0
    extends: bool = False

    @property
    def own_tokens(self) -> int:
        """Tokens of this request's own segments (without an extended history)."""
        return sum(segment.length for segment in self.segments)


@record
class Workload:
    """A named, ordered request list (indexes are positions in the list)."""

    name: str
    description: str
    requests: tuple[BenchRequest, ...]
    window: str = ""
    """A trace replay's window (its lines, and whether development used them)."""
    warm_up: int = 0
    """The first ``warm_up`` requests are a warm-up (:func:`warmed`): served, and
    learnt from, but not counted in the results."""
    pause: float = 0.0
    """Seconds between the warm-up's last request finishing and the measured
    requests' clock starting."""

    def __post_init__(self) -> None:
        if not 0 <= self.warm_up <= len(self.requests):
            raise ValueError("the warm-up is 0 to all of the requests")
        if not self.pause >= 0.0:
            raise ValueError("the pause after the warm-up must be >= 0 seconds")
        for position, request in enumerate(self.requests):
            if request.index != position:
                raise ValueError(f"request {request.index} is at position {position}")
            if request.after is not None and not 0 <= request.after < position:
                raise ValueError(f"request {position} follows a later request")

    def __len__(self) -> int:
        return len(self.requests)


@record
class WorkloadOptions:
    """Knobs common to every generator.

    ``requests``: keep at most this many (sessions are cut whole where the generator
    has them). ``time_scale``: multiply every arrival and think time (0.5 = twice
    the load). ``size_scale``: multiply every length. ``rate``: arrivals per second
    for the synthetic workloads (None: the generator's default). ``seed``: the
    random draws. ``trace``: the Mooncake trace file; ``trace_offset``: trace lines
    skipped before the seed's window; ``bursts``: replay the trace's timestamps as
    they are instead of spreading each step's requests over the step.
    """

    requests: int | None = None
    time_scale: float = 1.0
    size_scale: float = 1.0
    rate: float | None = None
    seed: int = 0
    trace: Path | None = None
    trace_offset: int = 0
    bursts: bool = False

    def __post_init__(self) -> None:
        if self.trace_offset < 0:
            raise ValueError("the trace offset must be >= 0")
        if self.time_scale <= 0 or self.size_scale <= 0:
            raise ValueError("time and size scales must be > 0")
        if self.requests is not None and self.requests < 1:
            raise ValueError("requests must be >= 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be > 0")

    def tokens(self, count: float) -> int:
        """``count`` tokens scaled by ``size_scale`` (at least one)."""
        return max(1, round(count * self.size_scale))


# -- content ---------------------------------------------------------------------------------
def content_key(*parts: object) -> int:
    """A 64-bit content key derived from ``parts`` (stable across runs and processes)."""
    text = "\x00".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def token_at(key: int, position: int) -> int:
    """Token ``position`` of content ``key``: always a word token of the simulator."""
    return WORD_BASE + advance(key, position) % NUM_WORDS


def _tokens(key: int, start: int, stop: int) -> list[int]:
    return [WORD_BASE + advance(key, i) % NUM_WORDS for i in range(start, stop)]


def materialize(segments: Iterable[Segment]) -> list[int]:
    """The token ids of a prompt made of ``segments``."""
    tokens: list[int] = []
    for segment in segments:
        tokens += _tokens(segment.key, 0, segment.length)
    return tokens


def _hash(parent: bytes, payload: bytes) -> bytes:
    return hashlib.blake2b(parent + payload, digest_size=16).digest()


@dataclass
class _Digester:
    """Walks segments block by block; see :func:`digest_segments`."""

    block_size: int
    hashes: list[bytes] = field(default_factory=list)
    pieces: list[tuple[int, int, int]] = field(default_factory=list)
    fill: int = 0

    @property
    def parent(self) -> bytes:
        return self.hashes[-1] if self.hashes else _ROOT

    def add(self, segment: Segment) -> None:
        size, position = self.block_size, 0
        while position < segment.length:
            left = segment.length - position
            if self.fill == 0 and left >= size:
                position += self._run(segment.key, position, left // size)
                continue
            take = min(size - self.fill, left)
            self.pieces.append((segment.key, position, take))
            self.fill += take
            position += take
            if self.fill == size:
                payload = b"".join(_PIECE.pack(*piece) for piece in self.pieces)
                self.hashes.append(_hash(self.parent, payload))
                self.pieces, self.fill = [], 0

    def _run(self, key: int, position: int, blocks: int) -> int:
        anchor = _hash(self.parent, _KEY_POS.pack(key, position))
        self.hashes += [anchor + _INDEX.pack(j) for j in range(blocks)]
        return blocks * self.block_size

    def tail(self) -> list[int]:
        tokens: list[int] = []
        for key, start, count in self.pieces:
            tokens += _tokens(key, start, start + count)
        return tokens


def digest_segments(segments: Sequence[Segment], block_size: int) -> PromptDigest:
    """A digest of the prompt made of ``segments`` for an engine of ``block_size``.

    Blocks wholly inside one segment hash as ``anchor + index`` (one real hash per
    run of blocks); a block spanning segments hashes its pieces. Equal prefixes give
    equal hashes and different ones different hashes, which is all the engine needs
    (see :mod:`pd_orchestrator.sim.digest`); the hashes differ from the engine's own
    token hashes, so digests and token prompts must not be mixed in one engine.
    """
    digester = _Digester(block_size)
    for segment in segments:
        digester.add(segment)
    tail = digester.tail()
    seed = int.from_bytes(_hash(digester.parent, b"state")[:8], "little")
    total = sum(segment.length for segment in segments)
    return PromptDigest(total, tuple(digester.hashes), tuple(tail), advance_all(seed, tail))


# -- generators ------------------------------------------------------------------------------
def _limit(requests: list[BenchRequest], limit: int | None) -> tuple[BenchRequest, ...]:
    """The first ``limit`` requests (a request only follows earlier ones, so every
    kept request keeps its predecessor; a conversation may lose its last turns)."""
    return tuple(requests if limit is None else requests[:limit])


def _poisson(rng: random.Random, count: int, rate: float) -> list[float]:
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def mooncake(options: WorkloadOptions) -> Workload:
    """The Mooncake conversation trace (``options.trace``); see the module docstring."""
    if options.trace is None:
        raise ValueError(
            "the mooncake workload needs the trace file (--trace or $PDO_MOONCAKE_TRACE)"
        )
    block = options.tokens(MOONCAKE_BLOCK_TOKENS)
    skip = _window_start(options)
    records: list[_TraceRecord] = []
    with options.trace.open() as lines:
        for number, line in enumerate(itertools.islice(lines, skip, None), skip + 1):
            if options.requests is not None and len(records) >= options.requests:
                break
            records.append(_TraceRecord.parse(line, number))
    if not records:
        raise ValueError(f"the trace ends before seed {options.seed}'s window (line {skip + 1})")
    stamps = [record.timestamp_ms for record in records]
    step = 0.0 if options.bursts else timestamp_step(stamps)
    arrivals = _spread(stamps, step, random.Random(options.seed))
    requests = [
        _mooncake_request(i, record, block, (arrival - stamps[0]) / 1000.0, options)
        for i, (record, arrival) in enumerate(zip(records, arrivals, strict=True))
    ]
    replay = "bursts as recorded" if step == 0.0 else f"spread over {step / 1000.0:.3g}s steps"
    used = "development" if skip < MOONCAKE_DEVELOPMENT_LINES else "held out"
    window = f"lines {skip + 1}-{skip + len(requests)}, {used}"
    return Workload(
        "mooncake",
        f"Mooncake conversation trace, {len(requests)} requests, {window}, {block} tokens "
        f"per hash id, {replay}, time x{options.time_scale:g}",
        tuple(requests),
        window,
    )


def timestamp_step(stamps: Sequence[float]) -> float:
    """The step the timestamps ``stamps`` come in (0.0 for fewer than two distinct
    values): the gaps between consecutive distinct values are taken as multiples of
    the smallest one that is not jitter (at least a quarter of the median gap), and
    the step is their total over the number of steps they span -- about 3000 ms for
    the Mooncake conversation trace, whose gaps are 2997-3003 ms or multiples."""
    values = sorted(set(stamps))
    gaps = sorted(b - a for a, b in itertools.pairwise(values))
    if not gaps:
        return 0.0
    median = gaps[len(gaps) // 2]
    kept = [gap for gap in gaps if gap >= median / 4]
    base = kept[0]
    return sum(kept) / sum(max(1, round(gap / base)) for gap in kept)


def _spread(stamps: Sequence[float], step: float, rng: random.Random) -> list[float]:
    """``stamps`` (ms, in trace order) with each run of equal values spread over
    ``[t, t + step)``: sorted uniform draws from ``rng``, so arrivals keep the trace's
    order; unchanged for ``step`` 0."""
    if step <= 0.0:
        return list(stamps)
    arrivals: list[float] = []
    for stamp, run in itertools.groupby(stamps):
        offsets = sorted(rng.random() * step for _ in run)
        arrivals.extend(stamp + offset for offset in offsets)
    return arrivals


def _window_start(options: WorkloadOptions) -> int:
    """Trace lines before seed ``options.seed``'s window (module docstring)."""
    if options.seed < 0:
        raise ValueError("the seed of a trace replay must be >= 0")
    if options.seed and options.requests is None:
        raise ValueError("a seed other than 0 picks a window of the trace: it needs --requests")
    return options.trace_offset + options.seed * (options.requests or 0)


@record
class _TraceRecord:
    """One line of the Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @classmethod
    def parse(cls, line: str, number: int) -> _TraceRecord:
        try:
            data = json.loads(line)
            record = cls(
                float(data["timestamp"]),
                int(data["input_length"]),
                int(data["output_length"]),
                tuple(int(h) for h in data["hash_ids"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"trace line {number}: {exc!r}") from None
        if not record.hash_ids or record.input_length < 1:
            raise ValueError(f"trace line {number}: no hash ids or no input tokens")
        return record


def _mooncake_request(
    index: int, record: _TraceRecord, block: int, arrival: float, options: WorkloadOptions
) -> BenchRequest:
    """The request of ``record`` arriving ``arrival`` trace seconds after the window's
    start (before ``time_scale``)."""
    length = min(options.tokens(record.input_length), block * len(record.hash_ids))
    segments = []
    for hash_id in record.hash_ids:
        take = min(block, length)
        if take <= 0:
            break
        segments.append(Segment(hash_id, take))
        length -= take
    return BenchRequest(
        index=index,
        session=f"mc-{index}",
        turn=0,
        segments=tuple(segments),
        max_tokens=options.tokens(record.output_length),
        arrival=arrival * options.time_scale,
    )


def shared_prefix(
    options: WorkloadOptions, groups: int = 16, users: int = 64, output: int = 256
) -> Workload:
    """Groups x users sharing one system prompt per group; Poisson arrivals.

    More requests than ``groups * users`` (``options.requests``) add users to every
    group, so a longer draw is not cut short; a draw of at most that many is the same
    whatever its length."""
    rng = random.Random(options.seed)
    if options.requests is not None:
        users = max(users, -(-options.requests // groups))
    systems = [
        Segment(content_key("system", g), options.tokens(rng.randint(2048, 6000)))
        for g in range(groups)
    ]
    prompts = [
        (g, u, Segment(content_key("question", g, u), options.tokens(rng.randint(256, 1200))))
        for g in range(groups)
        for u in range(users)
    ]
    rng.shuffle(prompts)
    rate = options.rate or 40.0
    times = _poisson(rng, len(prompts), rate)
    requests = [
        BenchRequest(
            index=i,
            session=f"g{g}-u{u}",
            turn=0,
            segments=(systems[g], question),
            max_tokens=options.tokens(output),
            arrival=t * options.time_scale,
        )
        for i, ((g, u, question), t) in enumerate(zip(prompts, times, strict=True))
    ]
    return Workload(
        "shared-prefix",
        f"{groups} groups x {users} users, system 2048-6000, question 256-1200, "
        f"output {output}, {rate:g} req/s x{1 / options.time_scale:g}",
        _limit(requests, options.requests),
    )


def multi_turn(options: WorkloadOptions, conversations: int = 128, think: float = 4.0) -> Workload:
    """Conversations of 5-20 turns; each turn re-sends the history and a new message.

    Conversations start open loop (seeded Poisson at ``options.rate``, 2/s by
    default); within one, a turn follows the previous answer after a think time
    (closed loop). With ``options.requests`` the workload is the first that many
    turns in nominal time (a conversation's start plus its think times so far), of
    as many conversations as it takes -- not the first conversations whole, which
    would put every request of a short run in a few closed loops and cap the
    requests in flight at their count whatever the rate.
    """
    rng = random.Random(options.seed)
    system = Segment(content_key("chat-system"), options.tokens(320))
    rate = options.rate or 2.0
    count = conversations if options.requests is None else max(conversations, options.requests)
    turns: list[tuple[float, int, int, BenchRequest]] = []
    for c, start in enumerate(_poisson(rng, count, rate)):
        nominal = start
        for turn in range(rng.randint(5, 20)):
            size = rng.randint(704, 1600) if turn == 0 else rng.randint(40, 400)
            message = Segment(content_key("chat-user", c, turn), options.tokens(size))
            think_time = rng.expovariate(1 / think)
            nominal += think_time if turn else 0.0
            request = BenchRequest(
                index=0,
                session=f"conv-{c}",
                turn=turn,
                segments=(system, message) if turn == 0 else (message,),
                max_tokens=options.tokens(rng.randint(100, 400)),
                arrival=start * options.time_scale,
                think_time=think_time * options.time_scale,
                extends=turn > 0,
            )
            turns.append((nominal, c, turn, request))
    turns.sort(key=lambda item: item[:3])
    kept = turns if options.requests is None else turns[: options.requests]
    requests: list[BenchRequest] = []
    last: dict[str, int] = {}
    for _, _, _, request in kept:
        index = len(requests)
        requests.append(replace(request, index=index, after=last.get(request.session)))
        last[request.session] = index
    sessions = len(last)
    return Workload(
        "multi-turn",
        f"{sessions} conversations of 5-20 turns (the first {len(requests)} turns), "
        f"open-loop starts at {rate:g} conversations/s x{1 / options.time_scale:g}, "
        f"think time {think:g}s",
        tuple(requests),
    )


def long_doc(options: WorkloadOptions, count: int = 240, reuse: float = 0.1) -> Workload:
    """Questions about long documents (8k-32k tokens); ``reuse`` of them re-ask one."""
    rng = random.Random(options.seed)
    rate = options.rate or 3.0
    documents: list[Segment] = []
    requests: list[BenchRequest] = []
    for i, t in enumerate(_poisson(rng, count, rate)):
        if documents and rng.random() < reuse:
            document = rng.choice(documents)
        else:
            document = Segment(
                content_key("doc", len(documents)), options.tokens(rng.randint(8192, 32768))
            )
            documents.append(document)
        question = Segment(content_key("doc-question", i), options.tokens(rng.randint(32, 256)))
        requests.append(
            BenchRequest(
                index=i,
                session=f"doc-{i}",
                turn=0,
                segments=(document, question),
                max_tokens=options.tokens(rng.randint(128, 384)),
                arrival=t * options.time_scale,
            )
        )
    return Workload(
        "long-doc",
        f"{count} questions on 8k-32k-token documents, {reuse:.0%} re-asked, "
        f"{rate:g} req/s x{1 / options.time_scale:g}",
        _limit(requests, options.requests),
    )


_GENERATORS: dict[str, Callable[[WorkloadOptions], Workload]] = {
    "mooncake": mooncake,
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "long-doc": long_doc,
}


def warm_up_options(name: str, options: WorkloadOptions, requests: int) -> WorkloadOptions:
    """The options of a ``requests``-request warm-up for the workload ``name`` of
    ``options``: of the trace replay, the ``requests`` lines just after its window;
    of a synthetic generator, another draw (seed + 1000)."""
    if name == "mooncake":
        after = _window_start(options) + (options.requests or 0)
        return replace(options, requests=requests, seed=0, trace_offset=after)
    return replace(options, requests=requests, seed=options.seed + 1000)


def warmed(warm: Workload, measured: Workload, pause: float) -> Workload:
    """``measured`` after the warm-up ``warm``: ``warm``'s requests first, on contents
    of their own (no prompt of the warm-up shares a token block with a measured one,
    so the warm-up teaches rates and lengths, not the measured prompts' prefixes),
    then ``measured``'s, whose arrival times count from ``pause`` seconds after the
    warm-up's last request has finished (a runner holds them until then, so none
    queues behind a warm-up request, and what a policy counts over a recent window
    has time to decay). A runner counts ``measured``'s requests only
    (:attr:`Workload.warm_up`)."""
    first = len(warm)
    head = tuple(
        replace(
            r, session=f"warm-up {r.session}",
            segments=tuple(Segment(content_key("warm-up", s.key), s.length) for s in r.segments),
        )
        for r in warm.requests
    )  # fmt: skip
    tail = tuple(
        replace(r, index=first + r.index, after=None if r.after is None else first + r.after)
        for r in measured.requests
    )
    description = f"{measured.description}, after a warm-up of {first} requests and {pause:g} s"
    return replace(
        measured, description=description, requests=head + tail, warm_up=first, pause=pause
    )


def build_workload(name: str, options: WorkloadOptions) -> Workload:
    """The workload called ``name`` (one of :data:`WORKLOADS`) with its default shape."""
    try:
        generator = _GENERATORS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})") from None
    return generator(options)
