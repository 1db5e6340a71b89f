"""EngineConfig and its sub-configs (pydantic v2).

Every field is settable from keyword arguments, a config file and CLI flags; see docs/config.md.
`load_config` merges those sources (defaults < kwargs < file < flags unless told otherwise), lets
plugins' `llmplug_adjust_config` hooks adjust the result and validates it once, naming the field,
value and source of every error. Aliases and flag names live here too, generated from the schema.
"""

from __future__ import annotations

import copy
import difflib
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from llmplug.core.errors import ConfigError, PluginError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class _Section(BaseModel):
    """Base of all config sections: unknown keys are errors, assignment is validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# a bool field whose default is decided at engine start (the platform's check_and_update_config)
BoolOrAuto = bool | Literal["auto"]


class ModelConfig(_Section):
    """Which model to run and how to interpret it."""

    model: str = Field(DEFAULT_MODEL, description="Model directory, .gguf file or short name of an embedded model.")
    tokenizer: str | None = Field(None, description="Tokenizer directory; default: the model's own.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype; auto: the platform's preferred dtype."
    )
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="Context length; default: the model's (max_position_embeddings, n_positions, max_seq_len, ...; "
        "2048 if its config names none).",
    )
    seed: int = Field(0, description="Seed of the engine's random state (per-request seeds override).")
    skip_tokenizer_init: bool = Field(False, description="Do not load a tokenizer; prompts must be token ids.")
    trust_remote_code: bool = Field(False, description="Allow transformers to run code from the model directory.")
    hf_overrides: dict[str, Any] = Field(default_factory=dict, description="Values that override the HF config.")
    # "none" by default: dense weights are what the parity tests hold against transformers; int4 trades
    # prefill and large-batch speed for single-stream speed (docs/quantization.md)
    quantization: Literal["auto", "none", "int4", "int8"] = Field(
        "none",
        description=(
            "Weight-only int4 copies next to the dense weights. auto: where the checkpoint's own blocks are "
            "exactly int4 (GGUF Q4_0, Q4_1, Q8_0) and the platform runs the kernel; int4: every linear layer, "
            "quantizing the rest (group 32); none: dense only. An int4 layer computes at most 8 tokens per call "
            "with its int4 copy (decode) and more densely, unless batch_invariant is true: then every token "
            "count in int4. int8: every linear layer and the LM head with int8 weights (per output channel) "
            "and int8 activations (per token), an exact int32 matmul: fastest for prefill and batches, batch "
            "invariant. See docs/quantization.md."
        ),
    )
    runner: Literal["auto", "generate", "pooling"] = Field(
        "auto",
        description=(
            "What the engine serves: generate (sampling) or pooling (embeddings, classification, scores); auto: pooling "
            "for a pooling architecture (BertModel, *ForSequenceClassification) or a sentence-transformers folder."
        ),
    )
    convert: Literal["auto", "none", "embed", "classify"] = Field(
        "auto",
        description=(
            "Run a causal LM as a pooling model: embed (last-token embeddings) or classify (a `score` head); auto: "
            "embed when runner is pooling and the architecture generates, else none."
        ),
    )
    model_impl: Literal["auto", "native", "transformers"] = Field(
        "auto",
        description=(
            "Which implementation runs the architecture: native (llmplug's own, `llmplug models`), transformers (the "
            "transformers backend: transformers' model on llmplug's paged attention); auto: native when the "
            "architecture is registered, else the transformers backend. See docs/models.md."
        ),
    )
    batch_invariant: BoolOrAuto = Field(
        "auto",
        description=(
            "A request's logits are bitwise the same alone, in any batch, in any prefill chunks and with or "
            "without a prefix-cache hit (fixed-order float32 attention, oneDNN row-invariant linear layers also in "
            "float32, int4 copies for every token count). Same engine config, platform and thread count; see "
            "docs/determinism.md. auto: on where the platform, attention backend and model implement it and "
            "nothing asked for a per-batch kernel (quantization none, no device.compile, generate runner)."
        ),
    )
    prepack_weights: bool = Field(
        True,
        description=(
            "CPU, bf16/fp16: keep a copy of each dense linear weight packed into oneDNN's layout, so matmuls skip "
            "the per-call re-layout (faster decode, bitwise-equal results; costs a second copy of those weights). "
            "The batch-invariant mode packs them (float32 too) whatever this says."
        ),
    )

    @property
    def batch_invariant_on(self) -> bool:
        """Whether the batch-invariant mode runs: set True, or resolved so from auto when the engine started."""
        return self.batch_invariant is True


class CacheConfig(_Section):
    """Paged KV cache."""

    block_size: int = Field(16, gt=0, description="Tokens per KV-cache block.")
    num_blocks: int | None = Field(None, gt=0, description="Exact number of KV blocks (overrides the memory budget).")
    kv_cache_memory: int | None = Field(None, gt=0, description="KV-cache memory budget in bytes.")
    memory_fraction: float = Field(
        0.9, gt=0, le=1, description="Fraction of device memory for weights + KV cache when no budget is given."
    )
    enable_prefix_caching: bool = Field(
        True,
        description="Reuse KV blocks of identical prompt prefixes (off for models with recurrent state).",
    )


class SchedulerConfig(_Section):
    """Continuous batching."""

    max_num_seqs: int = Field(
        256, gt=0, description="Most requests in one step; also the number of recurrent-state slots of a hybrid model."
    )
    max_num_batched_tokens: int | None = Field(
        None, gt=0,
        description="Token budget of one step; default 2048 with chunked prefill, else max_model_len; "
        "pooling models: 32768, or max_model_len if longer.",
    )
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across steps.")
    policy: Literal["fcfs", "priority"] = Field("fcfs", description="Order of waiting requests.")

    def token_budget(self, max_model_len: int) -> int:
        """Tokens one step may hold: max_num_batched_tokens, else 2048 with chunked prefill, else max_model_len."""
        return self.max_num_batched_tokens or (2048 if self.enable_chunked_prefill else max_model_len)


class ParallelConfig(_Section):
    """Tensor, pipeline and data parallelism and the executor that runs the workers."""

    tensor_parallel_size: int = Field(1, gt=0, description="Ranks that split each layer.")
    pipeline_parallel_size: int = Field(1, gt=0, description="Ranks that split the layer stack.")
    data_parallel_size: int = Field(1, gt=0, description="Independent engine replicas.")
    enable_expert_parallel: bool = Field(
        False,
        description=(
            "Mixture-of-experts layers: each tensor-parallel rank holds whole experts (a share of them) instead of "
            "a slice of every expert; the same one all-reduce per layer either way."
        ),
    )
    executor: str | None = Field(
        None,
        description=(
            "`llmplug.executors` name: uniproc, multiproc, ray, external_launcher, ...; default: uniproc for one "
            "worker (tensor x pipeline parallel size 1), else multiproc."
        ),
    )
    distributed_init_method: str | None = Field(
        None,
        description="torch.distributed init method of the workers, e.g. tcp://127.0.0.1:29500; default: a free local port.",
    )
    ray_address: str | None = Field(
        None, description="Ray cluster to join (ray.init address); default: the running one, else a new local cluster."
    )
    worker_resources: dict[str, float] | None = Field(
        None,
        description=(
            "Ray resources each worker reserves (its placement-group bundle), e.g. {GPU: 0.5} for two engines "
            "per GPU or {CPU: 1}; default: one of the platform's devices (GPU: 1), or CPU: 1 on the CPU."
        ),
    )

    @field_validator("worker_resources")
    @classmethod
    def _positive_resources(cls, resources: dict[str, float] | None) -> dict[str, float] | None:
        if resources is not None and (not resources or min(resources.values()) <= 0):
            raise ValueError("give at least one resource, each amount > 0 (e.g. {CPU: 1} or {GPU: 0.5})")
        return resources


class LoadConfig(_Section):
    """How weights are read."""

    format: str = Field("auto", description="`llmplug.loaders` name; auto: by the files the model has.")
    download_dir: str | None = Field(None, description="Where to look for / put downloaded weights.")
    extra: dict[str, Any] = Field(default_factory=dict, description="Loader-specific options.")
    bnb_quant_type: Literal["nf4", "fp4", "int8"] = Field(
        "nf4",
        description=(
            "bitsandbytes loader, full-precision checkpoint: quantize the linear layers to 4-bit nf4 / fp4 or to 8-bit "
            "LLM.int8() while loading. A checkpoint already quantized by bitsandbytes keeps its own settings."
        ),
    )
    bnb_double_quant: bool = Field(
        False,
        description="bitsandbytes 4-bit: also quantize the block scales (transformers' bnb_4bit_use_double_quant).",
    )
    bnb_int8_threshold: float = Field(
        6.0, ge=0, description="bitsandbytes 8-bit: activation outliers above it take a 16-bit matmul (0: none)."
    )
    tensorizer_uri: str | None = Field(
        None,
        description=(
            "tensorizer loader: the serialized tensors (a file, or an s3:// / http(s):// URI passed to tensorizer); "
            "default: model.tensors in the model directory (see `llmplug tensorize`)."
        ),
    )
    runai_concurrency: int | None = Field(
        None,
        gt=0,
        description=(
            "runai_streamer loader: threads reading at once (RUNAI_STREAMER_CONCURRENCY); default: the streamer's own."
        ),
    )
    runai_memory_limit: int | None = Field(
        None,
        gt=0,
        description=(
            "runai_streamer loader: most bytes of CPU buffer while streaming (RUNAI_STREAMER_MEMORY_LIMIT); "
            "default: the streamer's own."
        ),
    )


class DeviceConfig(_Section):
    """Where the engine runs."""

    platform: str = Field("auto", description="`llmplug.platforms` name; auto: the available one with the highest priority.")
    attention_backend: str | None = Field(None, description="`llmplug.attention` name; default: the platform's choice.")
    num_threads: int | None = Field(None, gt=0, description="CPU threads per worker; default: all cores / workers.")
    compile: bool = Field(
        False,
        description=(
            "Run the model's forward through torch.compile (inductor), attention left as an opaque op; eager where "
            "capturing fails. Costs a compile at the first steps (cached on disk); see docs/benchmarks.md."
        ),
    )


class DecodingConfig(_Section):
    """How requests decode: guided (structured) decoding, and the limits a request is checked against when added."""

    guided_backend: str = Field(
        "auto",
        description=(
            "`llmplug.guided_decoding` name (xgrammar, llguidance, outlines, lm_format_enforcer) used when a request "
            "names none; auto: per request, the first installed backend that supports its constraint."
        ),
    )
    compact_json: bool = Field(
        True,
        description=(
            "JSON constraints allow no whitespace between tokens (a request overrides it with whitespace_flexible); "
            "with free whitespace, sampled output tends to fill it."
        ),
    )
    max_logprobs: int = Field(
        20, ge=0, description="Most `logprobs` / `prompt_logprobs` (top tokens per position) a request may ask for."
    )
    max_n: int = Field(128, gt=0, description="Most completions (`n`) one request may ask for.")
    max_stop_strings: int = Field(64, ge=0, description="Most stop strings one request may give.")
    max_stop_string_length: int = Field(256, gt=0, description="Longest stop string, in characters.")


class SpeculativeConfig(_Section):
    """Speculative decoding (vLLM's `speculative_config`): draft tokens verified in one target forward pass."""

    method: Literal["ngram", "draft_model", "eagle", "eagle3"] | None = Field(
        None, description="How drafts are proposed: ngram (prompt lookup), draft_model (a smaller model with the same "
                          "vocabulary, greedy drafts for greedy requests, sampled ones for sampled requests), eagle / "
                          "eagle3 (an EAGLE-1 / EAGLE-3 head over the target's hidden states); None: no speculative "
                          "decoding."
    )
    model: str | None = Field(
        None, description="draft_model: the draft model's directory or .gguf file; eagle, eagle3: the head's folder."
    )
    num_speculative_tokens: int | None = Field(
        None, gt=0, description="Draft tokens proposed per request and step (required with a method)."
    )
    prompt_lookup_min: int = Field(1, gt=0, description="ngram: shortest tail of the sequence looked up.")
    prompt_lookup_max: int = Field(3, gt=0, description="ngram: longest tail of the sequence looked up.")

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if (self.method in ("draft_model", "eagle", "eagle3")) != (self.model is not None):
            raise ValueError(
                "model (the draft model or EAGLE head) is required with method='draft_model', 'eagle' or 'eagle3', "
                "and only with them"
            )
        if self.method is not None and self.num_speculative_tokens is None:
            raise ValueError(f"num_speculative_tokens is required with method={self.method!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} exceeds prompt_lookup_max={self.prompt_lookup_max}"
            )
        return self


class PoolerConfig(_Section):
    """How a pooling model pools (runner: pooling); unset fields take the model's defaults."""

    pooling_type: Literal["LAST", "CLS", "MEAN", "ALL"] | None = Field(
        None,
        description=(
            "Which hidden states stand for a prompt; default: the sentence-transformers folder's, else the model's."
        ),
    )
    normalize: bool | None = Field(
        None, description="L2-normalize embeddings; default: as the sentence-transformers folder says, else true."
    )
    use_activation: bool | None = Field(
        None, description="Apply the classifier's activation (softmax / sigmoid) to class scores; default: true."
    )

class LoRAConfig(_Section):
    """Multi-LoRA serving: PEFT adapters over the base model, mixed in one batch (docs/lora.md)."""

    enable_lora: bool = Field(False, description="Serve LoRA adapters (requests name one with a LoRARequest).")
    max_loras: int = Field(4, gt=0, description="Adapter slots on the device: the most distinct adapters in one step.")
    max_lora_rank: int = Field(16, gt=0, description="Largest adapter rank accepted; the slots are sized for it.")
    max_cpu_loras: int | None = Field(
        None, gt=0, description="Adapters kept loaded in host memory (LRU); default and minimum: max_loras."
    )

    @property
    def cpu_capacity(self) -> int:
        """Adapters the host-side cache holds."""
        return max(self.max_cpu_loras or 0, self.max_loras)


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
    speculative_config: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    pooler: PoolerConfig = Field(default_factory=PoolerConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    plugins: PluginConfig = Field(default_factory=PluginConfig)


# ---------------------------------------------------------------------------------------------
# Keys: sections, flat (vLLM-style) aliases, dotted keys and CLI flag names.
# ---------------------------------------------------------------------------------------------

# section name -> its model, in validation order
SECTIONS: dict[str, type[_Section]] = {name: field.annotation for name, field in EngineConfig.model_fields.items()}

# every field as "section.field", the key of ResolvedConfig.sources
FIELD_PATHS: tuple[str, ...] = tuple(f"{s}.{name}" for s, cls in SECTIONS.items() for name in cls.model_fields)

# The one table of flat keyword names (vLLM's EngineArgs spelling) -> dotted field. Accepted in
# kwargs, in config files and as CLI flags (`--gpu-memory-utilization`). When several names point
# at one field, the first is the one a flag of an ambiguous field name uses.
ALIASES: dict[str, str] = {
    "model": "model.model",
    "tokenizer": "model.tokenizer",
    "dtype": "model.dtype",
    "max_model_len": "model.max_model_len",
    "seed": "model.seed",
    "skip_tokenizer_init": "model.skip_tokenizer_init",
    "trust_remote_code": "model.trust_remote_code",
    "hf_overrides": "model.hf_overrides",
    "quantization": "model.quantization",
    "prepack_weights": "model.prepack_weights",
    "batch_invariant": "model.batch_invariant",
    "runner": "model.runner",
    "convert": "model.convert",
    "model_impl": "model.model_impl",
    "block_size": "cache.block_size",
    "num_gpu_blocks_override": "cache.num_blocks",
    "kv_cache_memory": "cache.kv_cache_memory",
    "gpu_memory_utilization": "cache.memory_fraction",
    "enable_prefix_caching": "cache.enable_prefix_caching",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "enable_chunked_prefill": "scheduler.enable_chunked_prefill",
    "scheduling_policy": "scheduler.policy",
    "tensor_parallel_size": "parallel.tensor_parallel_size",
    "pipeline_parallel_size": "parallel.pipeline_parallel_size",
    "data_parallel_size": "parallel.data_parallel_size",
    "enable_expert_parallel": "parallel.enable_expert_parallel",
    "distributed_executor_backend": "parallel.executor",
    "load_format": "load.format",
    "download_dir": "load.download_dir",
    "model_loader_extra_config": "load.extra",
    "platform": "device.platform",
    "attention_backend": "device.attention_backend",
    "guided_decoding_backend": "decoding.guided_backend",
    "max_logprobs": "decoding.max_logprobs",
    "enable_lora": "lora.enable_lora",
    "max_loras": "lora.max_loras",
    "max_lora_rank": "lora.max_lora_rank",
    "max_cpu_loras": "lora.max_cpu_loras",
}

# Field names that say too little as a bare flag (`--format`: of what?); their flag is the vLLM
# alias when there is one, else `--<section>-<field>`. Names shared by two sections join them.
_VAGUE_NAMES = frozenset({"model", "format", "seed", "enabled", "extra", "executor", "policy", "prefer", "method"})


def _dashed(name: str) -> str:
    return "--" + name.replace("_", "-").replace(".", "-")


def _field(path: str) -> FieldInfo:
    section, name = path.split(".")
    return SECTIONS[section].model_fields[name]


def is_bool_field(path: str) -> bool:
    """True when the field at `path` is a bool, or a bool that may be "auto" (its flag has a `--no-` form)."""
    return _field(path).annotation in (bool, BoolOrAuto)


def _ambiguous_names() -> set[str]:
    names = [path.split(".")[1] for path in FIELD_PATHS]
    shared = {name for name in names if names.count(name) > 1 or name in SECTIONS}
    return shared | _VAGUE_NAMES


def _primary_flag(path: str, ambiguous: set[str]) -> str:
    section, name = path.split(".")
    if name not in ambiguous:
        return _dashed(name)
    alias = next((alias for alias, target in ALIASES.items() if target == path), None)
    return _dashed(alias or f"{section}_{name}")


def _build_flags() -> dict[str, tuple[str, ...]]:
    ambiguous = _ambiguous_names()
    flags = {}
    for path in FIELD_PATHS:
        primary = _primary_flag(path, ambiguous)
        aliases = [_dashed(alias) for alias, target in ALIASES.items() if target == path]
        flags[path] = tuple(dict.fromkeys([primary, *aliases]))
    return flags


# dotted field -> its CLI flags, the primary one first (`cache.num_blocks` -> --num-blocks,
# --num-gpu-blocks-override). Generated from the schema, so a new field gets a flag for free.
FIELD_FLAGS: dict[str, tuple[str, ...]] = _build_flags()


def _build_flag_paths() -> dict[str, str]:
    flag_paths: dict[str, str] = {}
    for path, flags in FIELD_FLAGS.items():
        negated = [f"--no-{flag[2:]}" for flag in flags] if is_bool_field(path) else []
        for flag in [*flags, *negated]:
            if flag in flag_paths:
                raise RuntimeError(f"CLI flag {flag} would set both {flag_paths[flag]} and {path}; rename one field")
            flag_paths[flag] = path
    return flag_paths


# every accepted flag spelling (including `--no-x` of booleans) -> dotted field
FLAG_PATHS: dict[str, str] = _build_flag_paths()


# ---------------------------------------------------------------------------------------------
# Loading: defaults < kwargs < file < flags (by default), then plugin hooks, then validation.
# ---------------------------------------------------------------------------------------------

SOURCE_ORDER: tuple[str, ...] = ("kwargs", "file", "cli")
HOOK_SOURCE = "hook llmplug_adjust_config"


@dataclass(frozen=True, slots=True)
class ResolvedConfig:
    """A validated EngineConfig and, for each dotted field, where its value came from."""

    config: EngineConfig
    sources: dict[str, str]


@dataclass(frozen=True, slots=True)
class _Setting:
    """One value from one source, with the key as the user spelled it (for duplicate reports)."""

    value: Any
    source: str
    key: str


def load_config(
    *,
    kwargs: Mapping[str, Any] | None = None,
    file: str | Path | None = None,
    cli: Mapping[str, Any] | None = None,
    apply_hooks: bool = True,
    order: Sequence[str] = SOURCE_ORDER,
) -> ResolvedConfig:
    """Merge defaults and the given sources (later in `order` wins), run plugin hooks, validate.

    `order` lists the sources lowest-precedence first: the CLI keeps the default kwargs < file <
    cli; `LLM(config=path, **kwargs)` passes ("file", "kwargs", "cli") so its keyword arguments win.
    """
    if sorted(order) != sorted(SOURCE_ORDER):
        raise ConfigError(
            f"load_config(order={tuple(order)!r}): list each of {SOURCE_ORDER} once, lowest precedence first"
        )
    readers = {
        "kwargs": lambda: _kwargs_settings(kwargs),
        "file": lambda: _file_settings(file),
        "cli": lambda: _cli_settings(cli),
    }
    merged: dict[str, _Setting] = {}
    for name in order:
        merged.update(readers[name]())
    nested, sources = _nest(merged)
    if apply_hooks:
        _run_hooks(nested, sources)
    return ResolvedConfig(_validate(EngineConfig, nested, sources), sources)


def _kwargs_settings(kwargs: Mapping[str, Any] | None) -> dict[str, _Setting]:
    return _settings_from(kwargs or {}, "kwargs", lambda key, path: "kwargs")


def _file_settings(file: str | Path | None) -> dict[str, _Setting]:
    if file is None:
        return {}
    label = f"file {file}"
    return _settings_from(read_config_file(file), label, lambda key, path: label)


def _cli_settings(cli: Mapping[str, Any] | None) -> dict[str, _Setting]:
    # Keys are flags as typed (`--gpu-memory-utilization`), so the source names that very flag;
    # plain keys (aliases, dotted) are named by their field's primary flag.
    def label(key: str, path: str | None) -> str:
        if key.startswith("-"):
            return f"flag {key}"
        return f"flag {FIELD_FLAGS[path][0]}" if path else "flags"

    return _settings_from(cli or {}, "flags", label)


def _settings_from(data: Any, where: str, label: Callable[[str, str | None], str]) -> dict[str, _Setting]:
    """Flatten one source's keys (sections, aliases, dotted keys, flags) to dotted fields."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"config from {where} must be a mapping of keys to values, got {type(data).__name__}")
    settings: dict[str, _Setting] = {}
    for key, value in data.items():
        for path, spelled, item in _expand(str(key), value, label(str(key), None)):
            _put(settings, path, _Setting(item, label(spelled, path), spelled), where)
    return settings


def _expand(key: str, value: Any, where: str) -> list[tuple[str, str, Any]]:
    """(dotted field, key as spelled, value) for one top-level key of a source."""
    if key in SECTIONS and (value is None or isinstance(value, (Mapping, BaseModel))):
        return [(f"{key}.{name}", f"{key}.{name}", item) for name, item in _section_items(key, value, where)]
    if key in SECTIONS and key not in ALIASES:
        raise ConfigError(
            f"{key} = {value!r} (from {where}): section '{key}' must be a mapping of its fields, e.g. {key}: {{...}}"
        )
    return [(_path_of(key, where), key, value)]


def _section_items(section: str, value: Mapping[str, Any] | BaseModel | None, where: str) -> list[tuple[str, Any]]:
    if isinstance(value, BaseModel):  # a section object: only what its author set overrides lower sources
        value = value.model_dump(exclude_unset=True)
    items = [(str(name), item) for name, item in (value or {}).items()]
    for name, _ in items:
        if name not in SECTIONS[section].model_fields:
            raise _unknown_key(f"{section}.{name}", where, _section_paths(section))
    return items


def _section_paths(section: str) -> list[str]:
    return [f"{section}.{name}" for name in SECTIONS[section].model_fields]


def _path_of(key: str, where: str) -> str:
    if key.startswith("-"):
        if key in FLAG_PATHS:
            return FLAG_PATHS[key]
        raise _unknown_key(key, where, list(FLAG_PATHS))
    if key in ALIASES:
        return ALIASES[key]
    if key in FIELD_PATHS:
        return key
    raise _unknown_key(key, where, [*SECTIONS, *ALIASES, *FIELD_PATHS])


def _unknown_key(key: str, where: str, candidates: list[str]) -> ConfigError:
    """An unknown-key error with the closest valid keys as a suggestion."""
    by_name = [path for path in FIELD_PATHS if path.split(".")[1] == key]  # a field name without its section
    close = by_name or difflib.get_close_matches(key, candidates, n=2, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else "see docs/config.md for every key"
    return ConfigError(f"unknown config key {key!r} (from {where}); {hint}")


def _put(settings: dict[str, _Setting], path: str, setting: _Setting, where: str) -> None:
    if path in settings and settings[path].key != setting.key:
        raise ConfigError(
            f"{path} is set twice in {where} (as {settings[path].key!r} and {setting.key!r}); keep one of them"
        )
    settings[path] = setting


def _nest(merged: dict[str, _Setting]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The full config as nested plain dicts (defaults filled in, so hooks see every field) and sources."""
    nested = EngineConfig().model_dump()
    sources = dict.fromkeys(FIELD_PATHS, "default")
    for path, setting in merged.items():
        section, name = path.split(".")
        nested[section][name] = setting.value
        sources[path] = setting.source
    return nested, sources


def _run_hooks(nested: dict[str, Any], sources: dict[str, str]) -> None:
    """Let `llmplug_adjust_config` hooks edit the merged dict; the fields they change name the hook as source.

    The hooks are those of the registry this very config builds (its allow-list), not the process's: two
    configs loaded in one process never see each other's plugins.
    """
    from llmplug.core.plugins import PluginRegistry  # lazy: plugins imports config

    # The allow-list decides which plugins' hooks run, so it is validated and applied first.
    plugin_config = _validate(PluginConfig, nested["plugins"], sources, prefix="plugins")
    try:
        registry = PluginRegistry.from_config(plugin_config)
    except PluginError as exc:  # e.g. a malformed plugins.prefer key: say which source set it
        where = ", ".join(sorted({sources["plugins.enabled"], sources["plugins.prefer"]} - {"default"}))
        raise ConfigError(f"{exc} (plugins config from {where or 'default'})") from None
    before = copy.deepcopy(nested)
    registry.hook_manager().hook.llmplug_adjust_config(config=nested)
    _attribute_changes(before, nested, sources)


def _attribute_changes(before: dict[str, Any], after: dict[str, Any], sources: dict[str, str]) -> None:
    missing = object()
    for section in after.keys() | before.keys():
        if section not in SECTIONS:
            raise _unknown_key(str(section), HOOK_SOURCE, list(SECTIONS))
        old, new = before.get(section) or {}, after.get(section) or {}
        if not isinstance(new, Mapping):
            continue  # validation reports it against the section
        for name in old.keys() | new.keys():
            if name not in SECTIONS[section].model_fields:
                raise _unknown_key(f"{section}.{name}", HOOK_SOURCE, _section_paths(section))
            if old.get(name, missing) != new.get(name, missing):
                sources[f"{section}.{name}"] = HOOK_SOURCE


_ModelT = TypeVar("_ModelT", bound=BaseModel)


def _validate(cls: type[_ModelT], data: Any, sources: dict[str, str], prefix: str = "") -> _ModelT:
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("; ".join(_describe_error(err, sources, prefix) for err in exc.errors())) from None


def _describe_error(err: Any, sources: dict[str, str], prefix: str) -> str:
    """'cache.block_size = -3 (from file c.yaml): Input should be greater than 0'."""
    loc = [prefix, *map(str, err["loc"])] if prefix else list(map(str, err["loc"]))
    path = ".".join(loc[:2])
    where = path + "".join(f"[{part}]" for part in loc[2:])
    return f"{where or 'config'} = {err['input']!r} (from {sources.get(path, 'default')}): {err['msg']}"


# ---------------------------------------------------------------------------------------------
# Config files
# ---------------------------------------------------------------------------------------------


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a .yaml/.yml, .toml or .json config file into a dict; errors name the file and line."""
    path = Path(path)
    parse = _FILE_PARSERS.get(path.suffix.lower())
    if parse is None:
        raise ConfigError(f"config file {path}: unknown extension {path.suffix!r}; use .yaml, .yml, .toml or .json")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read ({exc.strerror}); check the path") from None
    data = parse(text, path)
    if data is None:  # an empty (or all-comment) YAML file
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of config keys at the top, got {type(data).__name__}"
        )
    return data


def _parse_yaml(text: str, path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"config file {path} is not valid YAML{at}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None


def _parse_toml(text: str, path: Path) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - 3.10 only
        import tomli as tomllib
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # its message ends with "(at line L, column C)"
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _parse_json(text: str, path: Path) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        at = f"line {exc.lineno}, column {exc.colno}"
        raise ConfigError(f"config file {path} is not valid JSON at {at}: {exc.msg}") from None


_FILE_PARSERS: dict[str, Callable[[str, Path], Any]] = {
    ".yaml": _parse_yaml,
    ".yml": _parse_yaml,
    ".toml": _parse_toml,
    ".json": _parse_json,
}


# ---------------------------------------------------------------------------------------------
# Output of `llmplug config`
# ---------------------------------------------------------------------------------------------

CONFIG_FORMATS = ("yaml", "json", "table")


def format_config(resolved: ResolvedConfig, fmt: str = "yaml") -> str:
    """Render a resolved config: YAML with each value's source as a comment (loadable again), JSON or a table."""
    values = resolved.config.model_dump(mode="json")
    if fmt == "yaml":
        return _format_yaml(values, resolved.sources)
    if fmt == "json":
        return json.dumps({"config": values, "sources": resolved.sources}, indent=2)
    if fmt == "table":
        return _format_table(values, resolved.sources)
    raise ConfigError(f"unknown config output format {fmt!r}; use one of {', '.join(CONFIG_FORMATS)}")


def _format_yaml(values: dict[str, dict[str, Any]], sources: dict[str, str]) -> str:
    lines = [
        "# llmplug engine config; the comment after each value says where it came from.",
        "# Load it again with --config FILE.",
    ]
    for section, fields in values.items():
        lines.append(f"{section}:")
        lines += [f"  {name}: {_yaml_value(value)}  # {sources[f'{section}.{name}']}" for name, value in fields.items()]
    return "\n".join(lines) + "\n"


def _yaml_value(value: Any) -> str:
    """One value as single-line YAML (flow style for dicts and lists)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), allow_unicode=True)
    return text.removesuffix("\n...\n").strip()


def _format_table(values: dict[str, dict[str, Any]], sources: dict[str, str]) -> str:
    rows = [("field", "value", "source")]
    for section, fields in values.items():
        rows += [(f"{section}.{name}", json.dumps(v), sources[f"{section}.{name}"]) for name, v in fields.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}" for a, b, c in rows) + "\n"
