"""The contracts plugins implement.

Every protocol is `runtime_checkable`, so the registry can check a loaded plugin object before use.
Members document who calls them, in which process, when, and what they may assume. Optional
behaviour lives in base classes next to the in-tree implementations, never in these protocols.

The plugin API (these protocols, the hook specs, the config schema and the public building blocks
of `llmplug.layers`) is versioned by `PLUGIN_API_VERSION` ("MAJOR.MINOR"). A plugin may declare the
version it targets as a module or class attribute `LLMPLUG_PLUGIN_API_VERSION`; the registry refuses
it when the major differs or its minor is newer than ours.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Protocol, runtime_checkable

if TYPE_CHECKING:  # no heavy imports at run time
    import torch

    from llmplug.core.config import EngineConfig, ModelConfig
    from llmplug.core.params import GuidedDecodingParams

# 1.1: guided decoding (GuidedDecodingBackend, CompiledGrammar, GrammarMatcher)
# 1.2: tool and reasoning parsers
# 1.3: Attention features (sliding_window, logit_softcap, alibi_slopes, use_sinks; alibi_slopes()) and
#      AttentionBackend.supported_features; the generic decoder (llmplug.layers.decoder) and its blocks:
#      LayerNorm / RMSNorm variants (NormConfig), activations by transformers name, position embeddings,
#      q/k norms, CheckpointNames; llmplug.testing
# 1.5: Attention's attention_chunk feature; optional model class method `batch_invariance_gap(hf_config)` (the
#      batch-invariant mode's default, docs/determinism.md); Platform.batch_invariant_kernels
# 1.6: the config's quantization "int8" (llmplug.layers.int8_linear, LinearOptions.int8); Int4LinearMethod.max_tokens
#      may be None (every token count, the batch-invariant mode)
# 1.7: the llmplug.quantization group (QuantizationConfig, QuantizedLinearMethod with row_invariant,
#      llmplug.quantization.building_with / checkpoint_method_for); LinearBase.create_parameter and the generic
#      placement of any tensor of a layer (LinearBase._place with output_dim / input_dim / output_pack, _output_slot,
#      input_split); llmplug.testing.check_quantization_method / save_quantized_checkpoint
# 1.8: the model's optional prompt-embeddings surface: `supports_prompt_embeds`, `embed_input_ids(input_ids)`,
#      `forward(..., inputs_embeds=None)`, `embedding_size`; DecoderArchConfig.embedding_multiplier_in_table
# 1.9: the model's optional multimodal surface: `supports_multimodal`, `embed_multimodal(**item_tensors)` (one
#      [num_placeholder_tokens, embedding_size] tensor per item), `image_token_id`; the config's
#      model.limit_mm_per_prompt, scheduler.max_num_encoder_input_tokens and scheduler.encoder_cache_size
# 1.10: more of the optional multimodal surface: `bidirectional_spans`, multimodal rotary
#      (`get_mrope_input_positions(prompt_token_ids, mm_features) -> (positions [3, P], delta)`, positions [3, T]
#      in forward), deepstack (`deepstack_layers`: wider embed_multimodal rows, forward(..., added_rows=)); the
#      llmplug.kv_connectors group (KVConnector) and llmplug.testing.check_kv_connector
# 1.11: audio clips in the optional multimodal surface: `audio_token_id` (the placeholder token the model folder's
#      HF processor expands each clip into; `embed_multimodal` then gets one clip's feature-extractor tensors);
#      the Whisper encoder block (llmplug.layers.audio)
# 1.12: quantized mixture-of-experts (`QuantizationConfig.experts_method`, `QuantizedExpertsMethod`); a model class's
#      optional `hf_config_class` (its config for a model_type transformers does not know) and
#      `build_hf_processor(model_path, hf_config)` (its own prompt processing); an encoder-decoder model's
#      `num_encoder_tokens` (the encoder states its requests keep in cross blocks); llmplug.testing.check_attention_backend
# 1.13: Int4LinearMethod's rows="generated" (int4 for generated tokens, prompts dense: the default for exact int4
#      checkpoints, batch invariant) and the step's `GeneratedRows` in the forward context (current_generated_rows)
PLUGIN_API_VERSION = "1.13"


@runtime_checkable
class VllmModel(Protocol):
    """A model architecture: built by the model loader inside each worker process.

    `__init__(*, config, prefix="")` receives the Hugging Face `PretrainedConfig` of the checkpoint
    (models convert it once into their own typed, frozen config) and the module-name prefix. It runs
    under the target dtype and device as torch defaults. Attention metadata (block tables, slot
    mapping) reaches the `llmplug.layers.Attention` layers through the forward context set by the
    model runner, never through `forward`'s arguments.
    """

    def forward(self, input_ids: "torch.Tensor", positions: "torch.Tensor") -> "torch.Tensor":
        """Called by the model runner once per step with the flattened batch.

        input_ids and positions: [num_tokens]; returns hidden states [num_tokens, hidden_size].
        A model that sets `supports_pipeline_parallel = True` also takes `intermediate_tensors` (None on
        the first pipeline stage) and returns `llmplug.layers.pipeline.IntermediateTensors` on every
        stage but the last; see that module.

        Optional class method `batch_invariance_gap(hf_config) -> str | None`, asked in the engine
        process before workers start: None when the model's logits for a row never depend on the other
        rows of the step (llmplug's layers give that); else why not. A model without it runs with the
        batch-invariant mode off by default (docs/determinism.md).

        Prompt embeddings (optional; only an engine started with model.enable_prompt_embeds asks, and it refuses
        a model without them): a model that sets `supports_prompt_embeds = True` has `embed_input_ids(input_ids)`
        ([num_tokens] -> [num_tokens, embedding_size]: what transformers' `get_input_embeddings()` returns, before
        any scaling transformers' forward applies to given `inputs_embeds`) and takes `forward(..., inputs_embeds=)`
        ([num_tokens, embedding_size], in place of the ids' embeddings, in the model's dtype; `input_ids` then
        still holds the step's ids, placeholders at embedded positions). `embedding_size` (default: the HF
        config's hidden_size) is the width users' embeddings are checked against. The runner calls
        `embed_input_ids` in the worker, inside the step's forward context, only in steps with embedded rows.

        Optional class attribute `bidirectional_spans` ("image" or "prompt"; default None): runs of prompt tokens
        that attend to one another both ways at prefill (docs/multimodal.md, Bidirectional spans).
        """
        ...

    def load_weights(self, weights: Iterable[tuple[str, "torch.Tensor"]]) -> set[str]:
        """Called by the loader with (checkpoint name, tensor) pairs; returns the parameter names loaded."""
        ...


@runtime_checkable
class VllmModelForTextGeneration(VllmModel, Protocol):
    """A model that produces next-token logits."""

    def compute_logits(self, hidden_states: "torch.Tensor", sampling_metadata: Any = None) -> "torch.Tensor":
        """Called by the model runner with the hidden states of the positions that sample only.

        hidden_states: [num_sampled, hidden_size]; returns float logits [num_sampled, vocab_size].
        A model may also define `sample(logits, sampling_metadata)` to replace the engine's sampler.
        """
        ...


@runtime_checkable
class VllmModelForPooling(VllmModel, Protocol):
    """A model that turns hidden states into embeddings, rewards or class scores."""

    def pooler(self, hidden_states: "torch.Tensor", pooling_metadata: Any) -> Any:
        """Called by the model runner after `forward` for requests that finished their prompt."""
        ...


@runtime_checkable
class Communicator(Protocol):
    """Collective operations within one process group (one per TP/PP/DP group, per worker)."""

    rank_in_group: int
    world_size: int

    def all_reduce(self, tensor: "torch.Tensor") -> "torch.Tensor":
        """Sum across the group; every rank gets the result. Called by row-parallel layers."""
        ...

    def all_gather(self, tensor: "torch.Tensor", dim: int = -1) -> "torch.Tensor":
        """Concatenate every rank's tensor along `dim`."""
        ...

    def reduce_scatter(self, tensor: "torch.Tensor", dim: int = -1) -> "torch.Tensor":
        """Sum across the group, then keep this rank's slice along `dim`."""
        ...

    def gather(self, tensor: "torch.Tensor", dst: int = 0, dim: int = -1) -> "torch.Tensor | None":
        """Concatenate along `dim` on rank `dst` only (others get None). Used for vocab-parallel logits."""
        ...

    def broadcast(self, tensor: "torch.Tensor", src: int = 0) -> "torch.Tensor":
        """Copy rank `src`'s tensor to every rank."""
        ...

    def send(self, tensor: "torch.Tensor", dst: int) -> None:
        """Point-to-point send (pipeline stages)."""
        ...

    def recv(self, size: Any, dtype: Any, src: int) -> "torch.Tensor":
        """Point-to-point receive of a tensor of the given size and dtype."""
        ...

    def barrier(self) -> None:
        """Wait for every rank (on the CPU group, never a device barrier)."""
        ...


@runtime_checkable
class ModelLoader(Protocol):
    """Reads weights in one format (`load.format`) and builds the model in each worker process.

    Constructed with the `LoadConfig`. The engine process calls `download_model` once before workers
    start; each worker calls `load_model`. Loaders may also override the base class's
    `load_hf_config` / `load_tokenizer` when the format carries its own config and tokenizer (GGUF).
    """

    def download_model(self, model_config: "ModelConfig") -> None:
        """Make the weights available locally (or fail with a clear error); no-op for local paths."""
        ...

    def load_model(self, config: "EngineConfig") -> VllmModel:
        """Build the model for `config` on this worker's device with its weights loaded; eval mode."""
        ...


@runtime_checkable
class LogitsProcessor(Protocol):
    """Changes one request's next-token logits before sampling.

    Called by the engine's sampler in the worker once per generated token, with the request's output
    token ids so far and its logits row [vocab_size]; returns the new row (may modify in place).
    Guided decoding does not go through this per-row call: its matchers fill one token bitmask for
    the whole batch (`GrammarMatcher.fill_bitmask`), which the sampler applies in one vectorized step.
    """

    def __call__(self, output_token_ids: list[int], logits: "torch.Tensor") -> "torch.Tensor": ...


@runtime_checkable
class GrammarMatcher(Protocol):
    """One request's position in its compiled grammar (guided decoding).

    Made by `CompiledGrammar.matcher()` in the engine process when the request's grammar is ready;
    then called by the engine's step loop only (one thread), once per step the request samples in.
    """

    def accept_token(self, token_id: int) -> bool:
        """Advance by a sampled token; False (state unchanged) when the grammar forbids it."""
        ...

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        """Write the tokens allowed next into row `row` of bitmask [B, ceil(V / 32)] int32 (CPU).

        Bit j of word i stands for token 32 * i + j (1: allowed), the layout xgrammar, llguidance and
        outlines-core share; the sampler applies the whole batch's bitmask in one vectorized step.
        """
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (for callers that speculate)."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar is complete and accepted the end-of-sequence token: the request is done."""
        ...


@runtime_checkable
class CompiledGrammar(Protocol):
    """A constraint compiled for one tokenizer; shared (read-only) by every request with that constraint."""

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (one per request)."""
        ...


@runtime_checkable
class GuidedDecodingBackend(Protocol):
    """A guided-decoding engine (`llmplug.guided_decoding`): constraints in, compiled grammars out.

    Constructed once per engine, in the engine process, as `Backend(tokenizer, vocab_size,
    eos_token_id)`: the model's own tokenizer, the width of the model's logits and the token that ends
    a sequence. Building the backend's tokenizer data is costly, so it happens once, on first use, and
    is reused by every compile. `unsupported_feature` runs on the thread that adds a request (keep it
    cheap); `validate` and `compile` run in a thread pool, off the step loop and the event loop. A backend
    that builds a whole automaton whose size can run away may name, as `automaton_states`, a module-level
    function of the constraint that builds it with light imports and returns its number of states: the
    engine runs it first in a separate process under a time budget (`decoding.guided_compile_timeout_s`).
    Constraints arrive as `GuidedDecodingParams` whose `whitespace_flexible` is resolved to a bool.
    """

    name: str

    def unsupported_feature(self, constraint: "GuidedDecodingParams") -> str | None:
        """The feature of `constraint` this backend cannot handle ("grammar (Lark)", ...), or None."""
        ...

    def validate(self, constraint: "GuidedDecodingParams") -> None:
        """Raise InvalidRequestError naming what is wrong with `constraint` (bad schema, regex, grammar)."""
        ...

    def compile(self, constraint: "GuidedDecodingParams") -> CompiledGrammar:
        """Compile `constraint` against the tokenizer (called from a worker thread)."""
        ...


@runtime_checkable
class Platform(Protocol):
    """A kind of hardware. One class per platform; the engine asks it about capabilities, never identity.

    Called in the engine process while resolving the config (is_available, priority,
    check_and_update_config) and in each worker (device, memory, seeding, attention backend,
    communicator).
    """

    name: str  # the registry name: "cpu", "cuda", ...
    device_type: str  # torch device type: "cpu", "cuda", "xla", "xpu"
    priority: int  # `platform: auto` picks the available platform with the highest priority
    dispatch_key: str
    supported_dtypes: tuple[str, ...]  # "float32", "bfloat16", "float16"
    distributed_backend: str  # torch.distributed backend name: "gloo", "nccl", ...

    @classmethod
    def is_available(cls) -> bool:
        """True when this process can use the hardware (no side effects, cheap)."""
        ...

    @classmethod
    def check_and_update_config(cls, config: "EngineConfig") -> None:
        """Validate and fill platform-dependent config (dtype, attention backend) before the engine starts."""
        ...

    @classmethod
    def get_attention_backend(cls, requested: str | None, head_dim: int, dtype: Any) -> str:
        """The `llmplug.attention` entry-point name to use."""
        ...

    @classmethod
    def get_communicator(cls) -> str:
        """The `llmplug.communicators` name of the collectives of device groups on this platform.

        Called in each worker of a multi-rank engine while it joins the process groups.
        """
        ...

    @classmethod
    def total_memory(cls, device_id: int = 0) -> int:
        """Total memory of the device in bytes."""
        ...

    @classmethod
    def available_memory(cls, device_id: int = 0) -> int:
        """Free memory of the device in bytes."""
        ...

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        """Seed python, numpy and torch (and the device) RNGs."""
        ...

    @classmethod
    def device_count(cls) -> int:
        """Number of devices this process sees."""
        ...
