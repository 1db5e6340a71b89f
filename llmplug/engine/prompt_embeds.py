"""Prompts given as embeddings (vLLM's `prompt_embeds`): their checks, their placeholder tokens, their share of the
block hashes, and the rows they put into a step's `inputs_embeds`.

A prompt of embeddings is a [num_tokens, embedding_size] float tensor: what transformers' `get_input_embeddings()`
returns for the tokens it stands for (`model.embed_input_ids` here). Inside the engine it is a prompt of
`num_tokens` placeholder tokens (PLACEHOLDER_TOKEN_ID) that carries the tensor along: the scheduler counts,
chunks and preempts it like any prompt, and the model runner replaces the placeholders' embeddings by its rows.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from llmplug.core.errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from llmplug.core.config import EngineConfig

__all__ = ["EmbedsPrompt", "PLACEHOLDER_TOKEN_ID", "check_engine", "check_model", "check_prompt_embeds",
           "embeds_digest", "step_inputs_embeds"]

PLACEHOLDER_TOKEN_ID = 0  # the token id of every prompt position of an embeddings prompt (as vLLM's)
ENABLE_FLAG = "model.enable_prompt_embeds (--enable-prompt-embeds)"


class EmbedsPrompt(TypedDict):
    """A prompt given as embeddings: `LLM.generate({"prompt_embeds": tensor})`."""

    prompt_embeds: torch.Tensor  # [num_tokens, embedding_size], a float dtype


def check_engine(config: EngineConfig, model: Any) -> None:
    """ConfigError when prompt embeddings are enabled for what cannot take them: the model (see `check_model`),
    pipeline parallelism or speculative decoding."""
    if not config.model.enable_prompt_embeds:
        return
    check_model(model)
    if config.parallel.pipeline_parallel_size > 1:
        raise ConfigError(f"{ENABLE_FLAG} cannot be combined with pipeline parallelism "
                          "(parallel.pipeline_parallel_size > 1): start with one of them")
    if config.speculative_config.method is not None:
        raise ConfigError(f"{ENABLE_FLAG} cannot be combined with speculative decoding (speculative_config): "
                          "the drafters read token ids, which an embeddings prompt does not have")


def check_model(model: Any) -> None:
    """ConfigError naming the architecture when the model cannot take embeddings in place of token ids."""
    if getattr(model, "is_pooling_model", False):
        raise ConfigError(f"{ENABLE_FLAG} applies to generating models; {type(model).__name__} is a pooling model")
    if not getattr(model, "supports_prompt_embeds", False):
        raise ConfigError(
            f"{type(model).__name__} does not take prompt embeddings (no supports_prompt_embeds: it needs "
            f"embed_input_ids(input_ids) and forward(..., inputs_embeds=)); start without {ENABLE_FLAG}"
        )


def check_prompt_embeds(value: Any, embedding_size: int | None, max_model_len: int) -> torch.Tensor:
    """The prompt's embeddings as a contiguous CPU tensor; InvalidRequestError naming what is wrong.

    `embedding_size` None: the engine runs with prompt embeddings off. At most max_model_len - 1 rows (one
    position is left for the generated token)."""
    if embedding_size is None:
        raise InvalidRequestError(f"prompt_embeds needs the engine started with {ENABLE_FLAG}", param="prompt_embeds")
    if not isinstance(value, torch.Tensor):
        raise InvalidRequestError(f"prompt_embeds must be a torch.Tensor, got {type(value).__name__}",
                                  param="prompt_embeds")
    if value.dim() != 2 or value.shape[1] != embedding_size:
        raise InvalidRequestError(
            f"prompt_embeds must be [num_tokens, {embedding_size}] (the model's embedding size), "
            f"got shape {list(value.shape)}", param="prompt_embeds")
    if not value.dtype.is_floating_point:
        raise InvalidRequestError(f"prompt_embeds must have a float dtype, got {value.dtype}", param="prompt_embeds")
    if not 1 <= value.shape[0] < max_model_len:
        raise InvalidRequestError(
            f"prompt_embeds has {value.shape[0]} rows; it needs 1 to {max_model_len - 1} (the context length is "
            f"{max_model_len}, and one position is left for a generated token)", param="prompt_embeds")
    value = value.detach().to("cpu").contiguous()
    if not torch.isfinite(value).all():
        raise InvalidRequestError("prompt_embeds holds NaN or infinite values", param="prompt_embeds")
    return value


def embeds_digest(embeds: torch.Tensor, start: int, end: int) -> bytes:
    """A digest of rows [start, end) of a prompt's embeddings (part of their blocks' hashes): equal rows, equal
    digest; the dtype is hashed too, so that equal bytes of different dtypes differ."""
    rows = embeds[start:end].contiguous()
    h = hashlib.blake2b(str(rows.dtype).encode(), digest_size=16)
    h.update(rows.view(torch.uint8).numpy().tobytes())
    return h.digest()


def step_inputs_embeds(
    embed_input_ids: Any, input_ids: torch.Tensor, chunks: list[tuple[int, torch.Tensor]]
) -> torch.Tensor:
    """The step's first-layer input [T, embedding_size]: the token embeddings of `input_ids` [T], with the rows
    of each (first row in the step, prompt embeddings) chunk put in their place."""
    inputs_embeds = embed_input_ids(input_ids)  # [T, embedding_size]
    for row, rows in chunks:
        inputs_embeds[row : row + len(rows)] = rows
    return inputs_embeds
