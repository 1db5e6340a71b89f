"""The OpenAI-compatible server: `build_app(engine, settings)` makes the FastAPI app, `run_server` serves it.

Routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses for a generating model; for a
pooling model (embeddings, classifiers, cross-encoders) /v1/embeddings, /v1/score and /score, /v1/rerank,
/rerank and /v2/rerank, /classify and /v1/classify, /pooling; the other kind's routes answer 400 naming
the model's kind. With `allow_runtime_lora_updating` also /v1/load_lora_adapter and
/v1/unload_lora_adapter; LoRA adapters (`lora_modules`, loaded at start-up) are models of their own:
listed in /v1/models and chosen by a request's `model`. /tokenize and /detokenize (vLLM's). With
`enable_dev_endpoints`, vLLM's dev-mode /sleep, /wake_up, /is_sleeping, /reset_prefix_cache. /health, /version,
/metrics, /openapi.json (the request schemas with their bounds). The routes are grouped by concern in
`routers`; API key and rate limit apply to every route but the open ones (`security.OPEN_PATHS`: /health,
/version, /metrics). Every error answers with OpenAI's error body.
Shutdown (SIGTERM or SIGINT): uvicorn stops accepting connections, lets in-flight requests finish for
up to `shutdown_timeout` seconds, cancels the rest (which aborts them in the engine), then the engine
thread stops.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmplug import __version__
from llmplug.core.config import EngineConfig
from llmplug.core.errors import EngineDeadError, EngineStateError, InvalidRequestError
from llmplug.core.plugins import PluginRegistry
from llmplug.engine.async_llm import AsyncLLM
from llmplug.entrypoints.openai.admission import AdmissionControl
from llmplug.entrypoints.openai.backpressure import SendTimeoutMiddleware
from llmplug.entrypoints.openai.errors import OpenAIError, error_body, error_response, status_phrase
from llmplug.entrypoints.openai.image_inputs import ImageLoader
from llmplug.entrypoints.openai.loggable import RequestLogger
from llmplug.entrypoints.openai.metrics import ServerMetrics
from llmplug.entrypoints.openai.prompt_renderer import PromptRenderer, load_chat_template
from llmplug.entrypoints.openai.reply import ReplyParsers, check_parser_names
from llmplug.entrypoints.openai.routers import (
    dev_router,
    generation_router,
    health_router,
    kind_guards,
    models_router,
    pooling_router,
    tokenization_router,
    transcription_router,
)
from llmplug.entrypoints.openai.security import (
    AccessMiddleware,
    BodySizeLimitMiddleware,
    HostCheckMiddleware,
    RateLimit,
    default_allowed_hosts,
)
from llmplug.entrypoints.openai.serving_chat import OpenAIServingChat
from llmplug.entrypoints.openai.serving_completion import OpenAIServingCompletion
from llmplug.entrypoints.openai.serving_engine import ClientDisconnected
from llmplug.entrypoints.openai.serving_lora import ServedAdapters, parse_lora_modules
from llmplug.entrypoints.openai.serving_pooling import OpenAIServingPooling
from llmplug.entrypoints.openai.serving_responses import OpenAIServingResponses
from llmplug.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from llmplug.entrypoints.openai.serving_transcription import OpenAIServingTranscription
from llmplug.entrypoints.openai.tracing import RequestTracer, TraceHeadersMiddleware, tracer_provider
from llmplug.entrypoints.openai.vllm_metrics import cache_config_info
from llmplug.multimodal.media import MediaPolicy

logger = logging.getLogger(__name__)

API_KEY_ENV = "LLMPLUG_API_KEY"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # "1": the dev-mode routes, as vLLM's server reads it

# Endpoints named in the HTTP metrics; anything else counts as "other" (unbounded label values otherwise).
_ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/health", "/version",
              "/metrics", "/openapi.json", "/v1/embeddings", "/v1/score", "/score", "/v1/rerank", "/rerank",
              "/v2/rerank", "/classify", "/v1/classify", "/pooling", "/tokenize", "/detokenize")


@dataclass
class ServerSettings:
    """How the HTTP server runs (the engine's own settings are its EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)  # empty: no authentication
    allowed_origins: list[str] = field(default_factory=list)  # empty: no CORS headers
    allowed_hosts: list[str] | None = None  # Host header names served ("*": any); None: the default for `host`
    rate_limit: RateLimit | None = None  # per API key or client address
    max_body_bytes: int = 8 * 1024 * 1024
    max_waiting_requests: int = 1024  # sequences waiting for the running batch; past it: 503 with Retry-After
    chat_template: str | None = None  # template text; None: the model's own
    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's model
    shutdown_timeout: float = 30.0  # grace period for in-flight requests on SIGTERM
    stream_send_timeout: float = 30.0  # a stream whose client reads nothing this long is aborted; 0: never
    health_stall_timeout: float = 60.0  # /health answers 503 once one step or command has run longer; 0: off
    log_level: str = "info"
    tool_call_parser: str | None = None  # `llmplug.tool_parsers` name: the format of the model's tool calls
    enable_auto_tool_choice: bool = False  # tool_choice "auto": the model decides, the tool parser reads
    reasoning_parser: str | None = None  # `llmplug.reasoning_parsers` name
    lora_modules: dict[str, str] = field(default_factory=dict)  # LoRA adapters served at start-up: name -> folder
    allow_runtime_lora_updating: bool = False  # the /v1/load_lora_adapter and /v1/unload_lora_adapter routes
    lora_resolvers: list[str] = field(default_factory=list)  # `llmplug.lora_resolvers` names, asked in order
    otlp_traces_endpoint: str | None = None  # OpenTelemetry collector: a span per request (needs llmplug[tracing])
    tracer_provider: Any = None  # an opentelemetry TracerProvider to use instead of one built for the endpoint
    enable_log_requests: bool = False  # log each request's id, prompt and sampling params (prompts are off by default)
    max_log_len: int | None = None  # characters of a prompt (and token ids) a request log line shows; None: all
    enable_dev_endpoints: bool = False  # /sleep, /wake_up, /is_sleeping, /reset_prefix_cache (behind the key)
    media: MediaPolicy = field(default_factory=MediaPolicy)  # where image and audio URLs may point, and their limits

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerSettings":
        """Settings from the `llmplug serve` flags (and LLMPLUG_API_KEY)."""
        keys = list(args.api_key or [])
        if not keys and os.environ.get(API_KEY_ENV):
            keys = [os.environ[API_KEY_ENV]]
        return cls(
            host=args.host, port=args.port, api_keys=keys,
            allowed_origins=[o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()],
            allowed_hosts=[h.strip() for h in args.allowed_hosts.split(",") if h.strip()] if args.allowed_hosts
            else None,
            rate_limit=RateLimit.parse(args.rate_limit) if args.rate_limit else None,
            max_body_bytes=args.max_body_bytes, max_waiting_requests=args.max_waiting_requests,
            chat_template=load_chat_template(args.chat_template) if args.chat_template else None,
            served_model_names=list(args.served_model_name or []),
            shutdown_timeout=args.shutdown_timeout, stream_send_timeout=args.stream_send_timeout,
            health_stall_timeout=args.health_stall_timeout,
            log_level=args.log_level,
            tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
            reasoning_parser=args.reasoning_parser,
            lora_modules=parse_lora_modules(args.lora_modules or []),
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
            lora_resolvers=list(args.lora_resolver or []),
            otlp_traces_endpoint=args.otlp_traces_endpoint,
            enable_log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
            enable_dev_endpoints=args.enable_dev_endpoints or os.environ.get(DEV_MODE_ENV) == "1",
            media=MediaPolicy.of(args.allowed_local_media_path, args.allowed_media_domains,
                                 fetch_timeout=args.media_fetch_timeout, max_bytes=args.max_media_bytes,
                                 max_pixels=args.max_image_pixels,
                                 max_audio_bytes=int(args.max_audio_clip_filesize_mb * 2**20),
                                 max_audio_seconds=args.max_audio_clip_seconds),
        )


def build_app(engine: AsyncLLM, settings: ServerSettings | None = None) -> FastAPI:
    """The FastAPI app serving `engine`; the caller owns the engine (and shuts it down)."""
    settings = settings or ServerSettings()
    names = settings.served_model_names or [engine.model_name]
    tracer = request_tracer(settings, names[0])
    metrics = ServerMetrics(engine.stats, names[0], engine.max_model_len, cache_config_info(engine), tracer,
                            RequestLogger(settings.max_log_len) if settings.enable_log_requests else None,
                            engine.replica_states if engine.replica_states() else None)
    renderer = PromptRenderer(engine.get_tokenizer(), settings.chat_template, engine.llm_engine.processor.mm_processor)
    admission = AdmissionControl(settings.max_waiting_requests, lambda: engine.stats()["num_running"])
    adapters = ServedAdapters.with_resolvers(engine, names, settings.lora_resolvers, engine.llm_engine.registry)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for name, path in settings.lora_modules.items():  # a start-up adapter that does not fit stops the server
            await adapters.load(name, path)
        yield
        renderer.shutdown()
        image_loader.shutdown()
        if tracer is not None and settings.tracer_provider is None:  # ours: send the spans still batched
            tracer.shutdown()

    app = FastAPI(title="llmplug", version=__version__, docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.model_names = engine, metrics, names
    app.state.adapters, app.state.admission = adapters, admission
    parsers = ReplyParsers.load(settings.tool_call_parser, settings.enable_auto_tool_choice,
                                settings.reasoning_parser, engine.get_tokenizer(), engine.llm_engine.registry)
    shared = (engine, names, metrics, renderer, admission)
    image_loader = app.state.image_loader = ImageLoader.for_engine(engine, names[0], settings.media)
    chat = OpenAIServingChat(*shared, parsers, adapters=adapters, image_loader=image_loader)
    generates, pools = kind_guards(engine)
    pooling_model = engine.pooling is not None  # /openapi.json lists the routes of the model's kind
    app.include_router(health_router(engine, metrics, settings.health_stall_timeout))
    app.include_router(models_router(engine, names, adapters, chat.check_model, settings.allow_runtime_lora_updating))
    app.include_router(generation_router(chat, OpenAIServingCompletion(*shared, adapters=adapters),
                                         OpenAIServingResponses(*shared, parsers, adapters=adapters,
                                                                image_loader=image_loader), generates,
                                         in_schema=not pooling_model))
    app.include_router(pooling_router(OpenAIServingPooling(*shared), pools, in_schema=pooling_model))
    app.include_router(tokenization_router(OpenAIServingTokenization(*shared, chat, adapters=adapters)))
    app.include_router(transcription_router(OpenAIServingTranscription(*shared, media=settings.media), generates))
    if settings.enable_dev_endpoints:
        logger.warning("dev-mode routes are on (/sleep, /wake_up, /is_sleeping, /reset_prefix_cache): any client "
                       "with the API key can put the engine to sleep")
        app.include_router(dev_router(engine))
    _add_exception_handlers(app)
    # Middleware runs outermost-last-added: CORS, then HTTP metrics, Host check, API key and rate limit, body
    # size, send timeout. The access check comes before the body is read: an unauthenticated client cannot
    # make the server read 8 MiB.
    app.add_middleware(SendTimeoutMiddleware, send_timeout=settings.stream_send_timeout)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(AccessMiddleware, api_keys=settings.api_keys, rate_limit=settings.rate_limit)
    allowed_hosts = settings.allowed_hosts if settings.allowed_hosts is not None else \
        default_allowed_hosts(settings.host)
    app.add_middleware(HostCheckMiddleware, allowed_hosts=allowed_hosts)
    app.add_middleware(_HttpMetricsMiddleware, metrics=metrics)
    if tracer is not None:
        app.add_middleware(TraceHeadersMiddleware)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    return app


def request_tracer(settings: ServerSettings, model_name: str) -> RequestTracer | None:
    """The tracer of request spans: on with an OTLP endpoint or a provider given; ConfigError without OpenTelemetry."""
    provider = settings.tracer_provider
    if provider is None and settings.otlp_traces_endpoint:
        provider = tracer_provider(settings.otlp_traces_endpoint)
    return RequestTracer(provider, model_name) if provider is not None else None


def _add_exception_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error body with the status OpenAI uses."""

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc.errors())
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else status_phrase(exc.status_code)
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return JSONResponse(error_body(400, str(exc), exc.param), status_code=400)

    @app.exception_handler(EngineStateError)
    async def engine_asleep(_: Request, exc: EngineStateError) -> JSONResponse:
        # the one engine state a request can meet: asleep (/sleep); the dev routes answer their own conflicts
        return JSONResponse(error_body(503, f"{exc} (POST /wake_up)", code="engine_asleep"), status_code=503)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(error_body(503, str(exc), code="engine_dead"), status_code=503)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; the request was aborted

    @app.exception_handler(Exception)
    async def server_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while handling a request", exc_info=exc)
        return JSONResponse(error_body(500, "The server had an error while processing the request."),
                            status_code=500)


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A readable message from pydantic's errors, and the parameter of the first one."""
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
        return f"The request body is not valid JSON ({detail}).", None
    parts, param = [], None
    for error in errors[:3]:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        name = ".".join(loc) or "body"
        param = param or (name if loc else None)
        parts.append(f"{name}: {error.get('msg', 'invalid')}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "Invalid request: " + "; ".join(parts) + more, param


class _HttpMetricsMiddleware:
    """Counts responses by endpoint and status."""

    def __init__(self, app: Any, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in _ENDPOINTS else "other"

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def run_server(config: EngineConfig, settings: ServerSettings) -> int:
    """Start the engine and serve it until SIGTERM/SIGINT; returns the exit status."""
    import uvicorn

    check_parser_names(settings.tool_call_parser, settings.enable_auto_tool_choice, settings.reasoning_parser,
                       PluginRegistry.from_config(config.plugins))  # the registry the engine will build
    engine = AsyncLLM.from_config(config)
    try:
        app = build_app(engine, settings)
        server = uvicorn.Server(uvicorn.Config(
            app, host=settings.host, port=settings.port, log_level=settings.log_level,
            timeout_graceful_shutdown=settings.shutdown_timeout, timeout_keep_alive=5,
        ))
        kind = "pooling: /v1/embeddings, /v1/score, /v1/rerank, /classify, /pooling" if engine.pooling else \
            "generation: /v1/completions, /v1/chat/completions, /v1/responses"
        logger.info("serving %s (%s) on http://%s:%d", ", ".join(app.state.model_names), kind, settings.host,
                    settings.port)
        with _absorb_replayed_signals(), _startup_heap_frozen():
            server.run()
    finally:
        engine.shutdown()
    return 0


@contextlib.contextmanager
def _startup_heap_frozen() -> Iterator[None]:
    """While serving, keep the heap built at startup (the model's modules, the imported code: ~450,000 objects
    with the default model) out of the cyclic collector's reach, as vLLM's engine core does: a full collection
    walks all of it holding the GIL, 185-190 ms in which no stream advances; frozen, under 1 ms. Unfrozen when
    serving ends, so that a server run in a thread of a longer process leaves nothing frozen."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _absorb_replayed_signals() -> Iterator[None]:
    """Keep the process alive through uvicorn's replay of SIGINT/SIGTERM.

    uvicorn handles the signal while serving and, after its graceful shutdown, raises it again for the
    handler installed before it: with the default handlers that would kill the process before the engine
    is shut down. The no-op handlers here are that previous handler, only while uvicorn runs.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
