"""The Llama family: one generic pre-norm decoder; each architecture is a config adapter.

Llama, Mistral, Qwen2 and Qwen3 differ only in flags (q/k/v and o biases, q/k RMSNorm, tied
embeddings, rope scaling), so each is `DecoderForCausalLM` plus a function that converts its HF
config into a `DecoderArchConfig`. Checkpoint names map onto the fused projections through
`STACKED_PARAMS`, and one generic loop loads every tensor.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, ClassVar, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.communicators.parallel_state import get_pp_group
from llmplug.core.errors import ModelLoadError
from llmplug.layers.activation import SiluAndMul
from llmplug.layers.attention import Attention
from llmplug.layers.layernorm import RMSNorm
from llmplug.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from llmplug.layers.pipeline import IntermediateTensors, PPMissingLayer, pp_layer_range, skip_missing_layers
from llmplug.layers.rotary import RotaryCosSin, get_rope
from llmplug.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from llmplug.layers.weight_utils import load_mapped_weights
from llmplug.plugins.models.arch_config import DecoderArchConfig, head_dim_of, rope_config_of, sliding_windows_of

__all__ = [
    "DecoderForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "llama_arch_config",
    "mistral_arch_config",
    "qwen2_arch_config",
    "qwen3_arch_config",
]

# checkpoint module -> (our fused module, shard)
STACKED_PARAMS: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# rotary tables that old checkpoints saved as buffers; ours are recomputed from the config
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


# ---- config adapters: HF config -> DecoderArchConfig (the only place that reads the HF config) ----


def _common_fields(hf: PretrainedConfig) -> dict[str, Any]:
    """Fields every Llama-family config carries."""
    act = getattr(hf, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"{type(hf).__name__}: hidden_act {act!r} is not supported (only silu)")
    return dict(
        architecture=(getattr(hf, "architectures", None) or [type(hf).__name__])[0],
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim_of(hf),
        rms_norm_eps=hf.rms_norm_eps,
        rope=rope_config_of(hf),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        sliding_windows=sliding_windows_of(hf),
    )


def llama_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """LlamaForCausalLM: `attention_bias` on q, k, v and o; optional `mlp_bias`."""
    bias = bool(getattr(hf, "attention_bias", False))
    return DecoderArchConfig(
        **_common_fields(hf), qkv_bias=bias, o_proj_bias=bias, mlp_bias=bool(getattr(hf, "mlp_bias", False))
    )


def mistral_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """MistralForCausalLM: no biases."""
    return DecoderArchConfig(**_common_fields(hf))


def qwen2_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Qwen2ForCausalLM: bias on q, k, v only."""
    return DecoderArchConfig(**_common_fields(hf), qkv_bias=True)


def qwen3_arch_config(hf: PretrainedConfig) -> DecoderArchConfig:
    """Qwen3ForCausalLM: RMSNorm on q and k heads; `attention_bias` on q, k, v and o."""
    bias = bool(getattr(hf, "attention_bias", False))
    return DecoderArchConfig(**_common_fields(hf), qkv_bias=bias, o_proj_bias=bias, qk_norm=True)


# ---- the generic decoder ----


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class DecoderMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, arch: DecoderArchConfig, prefix: str = "") -> None:
        super().__init__()
        size, inter = arch.hidden_size, arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            size, [inter, inter], arch.mlp_bias, _join(prefix, "gate_up_proj")
        )
        self.down_proj = RowParallelLinear(inter, size, arch.mlp_bias, prefix=_join(prefix, "down_proj"))
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, 2 * inter / tp] -> [T, inter / tp]


class DecoderAttention(nn.Module):
    """Fused qkv projection, optional q/k norm, in-place rotary, paged attention, output projection."""

    def __init__(self, arch: DecoderArchConfig, prefix: str = "", layer_index: int = 0) -> None:
        super().__init__()
        d = arch.head_dim
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, d, arch.num_heads, arch.num_kv_heads, arch.qkv_bias, _join(prefix, "qkv_proj")
        )
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            arch.num_heads * d, arch.hidden_size, arch.o_proj_bias, prefix=_join(prefix, "o_proj")
        )
        self.q_norm = RMSNorm(d, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(d, arch.rms_norm_eps) if arch.qk_norm else None
        self.attn = Attention(
            self.num_heads, d, d**-0.5, self.num_kv_heads, prefix=_join(prefix, "attn"),
            sliding_window=arch.sliding_window_of(layer_index),
        )

    def forward(self, hidden: torch.Tensor, rope: RotaryCosSin) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 * Hkv) * D]
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        qk = qkv[:, :k_end].view(qkv.shape[0], self.num_heads + self.num_kv_heads, self.head_dim)  # [T, H + Hkv, D]
        if self.q_norm is not None:
            self._norm_heads_(qk)
        rope.apply_(qk)  # rotates q and k inside qkv
        out = self.attn(qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:])  # [T, H * D]
        return self.o_proj(out)

    def _norm_heads_(self, qk: torch.Tensor) -> None:
        """RMSNorm each q and k head over head_dim, in place."""
        qk[:, : self.num_heads] = self.q_norm(qk[:, : self.num_heads])
        qk[:, self.num_heads :] = self.k_norm(qk[:, self.num_heads :])


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); residual adds fused into the norms."""

    def __init__(self, arch: DecoderArchConfig, prefix: str = "", layer_index: int = 0) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(arch, _join(prefix, "self_attn"), layer_index)
        self.mlp = DecoderMLP(arch, _join(prefix, "mlp"))
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RotaryCosSin
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sublayer output, residual stream) of the previous layer -> the same for this one."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, rope)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, the decoder layers and the final norm; one rotary table shared by all layers.

    Under pipeline parallelism it holds only its stage's layers (the embedding on the first stage,
    the final norm on the last); the others are PPMissingLayer placeholders.
    """

    def __init__(self, arch: DecoderArchConfig, prefix: str = "") -> None:
        super().__init__()
        pp = get_pp_group()
        self.start_layer, self.end_layer = pp_layer_range(arch.num_layers)
        self.is_last_stage = pp.is_last_rank
        self.embed_tokens = (
            VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, _join(prefix, "embed_tokens"))
            if pp.is_first_rank
            else PPMissingLayer()
        )
        on_stage = range(self.start_layer, self.end_layer)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, _join(prefix, f"layers.{i}"), i) if i in on_stage else PPMissingLayer()
            for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if pp.is_last_rank else PPMissingLayer()
        rope = arch.rope
        self.rotary_emb = get_rope(
            arch.head_dim, arch.rotary_dim, rope.max_position, rope.theta, rope.scaling, rope.is_neox_style
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: IntermediateTensors | None = None
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions [T] -> hidden states [T, hidden] (IntermediateTensors before the last stage)."""
        if intermediate_tensors is None:
            hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        else:
            hidden, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        rope = self.rotary_emb.cos_sin(positions, hidden.dtype)  # looked up once for all layers
        for layer in itertools.islice(self.layers, self.start_layer, self.end_layer):
            hidden, residual = layer(hidden, residual, rope)
        if not self.is_last_stage:
            return IntermediateTensors({"hidden_states": hidden, "residual": residual})
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """The generic Llama-family causal LM; subclasses only choose `arch_config_of`."""

    arch_config_of: ClassVar[Callable[[PretrainedConfig], DecoderArchConfig]] = staticmethod(llama_arch_config)
    supports_pipeline_parallel: ClassVar[bool] = True

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.arch = type(self).arch_config_of(config)
        self.model = DecoderModel(self.arch, _join(prefix, "model"))
        self.lm_head = self._lm_head(_join(prefix, "lm_head"))

    def _lm_head(self, prefix: str) -> ParallelLMHead | PPMissingLayer:
        """The output projection (last pipeline stage only); a tied one is built on meta and shares the
        embedding's table, unless the embedding is on another stage: then it loads that table itself."""
        arch = self.arch
        if not get_pp_group().is_last_rank:
            return PPMissingLayer()
        if not arch.tie_word_embeddings or isinstance(self.model.embed_tokens, PPMissingLayer):
            return ParallelLMHead(arch.vocab_size, arch.hidden_size, prefix=prefix)
        with torch.device("meta"):  # its own table would be discarded at once
            head = ParallelLMHead(arch.vocab_size, arch.hidden_size, prefix=prefix)
        return head.tie_weights(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: IntermediateTensors | None = None
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions [T] -> hidden states [T, hidden] (IntermediateTensors before the last stage)."""
        return self.model(input_ids, positions, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor, sampling_metadata: Any = None) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab], computed in the model's dtype."""
        return self.lm_head.get_logits(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors through STACKED_PARAMS (those of this pipeline stage); returns the loaded names."""
        skipped: tuple[str, ...] = ()
        if self.arch.tie_word_embeddings:
            if self._head_loads_embedding():
                weights = _embedding_as_head(weights)
            else:
                skipped = ("lm_head.weight",)
        return load_mapped_weights(self, skip_missing_layers(self, weights), STACKED_PARAMS, IGNORED_SUFFIXES, skipped)

    def _head_loads_embedding(self) -> bool:
        """A tied head on a stage without the embedding holds its own copy of the embedding's table."""
        return isinstance(self.lm_head, ParallelLMHead) and isinstance(self.model.embed_tokens, PPMissingLayer)


def _embedding_as_head(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint's embedding table as `lm_head.weight` (a saved lm_head.weight is the same table: dropped)."""
    for name, tensor in weights:
        if name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor
        elif name != "lm_head.weight":
            yield name, tensor


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 1-3, SmolLM, TinyLlama, ... (HF architecture LlamaForCausalLM)."""

    arch_config_of = staticmethod(llama_arch_config)


class MistralForCausalLM(DecoderForCausalLM):
    """Mistral (HF architecture MistralForCausalLM); `sliding_window` on every layer."""

    arch_config_of = staticmethod(mistral_arch_config)


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 / Qwen2.5 (HF architecture Qwen2ForCausalLM); windowed layers with `use_sliding_window`."""

    arch_config_of = staticmethod(qwen2_arch_config)


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 dense (HF architecture Qwen3ForCausalLM)."""

    arch_config_of = staticmethod(qwen3_arch_config)
