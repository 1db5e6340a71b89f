"""GGUF metadata -> Hugging Face `PretrainedConfig`.

llama.cpp stores a model's hyperparameters as `{arch}.key` metadata entries. This module reads the
few it needs (never the large tokenizer arrays) and builds the transformers config that the model
plugins consume, so a .gguf file needs no config.json beside it. Architectures are data: one row of
`ARCHITECTURES` each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import gguf
import numpy as np
from transformers import PretrainedConfig

from llmplug.core.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class GGUFArchitecture:
    """How one `general.architecture` value maps to transformers, and what llama.cpp changed on the way."""

    model_type: str  # transformers config class, via AutoConfig.for_model
    hf_architecture: str  # the `llmplug.models` name
    permute_qk: bool = False  # llama.cpp interleaves Q/K rows for its GPT-J-style rope; HF uses rotate-half
    attention_bias: bool | None = None  # fixed by the HF class (None: present iff attn_q.bias is in the file)
    rope_dims_are_head_dim: bool = False  # rope.dimension_count equals head_dim (no partial rotary)
    rope: bool = True  # False: learned positions or ALiBi, no rope fields in the config
    # False: the file's context_length is a placeholder (Bloom's converter writes n_embed, Mamba's 2**20)
    has_context_length: bool = True
    renames: Mapping[str, str] = field(default_factory=dict)  # standard config field -> this class's name
    extra: Callable[[_ArchMetadata, frozenset[str]], dict[str, Any]] | None = None  # (metadata, tensor names)
    norm_offset: float = 0.0  # llama.cpp stores `offset + w` norms (Gemma's 1 + w, layernorm1p) as the weight
    conv1d: bool = False  # GPT-2: llama.cpp stores Conv1D weights transposed to [out, in]
    qkv_contiguous: bool = False  # Bloom: llama.cpp regroups the per-head fused qkv as [q | k | v]
    attention: bool = True  # False: no attention (Mamba): no head counts, feed-forward size or rope in the file
    ssm_a_log: bool = False  # Mamba: llama.cpp stores A = -exp(A_log) as `ssm_a`


def _partial_rotary(meta: _ArchMetadata, tensors: frozenset[str]) -> dict[str, Any]:
    """partial_rotary_factor from rope.dimension_count (the rotated dims of a head)."""
    rope_dims = meta.get("rope.dimension_count")
    return {} if rope_dims is None else {"partial_rotary_factor": rope_dims / _head_dim_of(meta)}


def _gemma_fields(meta: _ArchMetadata, tensors: frozenset[str], layers_27b: int) -> dict[str, Any]:
    """Window and soft-caps when the file has them; llama.cpp's query scale: hidden / heads for 27B, else head_dim."""
    fields = {
        name: meta.get(key)
        for name, key in (
            ("sliding_window", "attention.sliding_window"),
            ("attn_logit_softcapping", "attn_logit_softcapping"),
            ("final_logit_softcapping", "final_logit_softcapping"),
        )
        if meta.get(key) is not None
    }
    hidden, heads = meta.require("embedding_length"), meta.require("attention.head_count")
    is_27b = meta.require("block_count") == layers_27b  # llama.cpp names the model size by its layer count
    fields["query_pre_attn_scalar"] = hidden // heads if is_27b else _head_dim_of(meta)
    return fields


def _stablelm_fields(meta: _ArchMetadata, tensors: frozenset[str]) -> dict[str, Any]:
    """Partial rotary; a parallel residual when the blocks have no ffn_norm (transformers reads it the same way)."""
    if "blk.0.attn_q_norm.weight" in tensors:
        raise ModelLoadError(f"GGUF file {meta.path}: StableLM per-head q/k norms are not supported in GGUF.")
    return {**_partial_rotary(meta, tensors), "use_parallel_residual": "blk.0.ffn_norm.weight" not in tensors}


def _window(meta: _ArchMetadata, tensors: frozenset[str]) -> dict[str, Any]:
    """sliding_window when the file has one."""
    window = meta.get("attention.sliding_window")
    return {} if window is None else {"sliding_window": window}


def _experts(meta: _ArchMetadata, count_field: str, size_field: str | None) -> dict[str, Any]:
    """The expert count (into `count_field`), experts per token and each expert's size (into `size_field`)."""
    fields = {count_field: meta.require("expert_count"), "num_experts_per_tok": meta.require("expert_used_count")}
    if size_field is not None:
        fields[size_field] = meta.require("expert_feed_forward_length")
    return fields


def _qwen2_moe_fields(meta: _ArchMetadata, tensors: frozenset[str]) -> dict[str, Any]:
    """Experts, and the shared expert's size (0 when the file has none); llama.cpp never renormalises the top-k."""
    shared = meta.get("expert_shared_feed_forward_length", 0)
    return {**_experts(meta, "num_experts", "moe_intermediate_size"), "shared_expert_intermediate_size": shared,
            "norm_topk_prob": False}


def _qwen3_moe_fields(meta: _ArchMetadata, tensors: frozenset[str]) -> dict[str, Any]:
    """Experts; llama.cpp always renormalises Qwen3-MoE's top-k weights (as transformers' GGUF loader assumes)."""
    return {**_experts(meta, "num_experts", "moe_intermediate_size"), "norm_topk_prob": True}


GATING_SIGMOID = gguf.ExpertGatingFuncType.SIGMOID.value


def _minimax_m2_fields(meta: _ArchMetadata, tensors: frozenset[str]) -> dict[str, Any]:
    """Experts (their size is `intermediate_size`), partial rotary, sigmoid routing with a correction bias."""
    gating = meta.get("expert_gating_func", GATING_SIGMOID)
    if gating != GATING_SIGMOID:
        raise ModelLoadError(f"GGUF file {meta.path}: MiniMax-M2 with expert_gating_func {gating} (not sigmoid).")
    rotary = meta.get("rope.dimension_count")  # MiniMax's own (legacy) field for its partial rotary
    fields = _experts(meta, "num_local_experts", "intermediate_size")
    return fields if rotary is None else {**fields, "rotary_dim": rotary}


def _lfm2_fields(meta: _ArchMetadata, tensors: frozenset[str]) -> dict[str, Any]:
    """LFM2's layer kinds from the per-layer KV head counts (0: a short-conv layer), the conv length, and the
    feed-forward size as stored (the converter writes the adjusted size: no second adjustment)."""
    kv_heads = meta.require("attention.head_count_kv")
    if not isinstance(kv_heads, list):
        kv_heads = [kv_heads] * meta.require("block_count")
    return {
        "num_key_value_heads": max(kv_heads), "full_attn_idxs": [i for i, n in enumerate(kv_heads) if n > 0],
        "conv_L_cache": meta.require("shortconv.l_cache"), "block_auto_adjust_ff_dim": False,
        "conv_bias": any(name.endswith("shortconv.conv.bias") for name in tensors),
    }


def _mamba_fields(meta: _ArchMetadata, tensors: frozenset[str]) -> dict[str, Any]:
    """The selective-scan sizes; transformers derives intermediate_size as expand * hidden_size."""
    hidden, inner = meta.require("embedding_length"), meta.require("ssm.inner_size")
    if inner % hidden:
        raise ModelLoadError(f"GGUF file {meta.path}: ssm.inner_size {inner} is not a multiple of {hidden}.")
    return {
        "expand": inner // hidden, "state_size": meta.require("ssm.state_size"),
        "conv_kernel": meta.require("ssm.conv_kernel"), "time_step_rank": meta.require("ssm.time_step_rank"),
        "use_conv_bias": "blk.0.ssm_conv1d.bias" in tensors, "use_bias": "blk.0.ssm_in.bias" in tensors,
    }


# Mistral GGUFs are written with general.architecture "llama" and load through that row. Architectures
# transformers' own GGUF loader reads, less those llmplug has no model for (deci, gemma4) and those it cannot
# read itself (docs/gguf.md).
ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("llama", "LlamaForCausalLM", permute_qk=True, rope_dims_are_head_dim=True),
    "qwen2": GGUFArchitecture("qwen2", "Qwen2ForCausalLM", attention_bias=True),
    "qwen3": GGUFArchitecture("qwen3", "Qwen3ForCausalLM"),
    "gemma2": GGUFArchitecture(
        "gemma2", "Gemma2ForCausalLM", norm_offset=1.0, extra=lambda m, t: _gemma_fields(m, t, layers_27b=46)
    ),
    "gemma3": GGUFArchitecture(
        "gemma3_text", "Gemma3ForCausalLM", norm_offset=1.0, extra=lambda m, t: _gemma_fields(m, t, layers_27b=62)
    ),
    "phi3": GGUFArchitecture("phi3", "Phi3ForCausalLM", extra=lambda m, t: {**_partial_rotary(m, t), **_window(m, t)}),
    "stablelm": GGUFArchitecture(
        "stablelm", "StableLmForCausalLM", renames={"attention_bias": "use_qkv_bias", "eps": "layer_norm_eps"},
        extra=_stablelm_fields,
    ),
    "starcoder2": GGUFArchitecture(
        "starcoder2", "Starcoder2ForCausalLM", renames={"attention_bias": "use_bias", "eps": "norm_epsilon"},
        extra=_window,
    ),
    "nemotron": GGUFArchitecture(
        "nemotron", "NemotronForCausalLM", renames={"eps": "norm_eps"}, norm_offset=1.0, extra=_partial_rotary
    ),
    "gpt2": GGUFArchitecture(
        "gpt2", "GPT2LMHeadModel", rope=False, conv1d=True,
        renames={"intermediate_size": "n_inner", "eps": "layer_norm_epsilon"},
    ),
    "qwen2moe": GGUFArchitecture("qwen2_moe", "Qwen2MoeForCausalLM", attention_bias=True, extra=_qwen2_moe_fields),
    "qwen3moe": GGUFArchitecture("qwen3_moe", "Qwen3MoeForCausalLM", extra=_qwen3_moe_fields),
    "minimax-m2": GGUFArchitecture("minimax_m2", "MiniMaxM2ForCausalLM", extra=_minimax_m2_fields),
    "lfm2": GGUFArchitecture("lfm2", "Lfm2ForCausalLM", renames={"eps": "norm_eps"}, extra=_lfm2_fields),
    "mamba": GGUFArchitecture(
        "mamba", "MambaForCausalLM", attention=False, rope=False, ssm_a_log=True, has_context_length=False,
        renames={"eps": "layer_norm_epsilon"}, extra=_mamba_fields,
    ),
    "bloom": GGUFArchitecture(
        "bloom", "BloomForCausalLM", rope=False, has_context_length=False, qkv_contiguous=True,
        renames={"eps": "layer_norm_epsilon"},
    ),
}

# Metadata keys (after the "{arch}." prefix) copied as they are; the rest are derived below.
_DIRECT_FIELDS = {"hidden_size": "embedding_length", "num_hidden_layers": "block_count"}
_ATTENTION_FIELDS = {"intermediate_size": "feed_forward_length", "num_attention_heads": "attention.head_count"}
_EPS_KEYS = ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon")  # RMSNorm, LayerNorm
_TOKEN_ID_FIELDS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}
_ROPE_SCALING_PREFIX = "rope.scaling."
# llama.cpp rope-scaling keys with an exact transformers equivalent.
_ROPE_SCALING_KEYS = {
    "factor": "factor",
    "original_context_length": "original_max_position_embeddings",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}
# Keys that carry no information when they hold their neutral value.
_ROPE_SCALING_NEUTRAL = {"finetuned": None, "attn_factor": 1.0, "yarn_log_multiplier": 0.0}
ROPE_FREQS_TENSOR = "rope_freqs.weight"  # Llama 3.x rope factors; turned into rope_scaling, not a weight


def field_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The Python value of one metadata entry (str, int, float, bool or list), or `default`."""
    field = reader.fields.get(key)
    if field is None:
        return default
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [_scalar(field.parts[index], field.types[-1]) for index in field.data]
    return _scalar(field.parts[field.data[0]], field.types[0])


def _scalar(part: np.ndarray, kind: gguf.GGUFValueType) -> Any:
    """Decode one stored value (strings are raw UTF-8 bytes in the file)."""
    if kind == gguf.GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")  # a damaged name then fails as unknown
    return part[0].item()


def architecture_of(reader: gguf.GGUFReader, path: str) -> tuple[str, GGUFArchitecture]:
    """The file's `general.architecture` and its row, or ModelLoadError listing the supported ones."""
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF file {path}: architecture {arch!r} is not supported by the gguf loader; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}."
        )
    return arch, ARCHITECTURES[arch]


def build_hf_config(reader: gguf.GGUFReader, path: str) -> PretrainedConfig:
    """The transformers config of the model in `reader` (architectures, sizes, rope, tokens, tying)."""
    from transformers import AutoConfig

    arch, spec = architecture_of(reader, path)
    meta = _ArchMetadata(reader, arch, path)
    tensors = frozenset(tensor.name for tensor in reader.tensors)
    fields = {name: meta.require(key) for name, key in _DIRECT_FIELDS.items()}
    fields["eps"] = _norm_eps(meta)
    if spec.attention:
        fields |= {name: meta.require(key) for name, key in _ATTENTION_FIELDS.items()}
        fields["num_key_value_heads"] = meta.get("attention.head_count_kv", fields["num_attention_heads"])
        fields["head_dim"] = _head_dim(meta, spec, fields["hidden_size"], fields["num_attention_heads"])
    if spec.has_context_length:
        fields["max_position_embeddings"] = meta.require("context_length")
    if spec.rope:
        fields["rope_theta"] = float(meta.get("rope.freq_base", 10000.0))
        fields["rope_scaling"] = _rope_scaling(reader, meta, fields["rope_theta"], fields["head_dim"])
    fields.update(_tensor_derived_fields(reader, spec, path))
    default_names = {"eps": "rms_norm_eps"}
    fields = {spec.renames.get(name, default_names.get(name, name)): value for name, value in fields.items()}
    fields.update(spec.extra(meta, tensors) if spec.extra else {})
    fields.update({name: field_value(reader, key) for name, key in _TOKEN_ID_FIELDS.items()})
    config = AutoConfig.for_model(spec.model_type, architectures=[spec.hf_architecture], **fields)
    config.name_or_path = path
    return config


def _norm_eps(meta: _ArchMetadata) -> float:
    """The norm epsilon, under the RMSNorm or the LayerNorm key."""
    for key in _EPS_KEYS:
        if (value := meta.get(key)) is not None:
            return value
    raise ModelLoadError(f"GGUF file {meta.path}: required metadata {meta.arch}.{_EPS_KEYS[0]} is missing.")


def _head_dim_of(meta: _ArchMetadata) -> int:
    """attention.key_length, else hidden / heads."""
    key_length = meta.get("attention.key_length")
    return int(key_length) if key_length is not None else meta.require("embedding_length") // meta.require(
        "attention.head_count"
    )


# The tokens that end a generation, as llama.cpp reads them (end of sequence, of a turn, of a message).
EOS_TOKEN_KEYS = (gguf.Keys.Tokenizer.EOS_ID, gguf.Keys.Tokenizer.EOT_ID, gguf.Keys.Tokenizer.EOM_ID)


def gguf_generation_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """The generation config a GGUF file implies: its end-of-generation token ids (primary eos first)."""
    eos = [field_value(reader, key) for key in EOS_TOKEN_KEYS]
    eos = list(dict.fromkeys(t for t in eos if t is not None))
    return {"eos_token_id": eos} if eos else {}


class _ArchMetadata:
    """Reads `{arch}.`-prefixed metadata of one file, naming the file and key when one is missing."""

    def __init__(self, reader: gguf.GGUFReader, arch: str, path: str) -> None:
        self.reader, self.arch, self.path = reader, arch, path

    def get(self, key: str, default: Any = None) -> Any:
        """The value of `{arch}.{key}`, or `default`."""
        return field_value(self.reader, f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        """The value of `{arch}.{key}`; ModelLoadError when the file lacks it."""
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"GGUF file {self.path}: required metadata {self.arch}.{key} is missing.")
        return value

    def keys_under(self, prefix: str) -> dict[str, Any]:
        """Every `{arch}.{prefix}*` entry, keyed by the part after the prefix."""
        full = f"{self.arch}.{prefix}"
        return {key[len(full):]: field_value(self.reader, key) for key in self.reader.fields if key.startswith(full)}


def _head_dim(meta: _ArchMetadata, spec: GGUFArchitecture, hidden_size: int, num_heads: int) -> int:
    """attention.key_length when written (convert writes it for an explicit head_dim), else derived."""
    key_length, value_length = meta.get("attention.key_length"), meta.get("attention.value_length")
    if key_length is not None and value_length not in (None, key_length):
        raise ModelLoadError(
            f"GGUF file {meta.path}: key_length {key_length} != value_length {value_length} is not supported."
        )
    if key_length is None and spec.rope_dims_are_head_dim:
        key_length = meta.get("rope.dimension_count")
    return int(key_length) if key_length is not None else hidden_size // num_heads


def _tensor_derived_fields(reader: gguf.GGUFReader, spec: GGUFArchitecture, path: str) -> dict[str, Any]:
    """Fields only the tensor list tells: vocab size, tied embeddings, attention bias."""
    shapes = {tensor.name: [int(dim) for dim in tensor.shape] for tensor in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise ModelLoadError(f"GGUF file {path}: tensor token_embd.weight is missing.")
    fields = {
        "vocab_size": shapes["token_embd.weight"][-1],  # GGUF shape [hidden, vocab]: reversed vs torch
        "tie_word_embeddings": "output.weight" not in shapes,
    }
    if spec.attention:
        bias = spec.attention_bias
        fields["attention_bias"] = "blk.0.attn_q.bias" in shapes if bias is None else bias
    return fields


def _rope_scaling(
    reader: gguf.GGUFReader, meta: _ArchMetadata, theta: float, head_dim: int
) -> dict[str, Any] | None:
    """transformers' rope_scaling from `{arch}.rope.scaling.*`, or from a Llama 3 rope_freqs tensor."""
    entries = meta.keys_under(_ROPE_SCALING_PREFIX)
    kind = entries.pop("type", None)
    freqs = next((tensor for tensor in reader.tensors if tensor.name == ROPE_FREQS_TENSOR), None)
    if freqs is not None:
        return _llama3_rope_scaling(np.asarray(freqs.data, dtype=np.float64), theta, head_dim, meta.path)
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ModelLoadError(f"GGUF file {meta.path}: rope scaling type {kind!r} is not supported (linear, yarn).")
    return {"rope_type": kind, **_rope_scaling_values(entries, meta.path)}


def _rope_scaling_values(entries: dict[str, Any], path: str) -> dict[str, Any]:
    """Rename the rope.scaling.* values; any value without an exact HF equivalent is an error."""
    values = {}
    for key, value in entries.items():
        if key in _ROPE_SCALING_KEYS:
            values[_ROPE_SCALING_KEYS[key]] = value
        elif key in _ROPE_SCALING_NEUTRAL and _ROPE_SCALING_NEUTRAL[key] in (None, value):
            continue
        else:
            # Silently dropping it would change the model's outputs.
            raise ModelLoadError(f"GGUF file {path}: rope.scaling.{key} = {value!r} has no transformers equivalent.")
    return values


def llama3_rope_factors(theta: float, head_dim: int, scaling: dict[str, float]) -> np.ndarray:
    """The per-frequency factors llama.cpp's converter stores as rope_freqs for Llama 3 rope scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    smooth = (old_len / wavelen - low) / (high - low)
    between = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_len / high, 1.0, np.where(wavelen > old_len / low, factor, between))


def _llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int, path: str) -> dict[str, Any]:
    """Recover Llama 3 rope_scaling from stored factors, accepting it only if it reproduces them."""
    # The converter always uses these constants (Llama 3.1/3.2/3.3); only `factor` varies.
    scaling = {
        "rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }
    if factors.shape != (head_dim // 2,) or not np.allclose(
        llama3_rope_factors(theta, head_dim, scaling), factors, rtol=1e-4
    ):
        raise ModelLoadError(
            f"GGUF file {path}: tensor {ROPE_FREQS_TENSOR} does not match Llama 3 rope scaling; "
            "custom rope frequency factors are not supported."
        )
    return scaling
