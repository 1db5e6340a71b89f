"""Model building blocks — part of the versioned plugin API.

Exports the parallel linear layers, vocabulary embedding and LM head, RMSNorm, rotary embedding
(`get_rope`), SiluAndMul, the `Attention` layer with `bind_kv_cache`, the forward context and the
weight-loading helpers (`default_weight_loader`, `load_mapped_weights`).
"""

from llmplug.layers.activation import SiluAndMul
from llmplug.layers.attention import Attention, AttentionBackend, bind_kv_cache
from llmplug.layers.forward_context import CommonAttentionMetadata, forward_context, get_forward_context
from llmplug.layers.layernorm import RMSNorm
from llmplug.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from llmplug.layers.rotary import RotaryCosSin, RotaryEmbedding, get_rope
from llmplug.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from llmplug.layers.weight_utils import default_weight_loader, load_mapped_weights

__all__ = [
    "Attention",
    "AttentionBackend",
    "ColumnParallelLinear",
    "CommonAttentionMetadata",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryCosSin",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "bind_kv_cache",
    "default_weight_loader",
    "forward_context",
    "get_forward_context",
    "get_rope",
    "load_mapped_weights",
]
