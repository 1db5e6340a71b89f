"""The completions field `prompt_embeds` (vLLM's): base64 of `torch.save`d [num_tokens, hidden_size] tensors.

Off unless the engine runs with model.enable_prompt_embeds (`--enable-prompt-embeds`): a 400 naming the flag.
The body limit (`--max-body-bytes`) caps the encoded size and decoding.max_prompts their number; each is decoded
off the event loop with `torch.load(..., weights_only=True)` (tensors only, no code runs), then checked as the
offline engine checks it (shape, float dtype, finite values, rows). Every failure is a 400 naming what is wrong.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io

import torch

from llmplug.core.errors import InvalidRequestError
from llmplug.engine.async_llm import AsyncLLM
from llmplug.engine.prompt_embeds import ENABLE_FLAG, check_prompt_embeds
from llmplug.entrypoints.openai.errors import OpenAIError

__all__ = ["load_prompt_embeds"]


async def load_prompt_embeds(engine: AsyncLLM, value: str | list[str]) -> list[torch.Tensor]:
    """The request's prompt embeddings, each checked; OpenAIError 400 for the first that is not right."""
    processor = engine.llm_engine.processor
    if processor.embedding_size is None:
        raise OpenAIError(400, f"prompt_embeds needs the server started with {ENABLE_FLAG}", param="prompt_embeds")
    items = [value] if isinstance(value, str) else list(value)
    limit = engine.config.decoding.max_prompts
    if not items or len(items) > limit:
        raise OpenAIError(400, f"prompt_embeds must hold 1 to {limit} tensors (decoding.max_prompts, --max-prompts), "
                               f"got {len(items)}", param="prompt_embeds")
    loop = asyncio.get_running_loop()
    return [await loop.run_in_executor(None, _decode, item, processor.embedding_size, processor.max_model_len, i)
            for i, item in enumerate(items)]


def _decode(encoded: str, embedding_size: int, max_model_len: int, index: int) -> torch.Tensor:
    where = f"prompt_embeds[{index}]"
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise OpenAIError(400, f"{where} is not valid base64: {exc}", param="prompt_embeds") from None
    try:
        tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - any unreadable payload is the client's error, named
        raise OpenAIError(400, f"{where} is not a tensor saved with torch.save: {type(exc).__name__}: "
                               f"{str(exc)[:200]}", param="prompt_embeds") from None
    if isinstance(tensor, torch.Tensor) and tensor.layout != torch.strided:  # its dense size is not its bytes'
        raise OpenAIError(400, f"{where} must be a dense tensor, got layout {tensor.layout}", param="prompt_embeds")
    try:
        return check_prompt_embeds(tensor, embedding_size, max_model_len)
    except InvalidRequestError as exc:
        raise OpenAIError(400, f"{where}: {exc}", param="prompt_embeds") from None
