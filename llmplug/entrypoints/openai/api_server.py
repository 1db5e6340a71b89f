"""The OpenAI-compatible server: `build_app(engine, settings)` makes the FastAPI app, `run_server` serves it.

Routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses for a generating model; for a
pooling model (embeddings, classifiers, cross-encoders) /v1/embeddings, /v1/score and /score, /v1/rerank,
/rerank and /v2/rerank, /classify and /v1/classify, /pooling; the other kind's routes answer 400 naming
the model's kind. With `allow_runtime_lora_updating` also /v1/load_lora_adapter and
/v1/unload_lora_adapter; LoRA adapters (`lora_modules`, loaded at start-up) are models of their own:
listed in /v1/models and chosen by a request's `model`. API key and rate limit apply to every /v1 route.
/health, /version, /metrics, /openapi.json (the request schemas with their bounds). Every error answers
with OpenAI's error body.
Shutdown (SIGTERM or SIGINT): uvicorn stops accepting connections, lets in-flight requests finish for
up to `shutdown_timeout` seconds, cancels the rest (which aborts them in the engine), then the engine
thread stops.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading
import time
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
from llmplug.core.errors import EngineDeadError, InvalidRequestError
from llmplug.core.plugins import PluginRegistry
from llmplug.engine.async_llm import AsyncLLM
from llmplug.entrypoints.openai.admission import AdmissionControl
from llmplug.entrypoints.openai.errors import OpenAIError, error_body, error_response, status_phrase
from llmplug.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from llmplug.entrypoints.openai.prompt_renderer import PromptRenderer, load_chat_template
from llmplug.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    ResponseObject,
    ResponsesRequest,
    UnloadLoRAAdapterRequest,
)
from llmplug.entrypoints.openai.protocol_pooling import (
    ClassifyRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from llmplug.entrypoints.openai.reply import ReplyParsers, check_parser_names
from llmplug.entrypoints.openai.security import AccessMiddleware, BodySizeLimitMiddleware, RateLimit
from llmplug.entrypoints.openai.serving_chat import OpenAIServingChat
from llmplug.entrypoints.openai.serving_completion import OpenAIServingCompletion
from llmplug.entrypoints.openai.serving_engine import ClientDisconnected
from llmplug.entrypoints.openai.serving_lora import ServedAdapters, parse_lora_modules
from llmplug.entrypoints.openai.serving_pooling import OpenAIServingPooling
from llmplug.entrypoints.openai.serving_responses import OpenAIServingResponses

logger = logging.getLogger(__name__)

API_KEY_ENV = "LLMPLUG_API_KEY"

# Endpoints named in the HTTP metrics; anything else counts as "other" (unbounded label values otherwise).
_ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/health", "/version",
              "/metrics", "/openapi.json", "/v1/embeddings", "/v1/score", "/score", "/v1/rerank", "/rerank",
              "/v2/rerank", "/classify", "/v1/classify", "/pooling")


@dataclass
class ServerSettings:
    """How the HTTP server runs (the engine's own settings are its EngineConfig)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)  # empty: no authentication
    allowed_origins: list[str] = field(default_factory=list)  # empty: no CORS headers
    rate_limit: RateLimit | None = None  # per API key or client address
    max_body_bytes: int = 8 * 1024 * 1024
    max_waiting_requests: int = 1024  # sequences waiting for the running batch; past it: 503 with Retry-After
    chat_template: str | None = None  # template text; None: the model's own
    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's model
    shutdown_timeout: float = 30.0  # grace period for in-flight requests on SIGTERM
    log_level: str = "info"
    tool_call_parser: str | None = None  # `llmplug.tool_parsers` name: the format of the model's tool calls
    enable_auto_tool_choice: bool = False  # tool_choice "auto": the model decides, the tool parser reads
    reasoning_parser: str | None = None  # `llmplug.reasoning_parsers` name
    lora_modules: dict[str, str] = field(default_factory=dict)  # LoRA adapters served at start-up: name -> folder
    allow_runtime_lora_updating: bool = False  # the /v1/load_lora_adapter and /v1/unload_lora_adapter routes
    lora_resolvers: list[str] = field(default_factory=list)  # `llmplug.lora_resolvers` names, asked in order

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerSettings":
        """Settings from the `llmplug serve` flags (and LLMPLUG_API_KEY)."""
        keys = list(args.api_key or [])
        if not keys and os.environ.get(API_KEY_ENV):
            keys = [os.environ[API_KEY_ENV]]
        return cls(
            host=args.host, port=args.port, api_keys=keys,
            allowed_origins=[o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()],
            rate_limit=RateLimit.parse(args.rate_limit) if args.rate_limit else None,
            max_body_bytes=args.max_body_bytes, max_waiting_requests=args.max_waiting_requests,
            chat_template=load_chat_template(args.chat_template) if args.chat_template else None,
            served_model_names=list(args.served_model_name or []),
            shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
            tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
            reasoning_parser=args.reasoning_parser,
            lora_modules=parse_lora_modules(args.lora_modules or []),
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
            lora_resolvers=list(args.lora_resolver or []),
        )


def build_app(engine: AsyncLLM, settings: ServerSettings | None = None) -> FastAPI:
    """The FastAPI app serving `engine`; the caller owns the engine (and shuts it down)."""
    settings = settings or ServerSettings()
    names = settings.served_model_names or [engine.model_name]
    metrics = ServerMetrics(engine.stats)
    renderer = PromptRenderer(engine.get_tokenizer(), settings.chat_template)
    admission = AdmissionControl(settings.max_waiting_requests, lambda: engine.stats()["num_running"])
    adapters = ServedAdapters.with_resolvers(engine, names, settings.lora_resolvers, engine.llm_engine.registry)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for name, path in settings.lora_modules.items():  # a start-up adapter that does not fit stops the server
            await adapters.load(name, path)
        yield
        renderer.shutdown()

    app = FastAPI(title="llmplug", version=__version__, docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.model_names = engine, metrics, names
    app.state.adapters = adapters
    parsers = ReplyParsers.load(settings.tool_call_parser, settings.enable_auto_tool_choice,
                                settings.reasoning_parser, engine.get_tokenizer(), engine.llm_engine.registry)
    shared = (engine, names, metrics, renderer, admission)
    chat = OpenAIServingChat(*shared, parsers, adapters=adapters)
    completion = OpenAIServingCompletion(*shared, adapters=adapters)
    responses = OpenAIServingResponses(*shared, parsers, adapters=adapters)
    pooling = OpenAIServingPooling(*shared)
    generates, pools = _kind_guards(engine)
    pooling_model = engine.pooling is not None  # /openapi.json lists the routes of the model's kind
    started = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        engine.check_health()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> Response:
        cards = [model_card(name) for name in [*names, *adapters.by_name]]
        return _json(ModelList(data=cards))

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Response:
        return _json(model_card(chat.check_model(model_id)))

    def model_card(name: str) -> ModelCard:
        """The base model's card, or an adapter's: its folder as root, the base model as parent."""
        lora = adapters.get(name)
        if lora is None:
            return ModelCard(id=name, created=started, root=engine.config.model.model, max_model_len=engine.max_model_len)
        return ModelCard(id=name, created=started, root=lora.lora_path, parent=names[0],
                         max_model_len=engine.max_model_len)

    if settings.allow_runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            await adapters.load(body.lora_name, body.lora_path)
            return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            await adapters.unload(body.lora_name)
            return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    @app.post("/v1/chat/completions", responses=_responses(ChatCompletionResponse), include_in_schema=not pooling_model)
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request) -> Response:
        generates("/v1/chat/completions")
        return await chat.create(body, raw_request)

    @app.post("/v1/completions", responses=_responses(CompletionResponse), include_in_schema=not pooling_model)
    async def completions(body: CompletionRequest, raw_request: Request) -> Response:
        generates("/v1/completions")
        return await completion.create(body, raw_request)

    @app.post("/v1/responses", responses=_responses(ResponseObject), include_in_schema=not pooling_model)
    async def create_response(body: ResponsesRequest, raw_request: Request) -> Response:
        generates("/v1/responses")
        return await responses.create(body, raw_request)

    @app.post("/v1/embeddings", include_in_schema=pooling_model)
    async def embeddings(body: EmbeddingRequest, raw_request: Request) -> Response:
        pools("/v1/embeddings")
        return await pooling.embeddings(body, raw_request)

    @app.post("/v1/score", include_in_schema=pooling_model)
    @app.post("/score", include_in_schema=pooling_model)
    async def score(body: ScoreRequest, raw_request: Request) -> Response:
        pools("/score")
        return await pooling.score(body, raw_request)

    @app.post("/v1/rerank", include_in_schema=pooling_model)
    @app.post("/rerank", include_in_schema=pooling_model)
    @app.post("/v2/rerank", include_in_schema=pooling_model)
    async def rerank(body: RerankRequest, raw_request: Request) -> Response:
        pools("/rerank")
        return await pooling.rerank(body, raw_request)

    @app.post("/v1/classify", include_in_schema=pooling_model)
    @app.post("/classify", include_in_schema=pooling_model)
    async def classify(body: ClassifyRequest, raw_request: Request) -> Response:
        pools("/classify")
        return await pooling.classify(body, raw_request)

    @app.post("/pooling", include_in_schema=pooling_model)
    async def pool(body: PoolingRequest, raw_request: Request) -> Response:
        pools("/pooling")
        return await pooling.pooling(body, raw_request)

    _add_exception_handlers(app)
    # Middleware runs outermost-last-added: CORS, then HTTP metrics, API key and rate limit, body size. The
    # access check comes before the body is read: an unauthenticated client cannot make the server read 8 MiB.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(AccessMiddleware, api_keys=settings.api_keys, rate_limit=settings.rate_limit)
    app.add_middleware(_HttpMetricsMiddleware, metrics=metrics)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    return app


def _kind_guards(engine: AsyncLLM) -> tuple[Any, Any]:
    """(for generation routes, for pooling routes): each raises a 400 naming the model's kind when the route
    is not for it."""
    info = engine.pooling

    def generates(route: str) -> None:
        if info is not None:
            raise OpenAIError(400, f"{route} generates text, but {engine.model_name} is a pooling model (tasks: "
                                   f"{', '.join(info.tasks)}); use /v1/embeddings, /v1/score, /v1/rerank, /classify "
                                   "or /pooling", code="wrong_model_kind")

    def pools(route: str) -> None:
        if info is None:
            raise OpenAIError(400, f"{route} needs a pooling model (embeddings, classifier, cross-encoder), but "
                                   f"{engine.model_name} generates text; serve a pooling model, or this one with "
                                   "--runner pooling to embed with it", code="wrong_model_kind")

    return generates, pools


def _responses(answer: type) -> dict[int | str, dict[str, Any]]:
    """What a generation route answers, for the OpenAPI schema: `answer`, a stream, or an error body
    (400, 401, 404, 413, 429; 503 when the waiting queue is full or the engine is dead)."""
    return {
        200: {"model": answer, "description": "The answer, or with `stream` a text/event-stream of chunks.",
              "content": {"text/event-stream": {}}},
        "4XX": {"model": ErrorResponse, "description": "The request cannot be served as sent."},
        503: {"model": ErrorResponse, "description": "Busy (Retry-After says when to retry) or the engine is dead."},
    }


def _json(model: Any) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


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
        with _absorb_replayed_signals():
            server.run()
    finally:
        engine.shutdown()
    return 0


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
