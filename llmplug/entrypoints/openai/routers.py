"""The server's routes, grouped by concern: health (open), models and LoRA adapters, generation, pooling,
tokenization, and the dev-mode routes (sleep mode, prefix cache) that only a flag adds.

A router only maps routes to handlers. Who may call them is decided once, for the whole app, by
`security.AccessMiddleware`: every route but `security.OPEN_PATHS` needs the API key and counts against
the rate limit, so a route added here is guarded without anyone remembering to guard it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from llmplug import __version__
from llmplug.core.errors import EngineStateError
from llmplug.engine.async_llm import AsyncLLM
from llmplug.engine.sleep_mode import SLEEP_LEVELS, SLEEP_TAGS
from llmplug.entrypoints.openai.errors import OpenAIError
from llmplug.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
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
from llmplug.entrypoints.openai.serving_chat import OpenAIServingChat
from llmplug.entrypoints.openai.serving_completion import OpenAIServingCompletion
from llmplug.entrypoints.openai.serving_lora import ServedAdapters
from llmplug.entrypoints.openai.serving_pooling import OpenAIServingPooling
from llmplug.entrypoints.openai.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from llmplug.entrypoints.openai.serving_responses import OpenAIServingResponses
from llmplug.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from llmplug.entrypoints.openai.serving_transcription import OpenAIServingTranscription

Guard = Callable[[str], None]  # raises a 400 when the route is not for the served model's kind


def health_router(engine: AsyncLLM, metrics: ServerMetrics, stall_timeout: float) -> APIRouter:
    """/health, /version, /metrics: the open routes (security.OPEN_PATHS), for load balancers and Prometheus.

    /health answers 503 for a dead engine, and for a stalled one: a step or command running for more than
    `stall_timeout` seconds (0: never reported) while work waits, which a load balancer must see too. With
    data-parallel replicas it lists each one's status (200 while at least one serves, else 503).
    """
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        engine.check_health()
        busy = engine.busy_for()
        if 0 < stall_timeout < busy:
            raise OpenAIError(503, f"The engine is stalled: its current step or command has run for {busy:.0f} s "
                                   f"while work waits (--health-stall-timeout is {stall_timeout:g} s).",
                              code="engine_stalled")
        replicas = engine.replica_states()
        if not replicas:
            return Response(status_code=200)
        serving = any(state.status == "running" for state in replicas)
        body = {"replicas": [{"engine": str(s.index), "status": s.status, "pid": s.pid, "restarts": s.restarts,
                              "last_error": s.last_error} for s in replicas]}
        return JSONResponse(body, status_code=200 if serving else 503)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return router


def models_router(engine: AsyncLLM, names: list[str], adapters: ServedAdapters, check_model: Callable[[str], str],
                  runtime_lora: bool) -> APIRouter:
    """/v1/models and, with `runtime_lora`, /v1/load_lora_adapter and /v1/unload_lora_adapter."""
    router = APIRouter()
    started = int(time.time())

    def model_card(name: str) -> ModelCard:
        """A model's card, by id only: a folder's path on the server is none of a client's business."""
        parent = names[0] if adapters.get(name) is not None else None
        return ModelCard(id=name, created=started, root=name, parent=parent, max_model_len=engine.max_model_len)

    @router.get("/v1/models")
    async def list_models() -> Response:
        return _json(ModelList(data=[model_card(name) for name in [*names, *adapters.by_name]]))

    @router.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Response:
        return _json(model_card(check_model(model_id)))

    if runtime_lora:
        @router.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            await adapters.load(body.lora_name, body.lora_path)
            return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

        @router.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            await adapters.unload(body.lora_name)
            return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    return router


def generation_router(chat: OpenAIServingChat, completion: OpenAIServingCompletion,
                      responses: OpenAIServingResponses, generates: Guard, in_schema: bool) -> APIRouter:
    """/v1/chat/completions, /v1/completions, /v1/responses."""
    router = APIRouter(include_in_schema=in_schema)

    @router.post("/v1/chat/completions", responses=_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request) -> Response:
        generates("/v1/chat/completions")
        return await chat.create(body, raw_request)

    @router.post("/v1/completions", responses=_responses(CompletionResponse))
    async def completions(body: CompletionRequest, raw_request: Request) -> Response:
        generates("/v1/completions")
        return await completion.create(body, raw_request)

    @router.post("/v1/responses", responses=_responses(ResponseObject))
    async def create_response(body: ResponsesRequest, raw_request: Request) -> Response:
        generates("/v1/responses")
        return await responses.create(body, raw_request)

    return router


def pooling_router(pooling: OpenAIServingPooling, pools: Guard, in_schema: bool) -> APIRouter:
    """/v1/embeddings, score, rerank, classify and /pooling (each under the paths vLLM serves it on)."""
    router = APIRouter(include_in_schema=in_schema)

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw_request: Request) -> Response:
        pools("/v1/embeddings")
        return await pooling.embeddings(body, raw_request)

    @router.post("/v1/score")
    @router.post("/score")
    async def score(body: ScoreRequest, raw_request: Request) -> Response:
        pools("/score")
        return await pooling.score(body, raw_request)

    @router.post("/v1/rerank")
    @router.post("/rerank")
    @router.post("/v2/rerank")
    async def rerank(body: RerankRequest, raw_request: Request) -> Response:
        pools("/rerank")
        return await pooling.rerank(body, raw_request)

    @router.post("/v1/classify")
    @router.post("/classify")
    async def classify(body: ClassifyRequest, raw_request: Request) -> Response:
        pools("/classify")
        return await pooling.classify(body, raw_request)

    @router.post("/pooling")
    async def pool(body: PoolingRequest, raw_request: Request) -> Response:
        pools("/pooling")
        return await pooling.pooling(body, raw_request)

    return router


def transcription_router(transcription: OpenAIServingTranscription, generates: Guard) -> APIRouter:
    """/v1/audio/transcriptions and /v1/audio/translations (OpenAI's multipart forms; a Whisper model's)."""
    router = APIRouter()

    @router.post("/v1/audio/transcriptions")
    async def transcriptions(raw_request: Request) -> Response:
        generates("/v1/audio/transcriptions")
        return await transcription.create(raw_request, "transcribe")

    @router.post("/v1/audio/translations")
    async def translations(raw_request: Request) -> Response:
        generates("/v1/audio/translations")
        return await transcription.create(raw_request, "translate")

    return router


def tokenization_router(tokenization: OpenAIServingTokenization) -> APIRouter:
    """/tokenize and /detokenize (vLLM's paths, for every kind of model)."""
    router = APIRouter()

    @router.post("/tokenize", responses=_responses(TokenizeResponse))
    async def tokenize(body: TokenizeRequest) -> Response:
        return _json(await tokenization.tokenize(body))

    @router.post("/detokenize", responses=_responses(DetokenizeResponse))
    async def detokenize(body: DetokenizeRequest) -> Response:
        return _json(await tokenization.detokenize(body))

    return router


def dev_router(engine: AsyncLLM) -> APIRouter:
    """vLLM's dev-mode routes, added only with --enable-dev-endpoints (or VLLM_SERVER_DEV_MODE=1): POST /sleep
    (query `level` 1 or 2), POST /wake_up (query `tags`, repeatable: weights, kv_cache; none: both), GET
    /is_sleeping, POST /reset_prefix_cache. They change the engine for every client, so like every route but the
    open ones they need the API key. While the engine sleeps, generation requests answer 503 (engine_asleep).
    Sleeping or resetting the prefix cache while requests run is a 409: the engine does either only when idle."""
    router = APIRouter(include_in_schema=False)

    @router.post("/sleep")
    async def sleep(level: int = 1) -> Response:
        if level not in SLEEP_LEVELS:
            raise OpenAIError(400, f"level must be 1 (offload the weights) or 2 (discard them), got {level}",
                              param="level")
        await _unless_busy(engine.sleep(level))
        return Response(status_code=200)

    @router.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)) -> Response:
        unknown = sorted(set(tags or ()) - set(SLEEP_TAGS))
        if unknown:
            raise OpenAIError(400, f"unknown tags {unknown}; the tags are {list(SLEEP_TAGS)} (none: both)",
                              param="tags")
        await engine.wake_up(tags or None)
        return Response(status_code=200)

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": await engine.is_sleeping()}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        await _unless_busy(engine.reset_prefix_cache())
        return Response(status_code=200)

    return router


async def _unless_busy(command: Awaitable[None]) -> None:
    """Await an engine command that needs an idle engine (or an awake one); 409 naming why it cannot run now."""
    try:
        await command
    except EngineStateError as exc:
        raise OpenAIError(409, str(exc), code="engine_state") from exc


def kind_guards(engine: AsyncLLM) -> tuple[Guard, Guard]:
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
