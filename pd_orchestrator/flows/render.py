"""What the client receives, streamed or whole (the flow's one serving path ends here).

A flow relays every leg the same way, chunk by chunk, and hands each chunk the
client should see to a renderer:

* :class:`StreamRenderer` writes SSE: the response starts when the decision is
  known (:meth:`begin`); chunks of a leg that speaks the client's API are relayed
  as they came (every field vLLM sent survives) with the client's id and time and
  token ids only if asked; chunks of a continuation (completions API) are re-rendered
  in the client's API, logprobs included (a continuation's completions offsets carry
  on past the tokens already sent), a named tool choice's text as that call's argument
  deltas; a hand-back's chunk is relayed without its finish; a chat client gets
  exactly one role chunk; everything one upstream read produced goes out in one
  write (:meth:`flush`); the end adds the merged usage (if asked) and ``[DONE]``,
  held by the sink until the gateway closes the response.
* :class:`WholeRenderer` writes one JSON answer at the end: the first whole answer
  in the client's API is the template (tool calls, logprobs and the like survive),
  text, finish reason, token ids, usage and (when asked) logprobs are the merged ones.

Both measure the time to first token (arrival to the first content the client
gets) and the mean gap between later content (ITL).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import orjson

from pd_orchestrator.flows.chunks import ChunkView, identity_fields, relay_chunk, render_chunk
from pd_orchestrator.flows.legs import Leg
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.flows.sink import ClientSink
from pd_orchestrator.flows.transcript import Transcript, tool_call_id
from pd_orchestrator.openai.sse import DONE, encode_event

__all__ = ["Renderer", "StreamRenderer", "WholeRenderer", "renderer_for"]

Json = dict[str, Any]


class _Timing:
    """Time to first token and the gaps after it, on the flow's clock."""

    def __init__(self, arrival: float, clock: Callable[[], float]) -> None:
        self.arrival = arrival
        self.clock = clock
        self.ttft: float | None = None
        self._gaps = 0
        self._last = 0.0

    def content(self, chunks: int = 1) -> None:
        """``chunks`` pieces of content reached the client now (one write)."""
        now = self.clock()
        if self.ttft is None:
            self.ttft = now - self.arrival
            chunks -= 1
        self._gaps += chunks
        self._last = now

    @property
    def itl(self) -> float | None:
        """Mean seconds between content chunks after the first, as the client saw them;
        None when no content came after the first write (a whole answer, or a stream
        written at once): a span of zero times nothing, and would read as ITL 0."""
        if not self._gaps or self.ttft is None:
            return None
        span = self._last - self.arrival - self.ttft
        return span / self._gaps if span > 0.0 else None


class Renderer(Protocol):
    """The client's side of a flow (see the module docstring)."""

    timing: _Timing

    async def begin(self, headers: Mapping[str, str]) -> None: ...

    def emit(self, leg: Leg, chunk: Json, view: ChunkView, finish: str | None) -> None: ...

    async def flush(self) -> None: ...

    async def end(self, headers: Mapping[str, str]) -> None: ...


class _Rendering:
    """What both renderers hold: the request, its transcript, the client's sink, the
    timing; ``index``: the choice written (``n`` > 1: one renderer per choice);
    ``final``: this renderer ends the answer (with several choices none does, and
    :mod:`~pd_orchestrator.flows.choices` ends it)."""

    def __init__(
        self,
        request: ClientRequest,
        transcript: Transcript,
        sink: ClientSink,
        clock: Callable[[], float],
        *,
        index: int = 0,
        final: bool = True,
    ) -> None:
        self.request = request
        self.transcript = transcript
        self.sink = sink
        self.timing = _Timing(request.arrival, clock)
        self.index = index
        self.final = final
        self._setup()

    def _setup(self) -> None:
        """The renderer's own state (called once, at the end of construction)."""


class StreamRenderer(_Rendering):
    """Server-sent events for a streaming client (a final one ends the answer with
    the usage and ``[DONE]``)."""

    def _setup(self) -> None:
        self._out: list[bytes] = []
        self._role_sent = False
        self._first_sent = False
        self._keep_ids = self.request.want_token_ids
        self._chat = self.request.kind == "chat"
        self._contents = 0
        self._tool_started = False
        self.transcript.keep_text = False

    async def begin(self, headers: Mapping[str, str]) -> None:
        if self.index == 0:
            await self.sink.start(200, headers, "text/event-stream")

    def emit(self, leg: Leg, chunk: Json, view: ChunkView, finish: str | None) -> None:
        identity = self.transcript.identity
        assert identity is not None
        if leg.kind == "chat" and not view.decisive and self._role_sent:
            return  # a second role chunk (a later chat leg's opening)
        first = not self._first_sent
        top = self.transcript.top
        if leg.kind == self.request.kind and not leg.whole:
            out = relay_chunk(
                chunk, identity, keep_ids=self._keep_ids, first=first, index=self.index
            )
            if finish != view.finish_reason:  # a hand-back's tokens, not its finish
                out["choices"][0]["finish_reason"] = finish
            if view.arguments:
                self._tool_started = True
            if top is not None and view.logprobs is not None:
                shaped = self.transcript.shape_logprobs(view.logprobs, leg.kind, leg.text_offset)
                out["choices"][0]["logprobs"] = shaped
        else:
            if self._chat and not self._role_sent:
                self._out.append(encode_event(self._role_chunk()))
            logprobs = None
            if top is not None and view.logprobs is not None:
                logprobs = self.transcript.shape_logprobs(view.logprobs, leg.kind, leg.text_offset)
            out = render_chunk(
                view, identity, self.request.kind, keep_ids=self._keep_ids, finish=finish,
                index=self.index, logprobs=logprobs,
            )  # fmt: skip
            if self._chat and self.transcript.tool is not None:
                out["choices"][0]["delta"] = self._tool_delta(view.text)
            if self._keep_ids and not self._first_sent and view.prompt_token_ids is not None:
                self._prompt_ids(out, view.prompt_token_ids)
        self._role_sent = self._role_sent or self._chat
        self._first_sent = True
        self._out.append(b"data: " + orjson.dumps(out) + b"\n\n")  # encode_event, inline
        if view.text or view.token_ids:
            self._contents += 1

    def _tool_delta(self, arguments: str) -> Json:
        """A named tool choice's delta for continued ``arguments``, as vLLM streams it:
        the first one of the answer with the call's id, type and name."""
        tool = self.transcript.tool
        if not arguments or tool is None:
            return {}
        call: Json = {"index": 0, "function": {"arguments": arguments}}
        if not self._tool_started:
            self._tool_started = True
            call = {"id": tool_call_id(), "type": "function", "index": 0,
                    "function": {"name": tool.name, "arguments": arguments}}  # fmt: skip
        return {"tool_calls": [call]}

    def _role_chunk(self) -> Json:
        identity = self.transcript.identity
        assert identity is not None
        choice = {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return {**identity_fields(identity, "chat"), "choices": [choice]}

    def _prompt_ids(self, out: Json, ids: tuple[int, ...]) -> None:
        if self._chat:
            out["prompt_token_ids"] = list(ids)
        else:
            out["choices"][0]["prompt_token_ids"] = list(ids)

    def _written(self) -> bytes:
        """Everything pending, as one write; the content chunks in it count as sent now."""
        out, self._out = self._out, []
        if self._contents:
            self.timing.content(self._contents)
            self._contents = 0
        return out[0] if len(out) == 1 else b"".join(out)

    async def flush(self) -> None:
        if self._out:
            await self.sink.send(self._written())

    async def end(self, headers: Mapping[str, str]) -> None:
        if not self.final:
            await self.flush()
            return
        transcript = self.transcript
        if self.request.include_usage and transcript.identity is not None:
            identity = identity_fields(transcript.identity, self.request.kind)
            usage = transcript.usage().as_dict()
            self._out.append(encode_event({**identity, "choices": [], "usage": usage}))
        self._out.append(DONE)
        self.sink.end(self._written())  # with the finish chunk, held for this one write


class WholeRenderer(_Rendering):
    """One JSON answer for a client that did not ask to stream (one that is not final
    keeps its answer, :attr:`answer`, for the one that merges the choices)."""

    def _setup(self) -> None:
        self.answer: Json | None = None
        self.transcript.keep_text = True

    async def begin(self, headers: Mapping[str, str]) -> None:
        return None

    def emit(self, leg: Leg, chunk: Json, view: ChunkView, finish: str | None) -> None:
        transcript = self.transcript
        if transcript.template is None and leg.whole and leg.kind == self.request.kind:
            transcript.template = chunk
        record = transcript.logprobs
        if record is not None and view.logprobs is not None:
            record.add(transcript.shape_logprobs(view.logprobs, leg.kind, leg.text_offset))

    async def flush(self) -> None:
        return None

    async def end(self, headers: Mapping[str, str]) -> None:
        transcript = self.transcript
        if transcript.template is None:
            transcript.template = transcript.blank_answer()
        answer = transcript.whole_answer()
        self.timing.content()
        if not self.final:
            self.answer = answer
            return
        all_headers = {**headers, "x-pd-handbacks": str(transcript.handbacks)}
        self.sink.answer(200, all_headers, orjson.dumps(answer))


def renderer_for(
    request: ClientRequest,
    transcript: Transcript,
    sink: ClientSink,
    clock: Callable[[], float],
    *,
    index: int = 0,
    final: bool = True,
) -> StreamRenderer | WholeRenderer:
    """The renderer the client asked for (``stream`` or not)."""
    if request.stream:
        return StreamRenderer(request, transcript, sink, clock, index=index, final=final)
    return WholeRenderer(request, transcript, sink, clock, index=index, final=final)
