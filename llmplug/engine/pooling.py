"""The pooling path of the engine, beside the sampling path: which engines pool, their defaults, and the
pooler's run in the model runner.

- engine process, at start-up: `resolve_model_kind` decides `model.runner` (generate or pooling) and
  `model.convert` from the architecture and the model folder;
- worker, after loading: `pooling_info` resolves the model's pooling defaults (the engine's `pooler`
  config, else the sentence-transformers folder, else the model) into what the engine process checks
  requests against;
- engine process, per request: `resolve_pooling_params` fills a request's task and defaults and
  refuses what the model cannot do (an unknown task, `dimensions` it has no Matryoshka training for);
- worker, per step: `pool` runs the model's pooler on the requests whose whole prompt was in the step.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from llmplug.core.errors import ConfigError, InvalidRequestError
from llmplug.core.params import PoolingParams

if TYPE_CHECKING:
    import torch

    from llmplug.core.config import EngineConfig
    from llmplug.core.plugins import PluginRegistry
    from llmplug.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

__all__ = [
    "PoolingInfo",
    "pair_prompt",
    "pool",
    "pooling_info",
    "resolve_model_kind",
    "resolve_pooling_params",
    "score_pairs",
]


# ---- engine process, start-up -------------------------------------------------------------------


def resolve_model_kind(config: "EngineConfig", registry: "PluginRegistry") -> None:
    """Set `model.runner` and `model.convert` (in place) from the architecture the checkpoint names.

    auto runner: pooling for a pooling architecture or a sentence-transformers folder, else generate.
    auto convert: embed when a generating architecture runs as a pooling model, else none.
    """
    from llmplug.layers.decoder.pooling import converted_class
    from llmplug.loaders import build_loader
    from llmplug.loaders.sentence_transformers import is_sentence_transformers_folder

    model = config.model
    loader = build_loader(registry, config.load.format, config.load)
    cls = loader.get_model_class(loader.load_hf_config(model), model.model_impl)
    pools = bool(getattr(cls, "is_pooling_model", False))
    if model.runner == "auto":
        folder = is_sentence_transformers_folder(loader.model_path(model.model))
        model.runner = "pooling" if pools or (folder and model.convert != "none") else "generate"
    if model.runner == "generate" and pools:
        raise ConfigError(
            f"model.runner = 'generate', but {cls.__name__} is a pooling model (embeddings, classification); "
            "use runner 'pooling' (LLM.embed, LLM.classify, LLM.score, /v1/embeddings)"
        )
    if model.convert == "auto":
        model.convert = "embed" if model.runner == "pooling" and not pools else "none"
    if model.convert != "none" and (pools or model.runner != "pooling"):
        raise ConfigError(
            f"model.convert = {model.convert!r} turns a generating architecture into a pooling one with runner "
            f"'pooling'; {cls.__name__} with runner {model.runner!r} cannot be converted"
        )
    try:
        converted_class(cls, model.convert)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if model.runner == "pooling" and config.device.attention_backend is None:
        config.device.attention_backend = "torch_sdpa"  # pooling runs without a KV cache, which it needs


# ---- worker, after loading ----------------------------------------------------------------------


def pooling_info(model: Any, hf_config: Any, config: "EngineConfig", model_path: str) -> dict[str, Any]:
    """What the engine process needs to know of a loaded pooling model (sent as model_info["pooling"])."""
    from llmplug.loaders.sentence_transformers import read_sentence_transformers

    st = read_sentence_transformers(model_path)
    pooler, tasks = config.pooler, tuple(model.pooling_tasks)
    st_applies = st is not None and "embed" in tasks  # a folder's pooling is for its embeddings
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return {
        "tasks": tasks,
        "pooling_type": pooler.pooling_type or (st_applies and st.pooling_type) or model.default_pooling_type.value,
        "normalize": pooler.normalize if pooler.normalize is not None else (st.normalize if st_applies else True),
        "use_activation": pooler.use_activation if pooler.use_activation is not None else True,
        "embedding_size": hf_config.hidden_size,
        "is_matryoshka": bool(getattr(hf_config, "is_matryoshka", False) or dims),
        "matryoshka_dimensions": list(dims) if dims else None,
        "max_seq_length": st.max_seq_length if st is not None else None,
        "lowercase": bool(st is not None and st.do_lower_case),
        "type_vocab_size": int(getattr(model, "type_vocab_size", 0)),
        "accepts_token_type_ids": bool(getattr(model, "accepts_token_type_ids", False)),
        "id2label": {int(k): str(v) for k, v in (getattr(hf_config, "id2label", None) or {}).items()},
    }


# ---- engine process, per request ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolingInfo:
    """A pooling engine's model, as `pooling_info` described it."""

    tasks: tuple[str, ...]  # the default first
    pooling_type: str
    normalize: bool
    use_activation: bool
    embedding_size: int
    is_matryoshka: bool
    matryoshka_dimensions: list[int] | None
    max_seq_length: int | None
    lowercase: bool
    type_vocab_size: int  # token types (segments) the model embeds; 0: none
    accepts_token_type_ids: bool
    id2label: dict[int, str]  # a classifier's label names

    @classmethod
    def from_model_info(cls, info: dict[str, Any]) -> "PoolingInfo":
        """From a worker's model_info["pooling"]."""
        return cls(**{**info, "tasks": tuple(info["tasks"])})


def resolve_pooling_params(params: PoolingParams, info: PoolingInfo) -> PoolingParams:
    """A copy of `params` with task, normalize and use_activation set; InvalidRequestError for what the model
    cannot do."""
    task = params.task or info.tasks[0]
    if task not in info.tasks:
        raise InvalidRequestError(
            f"this model does not support the pooling task {task!r}; it supports {', '.join(info.tasks)}"
        )
    if params.dimensions is not None:
        _check_dimensions(params.dimensions, task, info)
    return dataclasses.replace(
        params,
        task=task,
        normalize=info.normalize if params.normalize is None else params.normalize,
        use_activation=info.use_activation if params.use_activation is None else params.use_activation,
    )


def _check_dimensions(dimensions: int, task: str, info: PoolingInfo) -> None:
    if task not in ("embed", "token_embed"):
        raise InvalidRequestError(f"dimensions={dimensions} applies to embeddings, not to the {task!r} task")
    size = info.embedding_size
    if dimensions > size:
        raise InvalidRequestError(f"dimensions={dimensions} exceeds the model's embedding size {size}")
    if dimensions == size:
        return
    if not info.is_matryoshka:
        raise InvalidRequestError(
            f"dimensions={dimensions}: this model was not trained for shorter (Matryoshka) embeddings, so only its "
            f"full size {size} is allowed (set hf_overrides is_matryoshka=true if it was)"
        )
    allowed = info.matryoshka_dimensions
    if allowed and dimensions not in allowed:
        raise InvalidRequestError(f"dimensions={dimensions} is not one of the model's Matryoshka sizes {allowed}")


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """The text pairs to score: one first text against each second text, or pairs by index."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if not first or not second:
        raise InvalidRequestError("scoring needs at least one text on each side")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise InvalidRequestError(
            f"scoring got {len(first)} first texts for {len(second)} second texts; give one or as many"
        )
    return list(zip(first, second))


def pair_prompt(tokenizer: Any, text_1: str, text_2: str) -> dict[str, Any]:
    """A text pair as a cross-encoder's tokenizer joins it: token ids and, where it has them, token types."""
    if tokenizer is None:
        raise InvalidRequestError("scoring text pairs needs the model's tokenizer (the engine runs without one)")
    encoded = tokenizer(text_1, text_2)
    prompt: dict[str, Any] = {"prompt_token_ids": list(encoded["input_ids"])}
    if encoded.get("token_type_ids") is not None:
        prompt["token_type_ids"] = list(encoded["token_type_ids"])
    return prompt


# ---- worker, per step ---------------------------------------------------------------------------


NON_FINITE = "its pooled result holds NaN or infinity (bad numerics in the model for this input)"


def pool(
    model: Any, scheduler_output: "SchedulerOutput", starts: list[int], hidden_states: "torch.Tensor", pooling_type: Any
) -> tuple[dict[str, "torch.Tensor"], dict[str, str]]:
    """(each pooling request's result (float32, on the CPU), why each failed request failed); `starts[i]` is
    request i's first row. A result holding NaN or infinity fails its request alone."""
    import torch

    from llmplug.layers.pooler import PoolingMetadata

    pooled = [(i, r) for i, r in enumerate(scheduler_output.requests) if r.pools]
    if not pooled:
        return {}, {}
    metadata = PoolingMetadata(
        starts=[starts[i] for i, _ in pooled],
        lens=[len(r.token_ids) for _, r in pooled],
        params=[r.new.pooling_params for _, r in pooled],
        pooling_type=pooling_type,
    )
    results = {r.req_id: out.float().cpu() for (_, r), out in zip(pooled, model.pooler(hidden_states, metadata))}
    failed = {req_id: NON_FINITE for req_id, out in results.items() if not bool(torch.isfinite(out).all())}
    return {req_id: out for req_id, out in results.items() if req_id not in failed}, failed
