"""Bodies of the pooling endpoints: OpenAI's /v1/embeddings, vLLM's /score, /rerank (also Jina's and
Cohere's shape), /classify and /pooling. Unknown fields are kept and ignored, as in protocol.py."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from llmplug.entrypoints.openai.protocol import Count, OpenAIModel, TokenId

# one input, or several: text, token ids, a list of texts, a list of token-id lists (token ids 32-bit, as in
# protocol.py; the engine checks them against the vocabulary and each input against the context length)
PoolingInput = str | list[str] | list[TokenId] | list[list[TokenId]]


class PoolingUsage(OpenAIModel):
    """Tokens read (pooling generates none)."""

    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingRequest(OpenAIModel):
    """POST /v1/embeddings."""

    model: str | None = None
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Count | None = None
    user: str | None = None
    normalize: bool | None = None  # vLLM's extra: override the model's normalization


class EmbeddingData(OpenAIModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # floats, or base64 of little-endian float32


class EmbeddingResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreRequest(OpenAIModel):
    """POST /score, /v1/score: vLLM's `text_1` / `text_2` (also spelled `queries` / `documents`)."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None


class ScoreData(OpenAIModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(OpenAIModel):
    text: str


class RerankRequest(OpenAIModel):
    """POST /rerank, /v1/rerank, /v2/rerank: Jina's and Cohere's body (documents as texts or {text: ...})."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: Count | None = None
    return_documents: bool = True


class RerankResult(OpenAIModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(OpenAIModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: dict[str, Any]


class ClassifyRequest(OpenAIModel):
    """POST /classify, /v1/classify."""

    model: str | None = None
    input: PoolingInput


class ClassifyData(OpenAIModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassifyResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassifyData]
    usage: PoolingUsage


class PoolingRequest(OpenAIModel):
    """POST /pooling: the model's raw pooled output for any task it has."""

    model: str | None = None
    input: PoolingInput
    task: str | None = None
    encoding_format: Literal["float", "base64"] = "float"


class PoolingData(OpenAIModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: Any


class PoolingResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: PoolingUsage
