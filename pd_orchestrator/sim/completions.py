"""The generation requests of a simulated instance: ``POST /v1/completions`` and
``POST /v1/chat/completions``, whole or streamed.

A request is checked and tokenized (:meth:`Completions._accept`), its KV pulled from
a producer when its transfer parameters say so (the consumer side), submitted to
the engine, and answered from the engine's outputs in vLLM's shapes, with the test
hooks' faults (see :mod:`~pd_orchestrator.sim.server`).
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pd_orchestrator.model.records import record
from pd_orchestrator.openai.protocol import (
    ChatCompletionRequest,
    OpenAIRequest,
    RequestError,
    parse_for,
    render_chat,
)
from pd_orchestrator.openai.responses import (
    Kind,
    Usage,
    completion_body,
    stream_chunk,
    usage_chunk,
)
from pd_orchestrator.openai.sse import DONE, encode_event
from pd_orchestrator.prefix.hashing import BlockExtras
from pd_orchestrator.sim.constrained import Constraint
from pd_orchestrator.sim.engine import EngineRequest, RequestOutput, SamplingSpec
from pd_orchestrator.sim.faults import corrupt
from pd_orchestrator.sim.handover import (
    Fetched,
    TransferFailed,
    fetch,
    hold_keys,
    plan_fetch,
    producer_params,
)
from pd_orchestrator.sim.instance import (
    HTTPFailure,
    Instance,
    check_vocab,
    json_object,
    until_disconnect,
)
from pd_orchestrator.sim.logprobs import asked_top, logprobs_of
from pd_orchestrator.sim.shaping import CallShaper, ShapeError, constraint_of
from pd_orchestrator.sim.tokenizer import WORD_BASE
from pd_orchestrator.vllm_plugin.policy import InvalidThresholdError, request_admission_only

__all__ = ["Completions"]

_NIXL = frozenset({"nixl", "nixl-push"})


class _DroppedConnection(Exception):
    """Raised inside a stream to make the server drop the connection (fault injection)."""


@record
class _Job:
    """One accepted generation request."""

    kind: Kind
    request: OpenAIRequest
    request_id: str
    prompt_ids: list[int]
    arrival: float
    drop_after: int | None
    constraint: Constraint | None
    top: int | None
    """Alternatives per token the answer's logprobs carry (None: no logprobs)."""


class Completions:
    """The generation routes of one instance; ``rng`` draws ``--failure-rate`` faults."""

    def __init__(self, sim: Instance, rng: random.Random) -> None:
        self.sim = sim
        self._rng = rng

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, http_request: Request, kind: Kind) -> Response:
        self._inject_faults(http_request)
        if self.sim.options.response_delay:
            await anyio.sleep(self.sim.options.response_delay)
        job = await self._accept(http_request, kind)
        external = await self._fetch_external(job)
        receive = self._submit(job, external, http_request)
        headers = {"x-request-id": job.request_id}
        if job.request.stream:
            return StreamingResponse(
                self._stream(job, receive), media_type="text/event-stream", headers=headers
            )
        body = await until_disconnect(http_request, self._collect(job, receive))
        return JSONResponse(body or {}, headers=headers)

    def _inject_faults(self, request: Request) -> None:
        forced = request.headers.get("x-return-error")
        if forced is not None:
            status = int(forced) if forced.isdigit() else 500
            raise HTTPFailure(status, f"injected error {status} (X-Return-Error)")
        if self.sim.options.failure_rate and self._rng.random() < self.sim.options.failure_rate:
            raise HTTPFailure(500, "injected failure (--failure-rate)")

    async def _accept(self, http_request: Request, kind: Kind) -> _Job:
        body = await json_object(http_request)
        try:
            request = parse_for(kind, body)
        except RequestError as exc:
            raise HTTPFailure(400, str(exc), exc.param) from None
        if request.n != 1:
            raise HTTPFailure(400, "the simulator generates one choice per request (n=1)", "n")
        if request.model != self.sim.model:
            raise HTTPFailure(404, f"The model `{request.model}` does not exist.", "model")
        prompt_ids = self._prompt_ids(request)
        try:
            constraint = constraint_of(request)
        except ShapeError as exc:
            raise HTTPFailure(400, str(exc), exc.param) from None
        base = http_request.headers.get("x-request-id") or uuid.uuid4().hex
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        drop = http_request.headers.get("x-drop-after-tokens")
        return _Job(
            kind=kind,
            request=request,
            request_id=f"{prefix}-{base}-{uuid.uuid4().hex[:8]}",
            prompt_ids=prompt_ids,
            arrival=self.sim.clock(),
            drop_after=int(drop) if drop and drop.isdigit() else self.sim.options.drop_after_tokens,
            constraint=constraint,
            top=asked_top(kind, request.model_extra or {}),
        )

    def _prompt_ids(self, request: OpenAIRequest) -> list[int]:
        if isinstance(request, ChatCompletionRequest):
            ids = self.sim.tokenizer.encode(
                render_chat(request.messages, request.add_generation_prompt)
            )
            self.sim.engine.stats.tokenized_tokens += len(ids)
        elif isinstance(request.prompt, str):
            ids = self.sim.tokenizer.encode(request.prompt)
            self.sim.engine.stats.tokenized_tokens += len(ids)
        else:
            ids = list(request.prompt)
            check_vocab(self.sim.tokenizer, ids)
        if not ids:
            raise HTTPFailure(400, "The decoder prompt cannot be empty", "prompt")
        if len(ids) >= self.sim.options.max_model_len:
            raise HTTPFailure(
                400,
                f"This model's maximum context length is {self.sim.options.max_model_len} tokens; "
                f"the prompt has {len(ids)} tokens.",
                "prompt",
            )
        return ids

    def _sampling(self, job: _Job) -> SamplingSpec:
        request = job.request
        limit = request.output_limit()
        sim = self.sim
        room = min(sim.options.max_model_len, sim.engine.capacity_tokens()) - len(job.prompt_ids)
        if limit is None:
            limit = 16 if job.kind == "completion" else max(1, room)
        if request.min_tokens > limit:
            raise HTTPFailure(
                400, "min_tokens must be less than or equal to max_tokens", "min_tokens"
            )
        resumed = request.cache_hit_resume_tokens
        if resumed is not None and resumed > len(job.prompt_ids):
            raise HTTPFailure(  # the plugin finishes such a request with an error
                400, "cache_hit_resume_tokens exceeds the prompt", "cache_hit_resume_tokens"
            )
        return SamplingSpec(
            max_tokens=limit, min_tokens=request.min_tokens, ignore_eos=request.ignore_eos
        )

    def _submit(
        self, job: _Job, external: int, http_request: Request
    ) -> MemoryObjectReceiveStream[RequestOutput]:
        params = job.request.kv_transfer_params or {}
        forced = http_request.headers.get("x-cache-threshold-finish-reason", "").lower() == "true"
        forced = forced or self.sim.options.always_reject
        engine_request = EngineRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt_ids,
            sampling=self._sampling(job),
            cache_hit_threshold=job.request.cache_hit_threshold,
            admission_only=self.sim.options.admission_only and _admission_only(job.request),
            do_remote_decode=bool(params.get("do_remote_decode")),
            external_tokens=external,
            force_reject=forced,
            extras=_extras(job.request),
            hold_keys=hold_keys(self.sim.connectors, params, job.request_id),
            constraint=job.constraint,
            resume_tokens=job.request.cache_hit_resume_tokens or 0,
        )
        try:
            return self.sim.runner.submit(engine_request)
        except ValueError as exc:
            raise HTTPFailure(400, str(exc)) from None

    # -- KV transfer (consumer side) -------------------------------------------------------
    async def _fetch_external(self, job: _Job) -> int:
        """Tokens of ``job``'s prompt whose KV came from a producer (0: none)."""
        params = job.request.kv_transfer_params or {}
        extras = _extras(job.request)
        try:
            plan = plan_fetch(self.sim.connectors, params, job.request_id)
            if plan is None:
                return 0
            assert self.sim.client is not None
            hashes = self.sim.engine.prompt_hashes(job.prompt_ids, extras)
            fetched = await fetch(self.sim.client, plan, self.sim.options.block_size, hashes)
        except TransferFailed as exc:
            if self.sim.options.kv_load_failure_policy == "recompute":
                return 0
            raise HTTPFailure(500, f"KV transfer failed: {exc}") from None
        external = self._matched_tokens(job.prompt_ids, fetched, extras)
        moved = max(0, external - self.sim.engine.local_hit_tokens(job.prompt_ids, extras))
        seconds = self.sim.options.latency.transfer_seconds(moved)
        await anyio.sleep(self.sim.runner.scaled(seconds))
        if plan.connector in _NIXL:
            per_token = self.sim.options.latency.kv_bytes_per_token
            self.sim.metrics.observe_transfer(seconds, moved * per_token)
        return external

    def _matched_tokens(
        self, prompt_ids: list[int], held: Fetched, extras: BlockExtras | None
    ) -> int:
        own = self.sim.engine.prompt_hashes(prompt_ids, extras)
        matched = 0
        for mine, theirs in zip(own, held.block_hashes, strict=False):
            if mine != theirs:
                break
            matched += 1
        if matched == len(own) and held.num_tokens == len(prompt_ids):
            return len(prompt_ids)
        return matched * self.sim.options.block_size

    # -- answers ------------------------------------------------------------------------
    def _usage(self, job: _Job, last: RequestOutput | None) -> Usage:
        if last is None:
            return Usage(len(job.prompt_ids), 0)
        return Usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)

    def _observe(self, job: _Job, first_token_at: float | None) -> None:
        now = self.sim.clock()
        if first_token_at is not None:
            self.sim.metrics.observe_ttft(first_token_at - job.arrival)
        self.sim.metrics.observe_e2e(now - job.arrival)

    async def _collect(
        self, job: _Job, receive: MemoryObjectReceiveStream[RequestOutput]
    ) -> dict[str, Any]:
        tokens: list[int] = []
        last: RequestOutput | None = None
        first_at: float | None = None
        try:
            async with receive:
                async for output in receive:
                    if output.new_token_ids and first_at is None:
                        first_at = self.sim.clock()
                    tokens += output.new_token_ids
                    last = output
        finally:
            self.sim.runner.abort(job.request_id)
        self._observe(job, first_at)
        transfer = last.transfer if last is not None else None
        request = job.request
        text = self.sim.tokenizer.decode(tokens)
        shaper = CallShaper(job.constraint)
        finish = last.finish_reason.value if last and last.finish_reason else "abort"
        answer = completion_body(
            kind=job.kind,
            response_id=job.request_id,
            model=self.sim.model,
            text=text,
            finish_reason=shaper.finish(text, finish) if job.kind == "chat" else finish,
            usage=self._usage(job, last),
            token_ids=tokens if request.return_token_ids else None,
            prompt_token_ids=job.prompt_ids if request.return_token_ids else None,
            kv_transfer_params=(
                producer_params(
                    self.sim.connectors, transfer, last.num_cached_tokens, self.sim.advertised()
                )
                if transfer is not None and last is not None
                else None
            ),
        )
        if job.kind == "chat":
            answer["choices"][0]["message"] = shaper.message(text)
        if job.top is not None:
            answer["choices"][0]["logprobs"] = self._logprobs(job, tokens, job.prompt_ids[-1])
        return corrupt(answer, self.sim.options.protocol_fault)

    def _logprobs(self, job: _Job, ids: list[int], previous: int, offset: int = 0) -> Any:
        """The logprobs of ``ids`` in the answer's shape (:mod:`.logprobs`)."""
        assert job.top is not None
        figures = logprobs_of(self.sim.tokenizer, job.kind, ids, previous, job.top, offset)
        return figures if job.kind == "completion" else {"content": figures}

    async def _stream(
        self, job: _Job, receive: MemoryObjectReceiveStream[RequestOutput]
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        request = job.request
        want_ids = request.return_token_ids
        prompt_ids: list[int] | None = job.prompt_ids if want_ids else None
        fault = self.sim.options.protocol_fault
        shaper = CallShaper(job.constraint)

        def chunk(
            text: str | None,
            delta: dict[str, Any] | None = None,
            logprobs: Any = None,
            **fields: Any,
        ) -> bytes:
            body = stream_chunk(
                kind=job.kind,
                response_id=job.request_id,
                model=self.sim.model,
                created=created,
                text=text,
                **fields,
            )
            if delta is not None:
                body["choices"][0]["delta"] = delta
            if logprobs is not None:
                body["choices"][0]["logprobs"] = logprobs
            return encode_event(corrupt(body, fault))

        last: RequestOutput | None = None
        first_at: float | None = None
        sent = 0
        previous, offset = job.prompt_ids[-1], 0
        try:
            if job.kind == "chat":
                yield chunk(None, role=True, prompt_token_ids=prompt_ids)
                prompt_ids = None
            async with receive:
                async for output in receive:
                    last = output
                    if output.new_token_ids and first_at is None:
                        first_at = self.sim.clock()
                    reason = output.finish_reason.value if output.finish_reason else None
                    text = self.sim.tokenizer.decode(output.new_token_ids)
                    delta = None
                    if job.kind == "chat" and not output.new_token_ids:
                        text_or_none: str | None = None
                    else:
                        text_or_none = text
                        delta = shaper.delta(text) if job.kind == "chat" else None
                    if job.kind == "chat":
                        reason = shaper.finish(shaper.text(), reason)
                    logprobs = None
                    if job.top is not None and output.new_token_ids:
                        ids = list(output.new_token_ids)
                        logprobs = self._logprobs(job, ids, previous, offset)
                        tokenizer = self.sim.tokenizer
                        offset += sum(len(tokenizer.token_text(t)) for t in ids)
                        previous = ids[-1]
                    yield chunk(
                        text_or_none,
                        delta,
                        logprobs,
                        finish_reason=reason,
                        token_ids=list(output.new_token_ids) if want_ids else None,
                        prompt_token_ids=prompt_ids,
                    )
                    prompt_ids = None
                    sent += len(output.new_token_ids)
                    if (
                        job.drop_after is not None
                        and sent >= job.drop_after
                        and not output.finished
                    ):
                        raise _DroppedConnection(f"dropping the stream after {sent} tokens")
            if fault == "tokens-after-finish":
                extra = [WORD_BASE]
                yield chunk(self.sim.tokenizer.decode(extra), token_ids=extra if want_ids else None)
            self._observe(job, first_at)
            if request.include_usage:
                usage = self._usage(job, last)
                yield encode_event(
                    usage_chunk(
                        kind=job.kind,
                        response_id=job.request_id,
                        model=self.sim.model,
                        created=created,
                        usage=usage,
                    )
                )
            yield DONE
        finally:
            self.sim.runner.abort(job.request_id)


def _extras(request: OpenAIRequest) -> BlockExtras | None:
    """The request's ``cache_salt`` (a vLLM extension field) as block-hash extras."""
    salt = (request.model_extra or {}).get("cache_salt")
    return BlockExtras(cache_salt=salt) if isinstance(salt, str) and salt else None


def _admission_only(request: OpenAIRequest) -> bool:
    """The request's ``cache_hit_admission_only``, read as the plugin reads it: the
    body's (validated by the protocol model), else ``vllm_xargs``' (400 when invalid)."""
    xargs = (request.model_extra or {}).get("vllm_xargs")
    try:
        value = request_admission_only(
            {"cache_hit_admission_only": request.cache_hit_admission_only},
            xargs if isinstance(xargs, dict) else None,
        )
    except InvalidThresholdError as exc:
        raise HTTPFailure(400, str(exc), "vllm_xargs") from None
    return bool(value)
