"""OpenTelemetry traces of requests, as vLLM makes them: one span per generation request, named "llm_request",
with vLLM's attributes (`SpanAttributes`), and the caller's W3C trace context (`traceparent`, `tracestate`
headers) as its parent.

`llmplug serve --otlp-traces-endpoint URL` sends the spans over OTLP (`tracer_provider`); tests pass their own
TracerProvider (with an in-memory exporter) in `ServerSettings.tracer_provider`. The span is made when the
request ends, from the engine's timestamps: it starts at the request's arrival and ends when it finished.
OpenTelemetry is imported only when tracing is on; without it, asking for tracing fails at start naming the
`tracing` extra.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from llmplug.core.errors import ConfigError

if TYPE_CHECKING:
    from llmplug.entrypoints.openai.metrics import RequestTracker

TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"  # "http/protobuf" (default) or "grpc"

# The trace headers of the HTTP request being served (set by TraceHeadersMiddleware, read when its span is made).
_incoming: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("llmplug_trace_headers", default={})


class SpanAttributes:
    """vLLM's span attribute names (the OpenTelemetry gen_ai conventions, and vLLM's own until they are in them)."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def tracer_provider(endpoint: str) -> Any:
    """A TracerProvider that batches spans to the OTLP collector at `endpoint`; ConfigError without OpenTelemetry."""
    protocol = os.environ.get(PROTOCOL_ENV, "http/protobuf")
    try:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            raise ConfigError(f"{PROTOCOL_ENV}={protocol!r} is not an OTLP protocol llmplug sends; "
                              "use 'http/protobuf' or 'grpc'")
    except ImportError as exc:
        extra = "opentelemetry-exporter-otlp-proto-grpc" if protocol == "grpc" else "llmplug[tracing]"
        raise ConfigError(f"--otlp-traces-endpoint needs OpenTelemetry, which is not installed ({exc}); "
                          f"install it with: pip install '{extra}'") from exc
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


class RequestTracer:
    """Makes the span of each request that ends (called by its RequestTracker)."""

    def __init__(self, provider: Any, model_name: str):
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("llmplug.entrypoints.openai")
        self.model_name = model_name
        self._kind = SpanKind.SERVER
        self._propagator = TraceContextTextMapPropagator()

    def record(self, tracker: RequestTracker, end_time: float) -> None:
        """One span for the request `tracker` followed, child of the trace context its HTTP request carried."""
        parent = self._propagator.extract(_incoming.get())
        span = self.tracer.start_span(SPAN_NAME, context=parent, kind=self._kind,
                                      start_time=_ns(tracker.arrival_time))
        span.set_attributes(span_attributes(tracker, self.model_name, end_time))
        span.end(end_time=_ns(max(end_time, tracker.arrival_time)))

    def shutdown(self) -> None:
        """Send the spans still batched (the provider's exporter flushes on shutdown)."""
        self.provider.shutdown()


def span_attributes(tracker: RequestTracker, model_name: str, end_time: float) -> dict[str, Any]:
    """vLLM's attributes of a request's span; a latency the engine did not measure (no token came) is left out."""
    attributes: dict[str, Any] = {
        SpanAttributes.GEN_AI_RESPONSE_MODEL: model_name,
        SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: tracker.num_prompt_tokens,
        SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: sum(tracker.num_generated.values()),
        SpanAttributes.GEN_AI_LATENCY_E2E: max(end_time - tracker.arrival_time, 0.0),
    }
    if tracker.request_id is not None:
        attributes[SpanAttributes.GEN_AI_REQUEST_ID] = tracker.request_id
    params = tracker.params
    if params is not None:
        attributes.update({SpanAttributes.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
                           SpanAttributes.GEN_AI_REQUEST_TOP_P: params.top_p,
                           SpanAttributes.GEN_AI_REQUEST_N: params.n,
                           SpanAttributes.GEN_AI_USAGE_NUM_SEQUENCES: params.n})
        if params.max_tokens is not None:
            attributes[SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS] = params.max_tokens
    m = tracker.engine_metrics
    if m is None:
        return attributes
    spans = {SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE: (m.arrival_time, m.first_scheduled_time),
             SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: (m.arrival_time, m.first_token_time),
             SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: (m.first_scheduled_time, m.first_token_time),
             SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: (m.first_token_time, m.last_token_time),
             SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: (m.first_scheduled_time, m.last_token_time)}
    for name, (start, end) in spans.items():
        if start is not None and end is not None:
            attributes[name] = max(end - start, 0.0)
    return attributes


class TraceHeadersMiddleware:
    """Keeps the W3C trace headers of each HTTP request for the spans of the generation requests it makes.

    A context variable carries them: the handler, its streaming body and the tasks it starts all run in
    copies of the request's context, so no handler has to pass them along.
    """

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = _incoming.set(trace_headers(scope["headers"]))
        try:
            await self.app(scope, receive, send)
        finally:
            _incoming.reset(token)


def trace_headers(raw: list[tuple[bytes, bytes]] | Mapping[str, str]) -> dict[str, str]:
    """The traceparent and tracestate headers of a request (ASGI's raw header list or a mapping)."""
    items = raw.items() if isinstance(raw, Mapping) else ((k.decode("latin-1"), v.decode("latin-1")) for k, v in raw)
    return {name.lower(): value for name, value in items if name.lower() in TRACE_HEADERS}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
