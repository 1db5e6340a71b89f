"""OpenTelemetry traces: one "llm_request" span per request with vLLM's attributes, matching the response's
usage, child of the caller's traceparent; asking for traces without OpenTelemetry fails at start, naming the
extra."""

from __future__ import annotations

import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from llmplug.core.errors import ConfigError
from llmplug.entrypoints.openai.api_server import ServerSettings
from llmplug.entrypoints.openai.tracing import SPAN_NAME, tracer_provider
from llmplug.entrypoints.openai.tracing import SpanAttributes as A

from .conftest import serve

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(engine):
    """A server whose spans go to an in-memory exporter, and the exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with serve(engine, ServerSettings(tracer_provider=provider)) as running:
        yield running, exporter


def only_span(exporter: InMemorySpanExporter):
    spans = exporter.get_finished_spans()
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


def test_one_span_per_request_with_vllms_attributes_matching_the_usage(traced):
    server, exporter = traced
    exporter.clear()
    answer = server.client().completions.create(model=server.model, prompt="Trace this request", max_tokens=6,
                                                temperature=0.5, top_p=0.9, extra_body={"ignore_eos": True})
    span = only_span(exporter)
    assert span.name == SPAN_NAME and span.kind == SpanKind.SERVER
    assert span.parent is None  # no traceparent: a trace of its own
    attrs = span.attributes
    assert attrs[A.GEN_AI_RESPONSE_MODEL] == server.model
    assert attrs[A.GEN_AI_REQUEST_ID].startswith(answer.id)  # the engine's id: the response's, per prompt
    assert attrs[A.GEN_AI_USAGE_PROMPT_TOKENS] == answer.usage.prompt_tokens
    assert attrs[A.GEN_AI_USAGE_COMPLETION_TOKENS] == answer.usage.completion_tokens == 6
    assert (attrs[A.GEN_AI_REQUEST_TEMPERATURE], attrs[A.GEN_AI_REQUEST_TOP_P]) == (0.5, 0.9)
    assert (attrs[A.GEN_AI_REQUEST_MAX_TOKENS], attrs[A.GEN_AI_REQUEST_N]) == (6, 1)
    latencies = {name: attrs[name] for name in (
        A.GEN_AI_LATENCY_TIME_IN_QUEUE, A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN, A.GEN_AI_LATENCY_E2E,
        A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL, A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE,
        A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE)}
    assert all(value >= 0 for value in latencies.values()), latencies
    assert latencies[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] == pytest.approx(
        latencies[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] + latencies[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE])
    assert latencies[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] <= latencies[A.GEN_AI_LATENCY_E2E]
    assert (span.end_time - span.start_time) / 1e9 == pytest.approx(latencies[A.GEN_AI_LATENCY_E2E], abs=1e-6)


def test_the_span_is_a_child_of_the_callers_traceparent(traced):
    server, exporter = traced
    exporter.clear()
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}
    server.client().completions.create(model=server.model, prompt="Propagate", max_tokens=2, extra_headers=headers)
    span = only_span(exporter)
    assert span.context.trace_id == int(TRACE_ID, 16)
    assert span.parent is not None and span.parent.span_id == int(PARENT_SPAN_ID, 16)
    assert span.parent.is_remote


def test_a_streamed_chat_request_has_one_span_too(traced):
    server, exporter = traced
    exporter.clear()
    chunks = list(server.client().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "stream me"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage
    server.wait_idle()
    span = only_span(exporter)
    assert span.attributes[A.GEN_AI_USAGE_COMPLETION_TOKENS] == usage.completion_tokens == 4
    assert span.attributes[A.GEN_AI_USAGE_PROMPT_TOKENS] == usage.prompt_tokens


def test_tracing_without_opentelemetry_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"llmplug\[tracing\]"):
        tracer_provider("http://127.0.0.1:4318/v1/traces")


def test_an_endpoint_builds_an_otlp_exporting_provider():
    provider = tracer_provider("http://127.0.0.1:4318/v1/traces")
    try:
        assert provider.get_tracer("test") is not None
    finally:
        provider.shutdown()
