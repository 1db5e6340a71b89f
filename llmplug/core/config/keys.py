"""Config keys: sections, dotted field paths, flat (vLLM-style) aliases and CLI flag names, generated from the
schema so a new field gets its keys and flags for free."""

from __future__ import annotations

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from llmplug.core.config.schema import BoolOrAuto, EngineConfig

# section name -> its model, in validation order
SECTIONS: dict[str, type[BaseModel]] = {name: field.annotation for name, field in EngineConfig.model_fields.items()}

# every field as "section.field", the key of ResolvedConfig.sources
FIELD_PATHS: tuple[str, ...] = tuple(f"{s}.{name}" for s, cls in SECTIONS.items() for name in cls.model_fields)

# The one table of flat keyword names (vLLM's EngineArgs spelling) -> dotted field. Accepted in
# kwargs, in config files and as CLI flags (`--gpu-memory-utilization`). When several names point
# at one field, the first is the one a flag of an ambiguous field name uses.
ALIASES: dict[str, str] = {
    "model": "model.model",
    "tokenizer": "model.tokenizer",
    "revision": "model.revision",
    "hf_file": "model.hf_file",
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
    "enable_prompt_embeds": "model.enable_prompt_embeds",
    "limit_mm_per_prompt": "model.limit_mm_per_prompt",
    "mm_processor_kwargs": "model.mm_processor_kwargs",
    "block_size": "cache.block_size",
    "num_gpu_blocks_override": "cache.num_blocks",
    "kv_cache_memory": "cache.kv_cache_memory",
    "gpu_memory_utilization": "cache.memory_fraction",
    "enable_prefix_caching": "cache.enable_prefix_caching",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "enable_chunked_prefill": "scheduler.enable_chunked_prefill",
    "scheduling_policy": "scheduler.policy",
    "max_num_encoder_input_tokens": "scheduler.max_num_encoder_input_tokens",
    "encoder_cache_size": "scheduler.encoder_cache_size",
    "tensor_parallel_size": "parallel.tensor_parallel_size",
    "pipeline_parallel_size": "parallel.pipeline_parallel_size",
    "data_parallel_size": "parallel.data_parallel_size",
    "data_parallel_routing": "parallel.data_parallel_routing",
    "data_parallel_backend": "parallel.data_parallel_backend",
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
    "kv_offloading_size": "kv_transfer_config.kv_offloading_size",
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
