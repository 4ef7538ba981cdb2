"""The flow's decisions, without I/O: one state machine for the gateway and the bench.

Every decision a request's flow makes -- what follows the attempt (admitted,
rejected, fallen back), P/D or the decoder alone, a hand-back and what continues it,
starting over on another decoder before the first byte, recovering mid-answer -- is
made here, from facts its driver reports. The machine sends nothing and reads
nothing; it answers each event with the next :data:`Step` for the driver to carry
out, as h11 answers the bytes httpcore feeds it.

Two drivers run it:

* :class:`~pd_orchestrator.flows.flow.Flow`, with real legs over HTTP;
* the virtual bench (:mod:`~pd_orchestrator.bench.virtual`), in virtual time on the
  simulator's engines.

So the bench measures the product's flow, not a copy of it. What stays with the
drivers is how a step is carried out: opening legs, the hand-over's retries across
prefillers (:mod:`~pd_orchestrator.flows.handover`), the relay, and the upstream
request budget (:func:`~pd_orchestrator.flows.flow.leg_budget`).

The events, in the order a request meets them::

    attempted ──admitted──▶ Serve
        │──local (ask-all fallback)──▶ Alone(decoder)
        └──rejected──▶ ThroughPD(decoder, 0)
                          │──no prefiller──▶ Alone (prefill_fallback: local) | 503
                          └──prefill side failed──▶ Alone (fallback) | give up
    leg_ended ──finished──▶ Done
        └──handed back──▶ AtLimit | ThroughPD(decoder, leg_threshold)
                                  | Alone(decoder) after max_handbacks
    before the first byte, a leg failed ──▶ may_start_over? ──▶ start_over(retried plan) | give up
    mid-answer, a leg failed ──▶ may_recover? ──▶ recover: ThroughPD | AtLimit | give up
"""

from __future__ import annotations

from pd_orchestrator.config.settings import HandbackConfig, UpstreamConfig
from pd_orchestrator.flows.sink import GatewayError
from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.records import record
from pd_orchestrator.model.route import Ask, Decline, GoPD, Local, Route, Whole
from pd_orchestrator.planner.plan import Plan

__all__ = [
    "Alone",
    "AtLimit",
    "Done",
    "FlowMachine",
    "Serve",
    "Step",
    "ThroughPD",
    "skips_attempt",
]


@record
class Serve:
    """The admitting decoder's leg serves the original prompt."""


@record
class ThroughPD:
    """The P/D leg to ``decoder``: prefill on a prefiller that can reach it, the KV
    handed over, the decode leg sent with ``threshold``."""

    decoder: Endpoint
    threshold: float


@record
class Alone:
    """``decoder`` alone, with threshold 0: it prefills the prompt itself."""

    decoder: Endpoint


@record
class Done:
    """The answer is complete."""


@record
class AtLimit:
    """The client got every token the request allows: end with a ``length`` finish."""


Step = Serve | ThroughPD | Alone | Done | AtLimit
"""What the driver does next."""


def skips_attempt(route: Route) -> bool:
    """Whether a single-decoder attempt sends nothing: the route admits no prompt
    (:class:`~pd_orchestrator.model.route.GoPD`, :class:`~pd_orchestrator.model.route.Decline`),
    so the request goes straight to P/D."""
    match route:
        case GoPD() | Decline():
            return True
        case Ask() | Local() | Whole():
            return False


class FlowMachine:
    """One request's decisions along ``plan`` (see the module docstring).

    State the drivers read: :attr:`decision` (``decode`` or ``pd``, of the original
    prompt), :attr:`decoder` (the decoder that serves or continues the request),
    :attr:`plan` (after any start-over), :attr:`handbacks` and :attr:`recoveries`.
    """

    __slots__ = ("decision", "decoder", "handback", "handbacks", "plan", "recoveries", "tried",
                 "upstream")  # fmt: skip

    def __init__(self, plan: Plan, handback: HandbackConfig, upstream: UpstreamConfig) -> None:
        self.plan = plan
        self.handback = handback
        self.upstream = upstream
        self.decision = "decode"
        self.decoder = plan.decoder
        self.handbacks = 0
        self.recoveries = 0
        self.tried = 1

    # -- the original prompt ----------------------------------------------------------------
    def attempted(
        self, decoder: Endpoint, *, admitted: bool, local: bool = False
    ) -> Serve | ThroughPD | Alone:
        """The attempt's result: ``decoder`` admitted the prompt (its leg serves), or
        every asked decoder rejected it and ``decoder`` takes it -- alone when
        ``local`` (ask-all's ``local`` fallback), else through P/D with threshold 0."""
        self.decoder = decoder
        if admitted:
            self.decision = "decode"
            return Serve()
        if local:
            self.decision = "decode"
            return Alone(decoder)
        self.decision = "pd"
        return ThroughPD(decoder, 0.0)

    def without_prefiller(self, *, original_prompt: bool) -> Alone:
        """No prefiller can hand KV over to :attr:`decoder` (e.g. a ``both`` decoder
        alone in its group): the decoder alone under ``prefill_fallback: local``;
        otherwise a 503."""
        if self.upstream.prefill_fallback != "local":
            raise GatewayError(503, f"no prefiller can hand KV over to decoder {self.decoder.name}")
        return self._alone(original_prompt)

    def prefill_failed(
        self, *, retryable: bool, endpoint: str, original_prompt: bool
    ) -> Alone | None:
        """A hand-over failed after its own retries, last on ``endpoint``: the decoder
        alone when ``prefill_fallback: local`` and the failure was retryable and not the
        decoder's own; None: the failure is the answer."""
        fallback = self.upstream.prefill_fallback == "local"
        if not (fallback and retryable and endpoint != self.decoder.name):
            return None
        return self._alone(original_prompt)

    def may_start_over(self, *, retryable: bool, on_decoder: bool) -> bool:
        """Before the first byte reached the client, a leg failed: whether the request
        may start over on another decoder -- a retryable failure of a decoder leg (the
        attempt, or the decode leg of a hand-over), within ``upstream.decode_attempts``."""
        return retryable and on_decoder and self.tried < self.upstream.decode_attempts

    def start_over(self, retried: Plan | None) -> bool:
        """Start over on ``retried`` (the plan without the decoders seen failing, None
        when no decoder is left) after :meth:`may_start_over` allowed it; False: the
        failure is the answer."""
        if retried is None:
            return False
        self.tried += 1
        self.plan = retried
        self.decision = "decode"
        return True

    # -- continuations ---------------------------------------------------------------------
    def leg_ended(
        self, *, handed_back: bool, remaining: int | None, next_decoder: Endpoint | None
    ) -> Step:
        """The serving leg ended: finished, or handed back by its decoder (preempted),
        in which case the request continues on ``next_decoder`` (None: the same
        decoder) with ``remaining`` tokens left (None: no limit)."""
        if not handed_back:
            return Done()
        return self._continue(next_decoder or self.decoder, remaining, recovering=False)

    def may_recover(self, *, retryable: bool, has_prompt_ids: bool) -> bool:
        """Whether a leg that failed after content reached the client (or a
        continuation that could not start) may be continued elsewhere: a retryable
        failure, within ``handback.max_recoveries``, of a request whose prompt ids are
        known and whose plan is continuable."""
        return (
            retryable
            and has_prompt_ids
            and self.recoveries < self.handback.max_recoveries
            and self.plan.continuable
        )

    def recover(self, next_decoder: Endpoint | None, remaining: int | None) -> Step | None:
        """The recovery :meth:`may_recover` allowed: the continuation on
        ``next_decoder`` with ``remaining`` tokens left; None (no decoder left): the
        failure is the answer."""
        if next_decoder is None:
            return None
        self.recoveries += 1
        return self._continue(next_decoder, remaining, recovering=True)

    def _continue(self, decoder: Endpoint, remaining: int | None, *, recovering: bool) -> Step:
        """Prompt plus every generated token, on ``decoder``: through P/D with
        ``handback.leg_threshold``; alone with threshold 0 once the request was handed
        back more than ``handback.max_handbacks`` times."""
        if not self.plan.continuable:
            raise GatewayError(
                502,
                "the decoder handed back a request a continuation cannot honour "
                "(tools, structured output or logprobs)",
            )  # its threshold is 0: only a client's own threshold gets here
        if not recovering:
            self.handbacks += 1
        if remaining is not None and remaining <= 0:
            return AtLimit()
        self.decoder = decoder
        if not recovering and self.handbacks > self.handback.max_handbacks:
            return Alone(decoder)
        return ThroughPD(decoder, self.handback.leg_threshold)

    def _alone(self, original_prompt: bool) -> Alone:
        if original_prompt:
            self.decision = "decode"
        return Alone(self.decoder)
