"""EngineConfig and its sub-configs (pydantic v2).

Every field is settable from keyword arguments, a config file and CLI flags; see docs/config.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class _Section(BaseModel):
    """Base of all config sections: unknown keys are errors, assignment is validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """Which model to run and how to interpret it."""

    model: str = Field(DEFAULT_MODEL, description="Model directory, .gguf file or short name of an embedded model.")
    tokenizer: str | None = Field(None, description="Tokenizer directory; default: the model's own.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype; auto: the platform's preferred dtype."
    )
    max_model_len: int | None = Field(None, gt=0, description="Context length; default: the model's.")
    seed: int = Field(0, description="Seed of the engine's random state (per-request seeds override).")
    skip_tokenizer_init: bool = Field(False, description="Do not load a tokenizer; prompts must be token ids.")
    trust_remote_code: bool = Field(False, description="Allow transformers to run code from the model directory.")
    hf_overrides: dict[str, Any] = Field(default_factory=dict, description="Values that override the HF config.")


class CacheConfig(_Section):
    """Paged KV cache."""

    block_size: int = Field(16, gt=0, description="Tokens per KV-cache block.")
    num_blocks: int | None = Field(None, gt=0, description="Exact number of KV blocks (overrides the memory budget).")
    kv_cache_memory: int | None = Field(None, gt=0, description="KV-cache memory budget in bytes.")
    memory_fraction: float = Field(
        0.9, gt=0, le=1, description="Fraction of device memory for weights + KV cache when no budget is given."
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of identical prompt prefixes.")


class SchedulerConfig(_Section):
    """Continuous batching."""

    max_num_seqs: int = Field(256, gt=0, description="Most requests in one step.")
    max_num_batched_tokens: int | None = Field(
        None, gt=0, description="Token budget of one step; default 2048 with chunked prefill, else max_model_len."
    )
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across steps.")
    policy: Literal["fcfs", "priority"] = Field("fcfs", description="Order of waiting requests.")


class ParallelConfig(_Section):
    """Tensor, pipeline and data parallelism and the executor that runs the workers."""

    tensor_parallel_size: int = Field(1, gt=0, description="Ranks that split each layer.")
    pipeline_parallel_size: int = Field(1, gt=0, description="Ranks that split the layer stack.")
    data_parallel_size: int = Field(1, gt=0, description="Independent engine replicas.")
    executor: str = Field("uniproc", description="`llmplug.executors` name: uniproc, multiproc, ray, ...")
    distributed_init_method: str | None = Field(None, description="torch.distributed init method, e.g. tcp://127.0.0.1:29500.")


class LoadConfig(_Section):
    """How weights are read."""

    format: str = Field("auto", description="`llmplug.loaders` name; auto: by the files the model has.")
    download_dir: str | None = Field(None, description="Where to look for / put downloaded weights.")
    extra: dict[str, Any] = Field(default_factory=dict, description="Loader-specific options.")


class DeviceConfig(_Section):
    """Where the engine runs."""

    platform: str = Field("auto", description="`llmplug.platforms` name; auto: the available one with the highest priority.")
    attention_backend: str | None = Field(None, description="`llmplug.attention` name; default: the platform's choice.")
    num_threads: int | None = Field(None, gt=0, description="CPU threads per worker; default: all cores / workers.")


class DecodingConfig(_Section):
    """Guided (structured) decoding."""

    guided_backend: str = Field("auto", description="`llmplug.guided_decoding` name, or auto (per request).")
    compact_json: bool = Field(True, description="JSON grammars allow no free whitespace.")


class PluginConfig(_Section):
    """Which third-party plugins load and who wins a name conflict."""

    enabled: list[str] | None = Field(
        None, description="Allow-list of third-party distributions (or group:name); None: all. Env: LLMPLUG_PLUGINS."
    )
    prefer: dict[str, str] = Field(
        default_factory=dict, description="'group:name' -> distribution that wins when several register that name."
    )


class EngineConfig(_Section):
    """The whole engine configuration."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    load: LoadConfig = Field(default_factory=LoadConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    decoding: DecodingConfig = Field(default_factory=DecodingConfig)
    plugins: PluginConfig = Field(default_factory=PluginConfig)
