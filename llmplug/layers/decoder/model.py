"""The generic decoder-only model and its causal-LM head, built from a `DecoderArchConfig`.

A family plugin subclasses `DecoderForCausalLM` and sets two class attributes: `arch_config_of`
(its HF config -> DecoderArchConfig adapter) and `checkpoint_names` (how its checkpoint names map
onto the parameters here). Parameter names follow transformers' Llama (`model.embed_tokens`,
`model.layers.N.self_attn.qkv_proj`, `model.norm`, `lm_head`), plus `model.embed_positions`,
`model.embed_token_types`, `model.embed_norm`, `model.project_in` / `model.project_out`,
`model.head_transform` and the norms of `DecoderLayer`.

Under pipeline parallelism a stage holds only its layers (the embeddings on the first stage, the
final norm and the head on the last); the others are `PPMissingLayer` placeholders.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from llmplug.communicators.parallel_state import get_pp_group
from llmplug.layers.activation import Activation
from llmplug.layers.checkpoint_names import CheckpointNames, HeadLayout
from llmplug.layers.decoder.arch import RECURRENT_MIXERS, DecoderArchConfig, RopeConfig
from llmplug.layers.decoder.fast_path import DecoderFastPath, LayerRows
from llmplug.layers.decoder.layer import DecoderLayer
from llmplug.layers.layernorm import make_norm
from llmplug.layers.mrope import get_mrope
from llmplug.layers.linear import ReplicatedLinear
from llmplug.layers.pipeline import IntermediateTensors, PPMissingLayer, pp_layer_range, skip_missing_layers
from llmplug.layers.position_embedding import LearnedPositionEmbedding, SinusoidalPositionEmbedding
from llmplug.layers.rotary import RotaryEmbedding, get_rope
from llmplug.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from llmplug.layers.moe.experts import EXPERT_PARAMS
from llmplug.layers.weight_utils import StackedParamsMap, load_mapped_weights

__all__ = ["DecoderForCausalLM", "DecoderModel", "LayerRows", "stacked_params"]

# rotary tables that old checkpoints saved as buffers; ours are recomputed from the config
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def stacked_params(arch: DecoderArchConfig) -> StackedParamsMap:
    """Checkpoint module -> (our fused module, shard): q/k/v into qkv_proj (not with latent attention, whose
    q_proj is its own), gate/up into gate_up_proj, separately stored delta-net convs into conv1d."""
    stacked: dict[str, tuple[str, str | int]] = {}
    if arch.mla is None:
        stacked |= {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
    if arch.mlp.gated:
        stacked |= {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    if arch.gated_delta_net is not None and arch.gated_delta_net.projection_layout == "separate":
        stacked |= {f"{x}_conv1d": ("conv1d", i) for i, x in enumerate("qkv")}  # the delta net's q, k, v convs
    return stacked


def _optional(build: bool, make: Callable[[], nn.Module]) -> nn.Module:
    return make() if build else PPMissingLayer()


class DecoderModel(nn.Module):
    """Embeddings, the decoder layers and the final norm; one rotary table per distinct rope of the layers."""

    layer_class: ClassVar[type[DecoderLayer]] = DecoderLayer  # a subclass's layers (Whisper's add cross-attention)

    def __init__(self, arch: DecoderArchConfig, prefix: str = "") -> None:
        super().__init__()
        pp = get_pp_group()
        self.arch, self.is_last_stage = arch, pp.is_last_rank
        self.start_layer, self.end_layer = pp_layer_range(arch.num_layers)
        first, embedding_dim = pp.is_first_rank, arch.embedding_dim or arch.hidden_size
        self.embed_tokens = _optional(
            first, lambda: VocabParallelEmbedding(arch.vocab_size, embedding_dim, _join(prefix, "embed_tokens"))
        )
        if arch.embedding_dim:  # replicated: two small [embedding_dim, hidden] projections
            project = lambda i, o, name: ReplicatedLinear(i, o, False, _join(prefix, name))  # noqa: E731
            self.project_in = _optional(first, lambda: project(embedding_dim, arch.hidden_size, "project_in"))
            self.project_out = _optional(
                self.is_last_stage, lambda: project(arch.hidden_size, embedding_dim, "project_out")
            )
        if arch.absolute_positions:
            self.embed_positions = _optional(first, lambda: self._position_embedding(_join(prefix, "embed_positions")))
        if arch.type_vocab_size:
            types = lambda: VocabParallelEmbedding(  # noqa: E731
                arch.type_vocab_size, arch.hidden_size, _join(prefix, "embed_token_types")
            )
            self.embed_token_types = _optional(first, types)
        if arch.embedding_norm:
            self.embed_norm = _optional(first, lambda: make_norm(arch.norm, arch.hidden_size))
        on_stage = range(self.start_layer, self.end_layer)
        self.layers = nn.ModuleList(
            type(self).layer_class(arch, layer, _join(prefix, f"layers.{i}")) if i in on_stage else PPMissingLayer()
            for i, layer in enumerate(arch.layers)
        )
        self.norm = _optional(self.is_last_stage and arch.final_norm, lambda: make_norm(arch.norm, arch.hidden_size))
        if arch.head_transform:
            transform = lambda: HeadTransform(arch, _join(prefix, "head_transform"))  # noqa: E731
            self.head_transform = _optional(self.is_last_stage, transform)
        self.ropes: list[RopeConfig] = []  # distinct ropes, in the order of rotary_embs
        self.rotary_embs = nn.ModuleList()
        self.rope_of_layer = [self._rope_index(layer.rope) for layer in arch.layers]  # index into ropes, or None
        on_stage_layers = slice(self.start_layer, self.end_layer)
        # the stage's layers; plain ones as straight-line kernel calls on the CPU (decoder/fast_path.py)
        self.run_layers = DecoderFastPath(list(self.layers[on_stage_layers]), self.rope_of_layer[on_stage_layers])

    def _position_embedding(self, prefix: str) -> nn.Module:
        arch = self.arch
        if arch.absolute_positions == "learned":
            return LearnedPositionEmbedding(arch.max_position, arch.hidden_size, arch.position_offset, prefix)
        paper = arch.absolute_positions == "sinusoidal_paper"
        return SinusoidalPositionEmbedding(arch.max_position, arch.hidden_size, arch.position_offset, paper)

    def _rope_index(self, rope: RopeConfig | None) -> int | None:
        """The index of `rope`'s table, built the first time a layer uses it."""
        if rope is None:
            return None
        if rope not in self.ropes:
            self.ropes.append(rope)
            self.rotary_embs.append(self._rotary(rope))
        return self.ropes.index(rope)

    def _rotary(self, rope: RopeConfig) -> RotaryEmbedding:
        dim = self.arch.rotary_dim(rope)
        if rope.mrope_section is not None:  # positions come as [3, T] (or [T] without images)
            return get_mrope(
                self.arch.head_dim, dim, rope.max_position, rope.theta, rope.mrope_section, rope.scaling,
                rope.is_neox_style, rope.mrope_interleaved,
            )
        return get_rope(
            self.arch.head_dim, dim, rope.max_position, rope.theta, rope.scaling, rope.is_neox_style, rope.inverted
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> token embeddings [T, embedding_dim]: what transformers' `get_input_embeddings()` gives
        (scaled where its embedding module scales), and what prompt embeddings stand in for."""
        hidden = self.embed_tokens(input_ids)
        return self._scale_embeddings(hidden) if self.arch.embedding_multiplier_in_table else hidden

    def _scale_embeddings(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.arch.embedding_multiplier == 1.0:
            return hidden
        # in the activations' dtype, as transformers rounds it (Gemma)
        return hidden * torch.tensor(self.arch.embedding_multiplier, dtype=hidden.dtype)

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (, token_type_ids: all 0 when None) [T] -> the first layer's input [T, hidden];
        `inputs_embeds` [T, embedding_dim], when given, replaces `embed_input_ids(input_ids)`."""
        arch = self.arch
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds  # [T, embedding_dim]
        if not arch.embedding_multiplier_in_table:
            hidden = self._scale_embeddings(hidden)
        if arch.embedding_dim:
            hidden = self.project_in(hidden)  # [T, hidden]
        if arch.type_vocab_size:
            types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            hidden = hidden + self.embed_token_types(types)
        if arch.absolute_positions:
            hidden = hidden + self.embed_positions(positions).to(hidden.dtype)
        return self.embed_norm(hidden) if arch.embedding_norm else hidden

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        added_rows: LayerRows | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions [T] (inputs_embeds [T, embedding_dim] in place of the ids' embeddings, when given)
        -> hidden states [T, hidden] (IntermediateTensors before the last stage); `added_rows` (Qwen3-VL's deepstack
        image rows) are added to the stream after the model's first layers."""
        if intermediate_tensors is None:
            hidden, residual = self.embed(input_ids, positions, token_type_ids, inputs_embeds), None
        else:  # no residual: the previous stage ended on a post-LN layer's normalized stream
            hidden, residual = intermediate_tensors["hidden_states"], intermediate_tensors.tensors.get("residual")
        ropes = [emb.cos_sin(positions, hidden.dtype) for emb in self.rotary_embs]  # once per step for all layers
        query_scale = self._query_scale(positions, hidden.dtype)
        if added_rows is not None and self.start_layer:  # counted from this stage's first layer
            added_rows = LayerRows(added_rows.rows, added_rows.values[self.start_layer :])
        hidden, residual = self.run_layers(hidden, residual, ropes, query_scale, added_rows)
        if not self.is_last_stage:
            tensors = {"hidden_states": hidden} | ({} if residual is None else {"residual": residual})
            return IntermediateTensors(tensors)
        return self._output(hidden, residual)

    def _query_scale(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """[T, 1, 1] query multipliers of `query_position_scale` (None when the model has none)."""
        if self.arch.query_position_scale is None:
            return None
        beta, length = self.arch.query_position_scale
        shifted = positions + self.arch.query_scale_offset
        scale = 1 + beta * torch.log(1 + torch.floor(shifted / length))  # as transformers rounds it
        return scale.to(dtype)[:, None, None]

    def _output(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last layer's (output, residual) -> [T, hidden] (or [T, embedding_dim]) for the head."""
        if self.arch.final_norm:
            hidden = self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]
        elif residual is not None:
            hidden = hidden + residual
        if self.arch.head_transform:
            hidden = self.head_transform(hidden)
        return self.project_out(hidden) if self.arch.embedding_dim else hidden


class HeadTransform(nn.Module):
    """norm(act(dense(x))) before the LM head; every rank holds it whole (one [hidden, hidden] matrix)."""

    def __init__(self, arch: DecoderArchConfig, prefix: str = "") -> None:
        super().__init__()
        config = arch.head_transform
        self.dense = ReplicatedLinear(arch.hidden_size, arch.hidden_size, config.bias, _join(prefix, "dense"))
        self.act = Activation(config.activation)
        self.norm = make_norm(arch.norm, arch.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        return self.norm(self.act(self.dense(hidden)))


class DecoderForCausalLM(nn.Module):
    """A causal LM over `DecoderModel`; a family sets `arch_config_of` and, if its names differ, `checkpoint_names`."""

    arch_config_of: ClassVar[Callable[[PretrainedConfig], DecoderArchConfig]]
    checkpoint_names: ClassVar[CheckpointNames] = CheckpointNames()  # default: transformers' Llama names
    # when the checkpoint layout depends on the config (Falcon's q/k/v), this replaces checkpoint_names
    checkpoint_names_of: ClassVar[Callable[[PretrainedConfig], CheckpointNames] | None] = None
    supports_pipeline_parallel: ClassVar[bool] = True
    supports_tensor_parallel: ClassVar[bool] = True  # every weight is a parallel layer with its own loader
    supports_int4: ClassVar[bool] = True  # its linear layers and head compute through quant_method
    supports_prompt_embeds: ClassVar[bool] = True  # forward takes inputs_embeds in place of the ids' embeddings

    def __init__(self, *, config: PretrainedConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.arch = type(self).arch_config_of(config)
        self.model = DecoderModel(self.arch, _join(prefix, "model"))
        self.lm_head = self._lm_head(_join(prefix, "lm_head"))

    @classmethod
    def batch_invariance_gap(cls, config: PretrainedConfig) -> str | None:
        """Why the batch-invariant mode cannot hold for this model, or None where it does (docs/determinism.md)."""
        arch = cls.arch_config_of(config)
        kinds = sorted({kind for layer in arch.layers for kind in (layer.mixer, layer.parallel_mixer)} & RECURRENT_MIXERS)
        if kinds:
            return (f"its recurrent layers ({', '.join(kinds)}) scan a prompt in parallel chunks, whose sums depend on "
                    "where prefill chunks start and differ from the step-by-step decode a preempted request recomputes")
        return None

    def _lm_head(self, prefix: str) -> ParallelLMHead | PPMissingLayer:
        """The output projection (last pipeline stage only); a tied one is built on meta and shares the
        embedding's table, unless the embedding is on another stage: then it loads that table itself."""
        arch = self.arch
        if not get_pp_group().is_last_rank:
            return PPMissingLayer()
        width = arch.embedding_dim or arch.hidden_size
        make = lambda: ParallelLMHead(arch.vocab_size, width, arch.lm_head_bias, prefix)  # noqa: E731
        if not arch.tie_word_embeddings or isinstance(self.model.embed_tokens, PPMissingLayer):
            return make()
        if arch.lm_head_bias:  # the bias is its own; only the table is shared
            return make().tie_weights(self.model.embed_tokens)
        with torch.device("meta"):  # its own table would be discarded at once
            head = make()
        return head.tie_weights(self.model.embed_tokens)

    @property
    def embedding_size(self) -> int:
        """Columns of `embed_input_ids`' output (and of prompt embeddings): hidden_size, or the embedding width."""
        return self.arch.embedding_dim or self.arch.hidden_size

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> token embeddings [T, embedding_size] (first pipeline stage only)."""
        return self.model.embed_input_ids(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None, added_rows: LayerRows | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions [T] -> hidden states [T, hidden] (IntermediateTensors before the last stage);
        `inputs_embeds` [T, embedding_size] replaces `embed_input_ids(input_ids)` when given; `added_rows` are
        added to the stream after the first layers (`DecoderModel.forward`)."""
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds=inputs_embeds,
                          added_rows=added_rows)

    def compute_logits(self, hidden_states: torch.Tensor, sampling_metadata: Any = None) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]: the head in the model's dtype, then scale and soft-cap."""
        logits = self.lm_head.get_logits(hidden_states).float()
        if self.arch.logits_multiplier != 1.0:
            logits.mul_(self.arch.logits_multiplier)
        cap = self.arch.final_logit_softcap
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (those of this pipeline stage) through `checkpoint_names` and the stacked
        q/k/v and gate/up map; returns the loaded parameter names."""
        arch, cls = self.arch, type(self)
        names = cls.checkpoint_names if cls.checkpoint_names_of is None else cls.checkpoint_names_of(self.config)
        num_experts = arch.moe.num_experts if arch.moe is not None else 0
        weights = names.translate(weights, HeadLayout(arch.num_heads, arch.num_kv_heads, arch.head_dim, num_experts))
        skipped: tuple[str, ...] = ()
        if arch.tie_word_embeddings:
            if self._head_loads_embedding():
                weights = _embedding_as_head(weights)
            else:
                skipped = ("lm_head.weight",)
        experts = EXPERT_PARAMS if arch.moe is not None else None
        return load_mapped_weights(
            self, skip_missing_layers(self, weights), stacked_params(arch), IGNORED_SUFFIXES, skipped, experts
        )

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
