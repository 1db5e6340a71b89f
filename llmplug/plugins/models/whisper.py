"""Whisper (`WhisperForConditionalGeneration`): speech recognition as encoder-decoder generation.

The encoder is `llmplug.layers.audio.WhisperEncoder` (one 30 s window of log-mel frames -> 1500 states). The
decoder is the generic decoder (`DecoderModel`) with Whisper's data — LayerNorm with a bias before each sublayer,
learned positions (`max_target_positions`), q/v/out biases and a bias-free k, a GELU MLP with biases, a final
LayerNorm, the output projection tied to the token embeddings — whose layers add a cross-attention sublayer over
the request's encoder states between self-attention and the MLP (`WhisperDecoderLayer`). Self-attention is paged
like any decoder's; the cross-attention keys and values are computed once per request (`encode`) into the request's
cross blocks of each layer's self-attention cache, and read from there by each step
(`layers/attention/cross_attention.py`). Every size (tiny ... large-v3 with 128 mel bins, turbo's 4
decoder layers, Distil-Whisper's 2) is read from the config.
"""

from __future__ import annotations

from typing import ClassVar, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.layers.attention.cross_attention import CrossAttention, CrossAttentionBatch, CrossBlocks
from llmplug.layers.audio import WhisperEncoder, whisper_encoder_config, with_zero_k_bias
from llmplug.layers.checkpoint_names import CheckpointNames, HeadLayout
from llmplug.layers.decoder import DecoderArchConfig, LayerConfig, MLPConfig
from llmplug.layers.decoder.layer import DecoderLayer
from llmplug.layers.decoder.model import DecoderModel, stacked_params
from llmplug.layers.layernorm import NormConfig, make_norm
from llmplug.layers.vocab_embedding import ParallelLMHead
from llmplug.layers.weight_utils import load_mapped_weights

__all__ = ["WhisperForConditionalGeneration", "whisper_decoder_arch"]

# transformers' decoder names -> the generic decoder's (the encoder's are WhisperEncoder's own)
DECODER_NAMES = CheckpointNames(
    prefixes={"model.decoder.layer_norm": "model.decoder.norm", "proj_out": "lm_head"},
    renames={
        "self_attn.out_proj": "self_attn.o_proj",
        "self_attn_layer_norm": "input_layernorm",
        "final_layer_norm": "post_attention_layernorm",
        "encoder_attn.q_proj": "encoder_attn.query",
        "encoder_attn.k_proj": "encoder_attn.key",
        "encoder_attn.v_proj": "encoder_attn.value",
        "fc1": "mlp.up_proj",
        "fc2": "mlp.down_proj",
    },
)
ENCODER_PREFIX = "model.encoder."


def whisper_decoder_arch(hf: PretrainedConfig) -> DecoderArchConfig:
    """The decoder of a WhisperConfig as generic-decoder data."""
    heads = hf.decoder_attention_heads
    return DecoderArchConfig(
        architecture="WhisperForConditionalGeneration",
        vocab_size=hf.vocab_size,
        hidden_size=hf.d_model,
        intermediate_size=hf.decoder_ffn_dim,
        num_layers=hf.decoder_layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hf.d_model // heads,
        layers=tuple(LayerConfig(rope=None) for _ in range(hf.decoder_layers)),
        norm=NormConfig("layer", 1e-5, bias=True),  # transformers' nn.LayerNorm default eps
        mlp=MLPConfig(activation=hf.activation_function, gated=False, bias=True),
        qkv_bias=True,  # k's part is zero (with_zero_k_bias)
        o_proj_bias=True,
        absolute_positions="learned",
        max_position=hf.max_target_positions,
        tie_word_embeddings=True,
    )


class WhisperDecoderLayer(DecoderLayer):
    """x + self_attn(norm(x)), then + cross_attn(norm'(x)) over the request's encoder states, then + mlp(norm''(x));
    the cross-attention's keys and values are kept in the self-attention's cache (the same heads and head_dim)."""

    def __init__(self, arch: DecoderArchConfig, layer: LayerConfig, prefix: str = "") -> None:
        super().__init__(arch, layer, prefix)
        self.encoder_attn_layer_norm = make_norm(arch.norm, arch.hidden_size)
        self.encoder_attn = CrossAttention(arch.hidden_size, arch.num_heads, f"{prefix}.encoder_attn")

    def forward(  # type: ignore[override]
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cross: CrossAttentionBatch | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sublayer output, residual stream) -> the same for this layer (residual None at the first layer)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden, residual = self.encoder_attn_layer_norm(self.self_attn(hidden, None), residual)
        cross_out = self.encoder_attn(hidden, cross, self.self_attn.attn)  # its K/V in self_attn's cache
        hidden, residual = self.post_attention_layernorm(cross_out, residual)
        return self.mlp(hidden), residual


class WhisperDecoder(DecoderModel):
    """The generic decoder with Whisper's layers: each step also takes the requests' cross-attention inputs."""

    layer_class = WhisperDecoderLayer

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, positions: torch.Tensor, cross_attention: CrossAttentionBatch | None
    ) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden]."""
        hidden, residual = self.embed(input_ids, positions), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cross_attention)
        return self._output(hidden, residual)


class WhisperModel(nn.Module):
    """The encoder and the decoder, under transformers' names (`model.encoder`, `model.decoder`)."""

    def __init__(self, config: PretrainedConfig, arch: DecoderArchConfig, prefix: str) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(whisper_encoder_config(config), f"{prefix}.encoder")
        self.decoder = WhisperDecoder(arch, f"{prefix}.decoder")


class WhisperForConditionalGeneration(nn.Module):
    """Whisper: audio features in through `encode` (once per request), text out of the decoder step by step."""

    is_encoder_decoder: ClassVar[bool] = True  # the engine's encoder-decoder path (engine/encoder_decoder.py)
    supports_pipeline_parallel: ClassVar[bool] = False
    supports_tensor_parallel: ClassVar[bool] = True  # heads shard, cross blocks too (each rank caches its heads)
    supports_prompt_embeds: ClassVar[bool] = False

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.arch = whisper_decoder_arch(config)
        self.model = WhisperModel(config, self.arch, f"{prefix}model" if not prefix else f"{prefix}.model")
        with torch.device("meta"):  # tied: its table is the token embeddings'
            head = ParallelLMHead(self.arch.vocab_size, self.arch.hidden_size, False, "lm_head")
        self.lm_head = head.tie_weights(self.model.decoder.embed_tokens)
        self.max_positions = config.max_target_positions  # the decoder's context (the worker's model_info)
        self.num_mel_bins = config.num_mel_bins
        self.num_encoder_tokens = config.max_source_positions  # the encoder's states per window (cross blocks)

    def encode(self, input_features: torch.Tensor, blocks: CrossBlocks) -> None:
        """input_features [1, n_mels, frames] -> every decoder layer's cross-attention keys and values, written into
        the request's cross blocks of that layer's cache: one request's encoder, run once."""
        states = self.model.encoder(input_features)[0]  # [S, d_model]
        for layer in self.model.decoder.layers:
            layer.encoder_attn.store(states, layer.self_attn.attn, blocks)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cross_attention: CrossAttentionBatch | None = None
    ) -> torch.Tensor:
        """input_ids, positions [T] -> the decoder's hidden states [T, d_model] (cross_attention None: no request has
        encoder states, the engine's memory-profiling step)."""
        return self.model.decoder(input_ids, positions, cross_attention)

    def compute_logits(self, hidden_states: torch.Tensor, sampling_metadata: object = None) -> torch.Tensor:
        """[N, d_model] -> float32 logits [N, vocab]."""
        return self.lm_head.get_logits(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a transformers Whisper checkpoint (`model.encoder.*`, `model.decoder.*`, a tied `proj_out`);
        returns the loaded parameter names."""
        encoder: list[tuple[str, torch.Tensor]] = []
        decoder: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            if name.startswith(ENCODER_PREFIX):
                encoder.append((name[len(ENCODER_PREFIX):], tensor))
            else:
                decoder.append((name, tensor))
        loaded = {f"{ENCODER_PREFIX}{name}" for name in self.model.encoder.load_weights(encoder)}
        arch = self.arch
        heads = HeadLayout(arch.num_heads, arch.num_kv_heads, arch.head_dim)
        translated = with_zero_k_bias(DECODER_NAMES.translate(decoder, heads))
        return loaded | load_mapped_weights(self, translated, stacked_params(arch), skipped_names=("lm_head.weight",))
