"""The pooling endpoints: /v1/embeddings (OpenAI), /score and /rerank (vLLM, Jina, Cohere), /classify, /pooling.

Every input of a request is tokenized and checked (vocabulary, context length, task, `dimensions`)
before any is queued, so a bad one fails the request with a 400 naming it and nothing runs; the good
ones then run together, batched by the engine.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from fastapi import Request
from fastapi.responses import Response

from llmplug.core.errors import InvalidRequestError, RequestFailedError
from llmplug.core.outputs import PoolingRequestOutput
from llmplug.core.params import PoolingParams
from llmplug.engine.pooling import resolve_pooling_params, score_pairs
from llmplug.entrypoints.openai.errors import OpenAIError
from llmplug.entrypoints.openai.protocol_pooling import (
    ClassifyData,
    ClassifyRequest,
    ClassifyResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingInput,
    PoolingRequest,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from llmplug.entrypoints.openai.serving_engine import OpenAIServing, until_disconnected

__all__ = ["OpenAIServingPooling"]


@dataclass(slots=True)
class _Input:
    """One input, ready for the engine."""

    prompt: dict[str, Any]  # prompt_token_ids (and token_type_ids for a text pair)
    text: str | None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt["prompt_token_ids"])


class OpenAIServingPooling(OpenAIServing):
    """The endpoints of a pooling engine."""

    async def embeddings(self, body: EmbeddingRequest, raw_request: Request) -> Response:
        """OpenAI's embeddings: one vector per input, as floats or base64 float32."""
        model = self.check_model(body.model)
        self.check_caps(body)
        params = self._params("embed", "dimensions", dimensions=body.dimensions, normalize=body.normalize)
        inputs = await self._inputs(body.input)
        outputs = await self._run(raw_request, inputs, params, "embd")
        data = [EmbeddingData(index=i, embedding=_encode(out.outputs.data, body.encoding_format))
                for i, out in enumerate(outputs)]
        return _json(EmbeddingResponse(id=f"embd-{uuid.uuid4().hex}", model=model, data=data, usage=_usage(inputs)))

    async def score(self, body: ScoreRequest, raw_request: Request) -> Response:
        """vLLM's score: the relevance of each (text_1, text_2) pair."""
        model = self.check_model(body.model)
        self.check_caps(body)
        first = body.text_1 if body.text_1 is not None else body.queries
        second = body.text_2 if body.text_2 is not None else body.documents
        if first is None or second is None:
            raise OpenAIError(400, "give text_1 and text_2 (or queries and documents)", param="text_1")
        scores, inputs = await self._scores(raw_request, first, second)
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
        return _json(ScoreResponse(id=f"score-{uuid.uuid4().hex}", model=model, data=data, usage=_usage(inputs)))

    async def rerank(self, body: RerankRequest, raw_request: Request) -> Response:
        """Jina's / Cohere's rerank: the documents by relevance to the query, the best `top_n`."""
        model = self.check_model(body.model)
        self.check_caps(body)
        documents = [d if isinstance(d, str) else d.text for d in body.documents]
        if not documents:
            raise OpenAIError(400, "documents must not be empty", param="documents")
        scores, inputs = await self._scores(raw_request, body.query, documents)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or len(scores)]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=documents[i]) if body.return_documents else None)
                   for i in order]
        usage = {"total_tokens": sum(x.num_tokens for x in inputs)}
        return _json(RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=model, results=results, usage=usage))

    async def classify(self, body: ClassifyRequest, raw_request: Request) -> Response:
        """Class probabilities of each input, with the most likely label."""
        model = self.check_model(body.model)
        self.check_caps(body)
        params = self._params("classify", "input")
        inputs = await self._inputs(body.input)
        outputs = await self._run(raw_request, inputs, params, "classify")
        labels = self.engine.pooling.id2label
        data = []
        for i, out in enumerate(outputs):
            probs = out.outputs.data.tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassifyData(index=i, label=labels.get(best), probs=probs, num_classes=len(probs)))
        return _json(ClassifyResponse(id=f"classify-{uuid.uuid4().hex}", model=model, data=data, usage=_usage(inputs)))

    async def pooling(self, body: PoolingRequest, raw_request: Request) -> Response:
        """The raw pooled output of each input for `task` (default: the model's first)."""
        model = self.check_model(body.model)
        self.check_caps(body)
        params = self._params(body.task, "task")
        inputs = await self._inputs(body.input)
        outputs = await self._run(raw_request, inputs, params, "pool")
        data = [PoolingData(index=i, data=_encode(out.outputs.data, body.encoding_format))
                for i, out in enumerate(outputs)]
        return _json(PoolingResponse(id=f"pool-{uuid.uuid4().hex}", model=model, data=data, usage=_usage(inputs)))

    # --- inputs and params -------------------------------------------------------------------

    def _params(self, task: str | None, param: str, **fields: Any) -> PoolingParams:
        """The request's PoolingParams, resolved against the model (400 for what it cannot do)."""
        try:
            return resolve_pooling_params(PoolingParams(task=task, **fields), self.engine.pooling)
        except InvalidRequestError as error:
            raise OpenAIError(400, str(error), param=param) from None

    async def _inputs(self, raw: PoolingInput, param: str = "input") -> list[_Input]:
        """Every input of the request as token ids, checked against the vocabulary and the context length."""
        if isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw)):
            raw = [raw]
        if not raw:
            raise OpenAIError(400, f"{param} must not be empty: give a text, token ids or a list of them", param=param)
        inputs = []
        for i, item in enumerate(raw):
            if isinstance(item, str):
                text = item.lower() if self.engine.pooling.lowercase else item
                inputs.append(_Input({"prompt_token_ids": await self.renderer.encode(text)}, item))
            else:
                inputs.append(_Input({"prompt_token_ids": list(item)}, None))
            self._check(inputs[-1], f"{param}[{i}]" if len(raw) > 1 else param)
        return inputs

    def _check(self, item: _Input, where: str) -> None:
        ids, vocab = item.prompt["prompt_token_ids"], self.engine.vocab_size
        if not ids:
            raise OpenAIError(400, f"{where} is empty", param=where)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"{where} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}", param=where)
        if len(ids) > self.max_model_len:
            raise OpenAIError(
                400, f"{where} has {len(ids)} tokens, but this model's maximum context length is {self.max_model_len} "
                     "tokens; shorten it", param=where, code="context_length_exceeded")

    async def _run(self, raw_request: Request, inputs: list[_Input], params: PoolingParams,
                   kind: str) -> list[PoolingRequestOutput]:
        """Pool every input at once (the engine batches them); a client that leaves aborts them all. Admission
        control counts each input as a sequence, as it counts a completion's `n`."""
        request_id = f"{kind}-{uuid.uuid4().hex}"
        with self.admission.admit(len(inputs)):  # 503 when too many wait for the running batch already
            work = asyncio.gather(
                *(self.engine.encode(x.prompt, params, f"{request_id}-{i}") for i, x in enumerate(inputs))
            )
            try:
                return await until_disconnected(raw_request, work)
            except RequestFailedError as error:  # the engine goes on; this request's inputs all end
                raise OpenAIError(500, f"The request failed inside the engine: {error}",
                                  code="request_failed") from None

    async def _scores(self, raw_request: Request, first: str | list[str], second: str | list[str]
                      ) -> tuple[list[float], list[_Input]]:
        """Each pair's score: a cross-encoder's, or the cosine similarity of the two embeddings."""
        try:
            pairs = score_pairs(first, second)
        except InvalidRequestError as error:
            raise OpenAIError(400, str(error), param="text_2") from None
        if "score" in self.engine.pooling.tasks:
            params = self._params("score", "model")
            inputs = [_Input(prompt, None) for prompt in await self.renderer.encode_pairs(pairs)]
            for i, item in enumerate(inputs):
                self._check(item, f"pair {i}")
            outputs = await self._run(raw_request, inputs, params, "score")
            return [float(out.outputs.data.reshape(-1)[0]) for out in outputs], inputs
        params = self._params("embed", "model")
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        inputs = await self._inputs(texts, "text")
        outputs = await self._run(raw_request, inputs, params, "score")
        vectors = {t: out.outputs.data for t, out in zip(texts, outputs)}
        return [F.cosine_similarity(vectors[a], vectors[b], dim=0).item() for a, b in pairs], inputs


def _encode(data: Any, encoding_format: str) -> list | str:
    """A result as floats (nested lists for per-token results) or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(data.numpy().astype("<f4").tobytes()).decode("ascii")
    return data.tolist()


def _usage(inputs: list[_Input]) -> PoolingUsage:
    tokens = sum(x.num_tokens for x in inputs)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


def _json(model: Any) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")

