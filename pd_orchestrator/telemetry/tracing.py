"""OpenTelemetry traces: one span per client request, one per upstream leg.

Tracing is off unless ``tracing.otlp_endpoint`` is configured: :meth:`Tracing.from_config`
then returns None, no tracer provider exists, and the request path's only cost is
checking ``trace is None``. When on, each gateway owns a private SDK
``TracerProvider`` (none is installed globally), exporting through OTLP/HTTP in
batches from a background thread.

* :meth:`Tracing.request` starts a client request's span (kind ``SERVER``, named
  ``POST /v1/completions``), continuing the client's W3C ``traceparent`` when it
  sends one, and returns its :class:`RequestTrace`.
* :meth:`RequestTrace.leg` starts a leg's span (kind ``CLIENT``, named after what the
  leg does: ``decode_attempt``, ``prefill``, ``decode``, ``continuation``, ``probe``,
  ``tokenize``) as a child of the request's span; :meth:`RequestTrace.inject` writes
  that span's ``traceparent`` into the leg's headers, so vLLM's own spans (it reads
  the header) hang below the leg's.
* :meth:`RequestTrace.end_leg` and :meth:`RequestTrace.finish` end them with their
  attributes and status (``ERROR`` for a failed leg or a 5xx answer).

Attributes are set only on sampled (recording) spans.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from pd_orchestrator import __version__
from pd_orchestrator.config.observability import TracingConfig

__all__ = ["RequestTrace", "Tracing"]

Attributes = Mapping[str, AttributeValue]


class Tracing:
    """The tracer of one gateway: a private provider with one span processor."""

    def __init__(self, service_name: str, sample_ratio: float, processor: SpanProcessor) -> None:
        self.provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
            resource=Resource.create({"service.name": service_name}),
            shutdown_on_exit=False,
        )
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("pd_orchestrator", __version__)
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def from_config(cls, config: TracingConfig) -> Tracing | None:
        """A tracer exporting to ``config.otlp_endpoint``, or None when tracing is off."""
        if config.otlp_endpoint is None:
            return None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        exporter = OTLPSpanExporter(
            endpoint=config.otlp_endpoint,
            headers=dict(config.headers),
            timeout=config.export_timeout,
        )
        return cls(config.service_name, config.sample_ratio, BatchSpanProcessor(exporter))

    def request(self, method: str, route: str, headers: Mapping[str, str]) -> RequestTrace:
        """Start a client request's span; ``headers`` (lower-case names) may carry the
        client's ``traceparent``/``tracestate``."""
        parent = self.propagator.extract(headers) if "traceparent" in headers else None
        span = self.tracer.start_span(
            f"{method} {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "http.route": route},
        )
        return RequestTrace(self, span)

    def shutdown(self) -> None:
        """Export what is pending and stop the exporter (blocks; bounded by its timeout)."""
        self.provider.shutdown()


class RequestTrace:
    """The spans of one client request."""

    __slots__ = ("_context", "_tracing", "span")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self._tracing = tracing
        self.span = span
        self._context: Context = set_span_in_context(span)

    def leg(self, name: str, endpoint: str, phase: str) -> Span:
        """Start the span of one leg to ``endpoint`` (its configured name)."""
        return self._tracing.tracer.start_span(
            name,
            context=self._context,
            kind=SpanKind.CLIENT,
            attributes={"pd.endpoint": endpoint, "pd.phase": phase},
        )

    def inject(self, span: Span, headers: MutableMapping[str, str]) -> None:
        """Write ``span``'s ``traceparent`` (and ``tracestate``) into ``headers``."""
        self._tracing.propagator.inject(headers, context=set_span_in_context(span))

    @staticmethod
    def end_leg(span: Span, outcome: str, attributes: Attributes | None = None) -> None:
        """End a leg's span: ``outcome`` is ``ok``, ``cancelled`` or the failure's kind
        (then ``attributes["pd.error"]`` says what failed)."""
        if span.is_recording():
            span.set_attribute("pd.outcome", outcome)
            if attributes:
                span.set_attributes(attributes)
            if outcome not in ("ok", "cancelled"):
                error = attributes.get("pd.error") if attributes else None
                span.set_status(Status(StatusCode.ERROR, str(error or outcome)))
        span.end()

    def finish(self, status: int, attributes: Attributes, error: str | None = None) -> None:
        """End the request's span with the HTTP ``status`` the client got."""
        span = self.span
        if span.is_recording():
            span.set_attribute("http.response.status_code", status)
            span.set_attributes(attributes)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR, error or f"HTTP {status}"))
        span.end()
