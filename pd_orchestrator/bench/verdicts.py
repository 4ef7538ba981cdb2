"""Judging a gateway's answers token for token against a reference instance.

The simulator's generation is a pure function of (seed, model, history)
(:mod:`pd_orchestrator.sim.generation`): with temperature 0 the same request to a
reference instance gives the tokens every answer must have, whatever faults the
gateway worked around. Every request must end either

* **identical**: token for token the reference's answer, with one finish reason (a
  string) per choice, or
* with **one clean error**: an HTTP error in the OpenAI shape, or a stream whose
  tokens so far are the reference's first ones, then one error event in that shape,
  then ``[DONE]``.

Anything else is **lost** (tokens missing or different, a stream cut without
``[DONE]``, an error in another shape) or **duplicated** (more tokens than the
reference). A request with ``n`` > 1 is judged choice by choice (each choice of a
request without a ``seed`` is the reference's one answer) and gets its worst verdict.
A client that leaves mid-stream (``leave_after``) must have had a prefix of the
reference's tokens.

Used by the chaos suite and the soak (:mod:`pd_orchestrator.bench.soak`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

__all__ = [
    "CLEAN_ERROR",
    "DUPLICATED",
    "HUNG",
    "IDENTICAL",
    "LEFT",
    "LOST",
    "Answer",
    "Job",
    "Progress",
    "client",
    "judge",
    "judge_job",
    "openai_error",
    "send",
]

IDENTICAL, CLEAN_ERROR, LOST, DUPLICATED, HUNG, LEFT = (
    "identical",
    "clean_error",
    "lost",
    "duplicated",
    "hung",
    "left",
)
_WORST = (LOST, DUPLICATED, HUNG, CLEAN_ERROR, LEFT, IDENTICAL)
"""Verdicts from worst to best (a request with several choices gets its worst)."""


@dataclass(frozen=True)
class Job:
    """One request: its API (``completion`` or ``chat``) and body; ``leave_after``: the
    client closes a stream once it got that many tokens (None: it reads to the end)."""

    kind: str
    body: dict[str, Any]
    leave_after: int | None = None

    @property
    def path(self) -> str:
        return "/v1/completions" if self.kind == "completion" else "/v1/chat/completions"

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def choices(self) -> int:
        n = self.body.get("n")
        return n if isinstance(n, int) and n > 1 else 1


@dataclass
class Answer:
    """What a client got: status, the token ids before any error (``by_index``: per
    choice index), the finish reasons, the error (OpenAI shape or not), whether a
    stream ended with ``[DONE]``, whether anything followed its error event, whether
    the client left early and when the first token came (seconds after sending)."""

    status: int
    tokens: list[int] = field(default_factory=list)
    finishes: list[Any] = field(default_factory=list)
    error: Any = None
    done: bool = True
    after_error: bool = False
    by_index: dict[int, list[int]] = field(default_factory=dict)
    finishes_by_index: dict[int, list[Any]] = field(default_factory=dict)
    left: bool = False
    first_token: float | None = None

    def choice(self, index: int) -> Answer:
        """The answer as the client got it for choice ``index`` alone."""
        return Answer(
            self.status,
            list(self.by_index.get(index, [])),
            list(self.finishes_by_index.get(index, [])),
            self.error,
            self.done,
            self.after_error,
            left=self.left,
        )


class Progress:
    """Tokens streamed to clients so far (a fault may wait for some)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.streams_started = 0

    async def wait(self, *, tokens: int = 0, streams: int = 0, bound: float = 30.0) -> None:
        with anyio.fail_after(bound):
            while self.tokens < tokens or self.streams_started < streams:  # noqa: ASYNC110
                await anyio.sleep(0.05)


def client(concurrency: int, timeout: float) -> httpx.AsyncClient:
    """A client for judged requests. Idle connections expire after 2 s, before the
    gateway's server closes them (uvicorn: 5 s): a request sent on a connection the
    server is closing at that moment would be lost by the client, not by the gateway."""
    limits = httpx.Limits(
        max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=2.0
    )
    return httpx.AsyncClient(timeout=timeout, limits=limits)


def _take(answer: Answer, chunk: dict[str, Any]) -> list[int]:
    """Add a chunk's (or a whole answer's) tokens and finish reasons to ``answer``;
    returns its token ids."""
    ids: list[int] = []
    for choice in chunk.get("choices") or []:
        index = choice.get("index", 0) if isinstance(choice, dict) else -1
        index = index if isinstance(index, int) else -1
        got = list(choice.get("token_ids") or []) if isinstance(choice, dict) else []
        ids += got
        answer.by_index.setdefault(index, []).extend(got)
        finish = choice.get("finish_reason") if isinstance(choice, dict) else None
        if finish is not None:
            answer.finishes.append(finish)
            answer.finishes_by_index.setdefault(index, []).append(finish)
    answer.tokens += ids
    return ids


async def send(
    client: httpx.AsyncClient, url: str, job: Job, progress: Progress | None = None
) -> Answer:
    """Send ``job`` and read its whole answer (or, ``job.leave_after``, until the
    client leaves)."""
    started = anyio.current_time()
    if not job.stream:
        response = await client.post(url + job.path, json=job.body)
        data = response.json()
        if response.status_code != 200:
            return Answer(response.status_code, error=data)
        answer = Answer(200)
        _take(answer, data)
        return answer
    async with client.stream("POST", url + job.path, json=job.body) as response:
        if response.status_code != 200:
            return Answer(response.status_code, error=json.loads(await response.aread()))
        answer = Answer(200, done=False)
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                answer.done = True
                break
            if answer.error is not None:
                answer.after_error = True
            chunk = json.loads(payload)
            if "error" in chunk:
                answer.error = chunk
                continue
            ids = _take(answer, chunk)
            if ids and answer.first_token is None:
                answer.first_token = anyio.current_time() - started
                if progress is not None:
                    progress.streams_started += 1
            if progress is not None:
                progress.tokens += len(ids)
            if job.leave_after is not None and len(answer.tokens) >= job.leave_after:
                answer.left = True
                break
    return answer


def openai_error(body: Any) -> bool:
    """Whether ``body`` is an error in the OpenAI shape (message, type, integer code)."""
    inner = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(inner, dict)
        and isinstance(inner.get("message"), str)
        and isinstance(inner.get("type"), str)
        and isinstance(inner.get("code"), int)
    )


def judge(answer: Answer, expected: list[int]) -> str:
    """The verdict on a one-choice ``answer`` against the reference's tokens (see the
    module doc)."""
    tokens = answer.tokens
    if answer.left and answer.error is None:
        if tokens == expected[: len(tokens)]:
            return LEFT
        return DUPLICATED if len(tokens) > len(expected) else LOST
    if answer.error is None and answer.status == 200 and answer.done:
        if tokens == expected:
            finishes = answer.finishes
            return IDENTICAL if len(finishes) == 1 and isinstance(finishes[0], str) else LOST
        return DUPLICATED if len(tokens) > len(expected) else LOST
    clean = openai_error(answer.error) and answer.done and not answer.after_error
    if not clean:
        return LOST
    if tokens != expected[: len(tokens)]:
        return DUPLICATED if len(tokens) > len(expected) else LOST
    return CLEAN_ERROR


def judge_job(job: Job, answer: Answer, expected: list[int]) -> str:
    """The verdict on ``answer`` to ``job``: :func:`judge` on each choice (every one the
    reference's ``expected``), the worst of them; a choice index outside the request's
    choices is lost."""
    if job.choices == 1:
        return judge(answer, expected)
    if any(not 0 <= index < job.choices for index in answer.by_index):
        return LOST
    verdicts = {judge(answer.choice(index), expected) for index in range(job.choices)}
    return next(verdict for verdict in _WORST if verdict in verdicts)
