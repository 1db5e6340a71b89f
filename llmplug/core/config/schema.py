"""The config schema: EngineConfig and its sections (pydantic v2), each field with its default and help."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# what model.quantization means for dense and GGUF weights (llmplug.layers.quantization); any other value names a
# quantized checkpoint's method, an `llmplug.quantization` plugin
QUANTIZATION_MODES = ("none", "auto", "int4", "int8")


class _Section(BaseModel):
    """Base of all config sections: unknown keys are errors, assignment is validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# a bool field whose default is decided at engine start (the platform's check_and_update_config)
BoolOrAuto = bool | Literal["auto"]


class ModelConfig(_Section):
    """Which model to run and how to interpret it."""

    model: str = Field(DEFAULT_MODEL, description="Model directory, .gguf file or short name of an embedded model.")
    tokenizer: str | None = Field(None, description="Tokenizer directory; default: the model's own.")
    revision: str | None = Field(
        None, description="Hub revision (branch, tag or commit) of a model given as `org/name`; default: main."
    )
    hf_file: str | None = Field(
        None,
        description="The .gguf file to take from a hub repo given as `org/name` (llama.cpp's --hf-file); "
        "`org/name:Q4_K_M` picks one by its quantization name.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype; auto: the platform's preferred dtype."
    )
    max_model_len: int | None = Field(
        None,
        gt=0,
        description="Context length; default: the model's (max_position_embeddings, n_positions, max_seq_len, ...; "
        "2048 if its config names none). Past the length the model's config names, a ConfigError unless "
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (vLLM's switch, for models that extrapolate).",
    )
    seed: int = Field(0, description="Seed of the engine's random state (per-request seeds override).")
    skip_tokenizer_init: bool = Field(False, description="Do not load a tokenizer; prompts must be token ids.")
    trust_remote_code: bool = Field(False, description="Allow transformers to run code from the model directory.")
    hf_overrides: dict[str, Any] = Field(default_factory=dict, description="Values that override the HF config.")
    enable_prompt_embeds: bool = Field(
        False, description="Accept prompts given as embeddings (`prompt_embeds`) instead of tokens."
    )
    limit_mm_per_prompt: dict[str, int] = Field(
        default_factory=dict,
        description="Most items of each modality in one prompt of a multimodal model, e.g. '{\"image\": 2}' "
        "(--limit-mm-per-prompt); a modality not named allows 1 (vLLM's default); 0 refuses that modality.",
    )
    mm_processor_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments for the multimodal model's HF processor call, e.g. '{\"do_pan_and_scan\": true}' "
        "(--mm-processor-kwargs; Gemma 3's pan-and-scan crops); a request's own `mm_processor_kwargs` override them. "
        "A name the processor does not take is an error at start.",
    )
    # "auto" by default: a file whose tensors are exactly int4 decodes through int4 copies (prompts dense, batch
    # invariant); any other checkpoint stays dense, what the parity tests hold against transformers
    quantization: str = Field(
        "auto",
        description=(
            "A quantized checkpoint (config.json's quantization_config.quant_method: gptq, awq, "
            "compressed-tensors, fp8, ...) is computed with its method, found in the llmplug.quantization plugin "
            "group; naming one here insists on it (a name that is neither a mode nor an installed method is an "
            "error listing both). For dense and GGUF weights, weight-only int4 copies next to the "
            "dense weights: auto (default): where the checkpoint's own blocks are "
            "exactly int4 (GGUF Q4_0, Q4_1, Q8_0) and an int4 kernel beats the dense weight for the model dtype "
            "(bfloat16; float32 in the batch-invariant mode, whose kernel is llmplug's own); int4: every linear layer, "
            "quantizing the rest (group 32); none: dense only. In the batch-invariant mode an auto int4 layer "
            "computes the generated tokens with its int4 copy and the prompts densely (int4: every token); "
            "without it, at most 8 tokens per call in int4 (decode) and more densely. int8: every linear layer and the LM head with int8 weights (per output channel) "
            "and int8 activations (per token), an exact int32 matmul: faster for batches and prefill where the "
            "CPU's bf16 is slow, for one stream everywhere measured; batch invariant. See docs/quantization.md."
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
            "float32, int4 copies chosen by a token's position: generated tokens int4, prompts dense). Same engine "
            "config, platform and thread count; see docs/determinism.md. auto: on where the platform, attention "
            "backend and model implement it and nothing asked for a per-batch kernel (quantization other than "
            "int4, no device.compile, generate runner)."
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

    @field_validator("limit_mm_per_prompt", "mm_processor_kwargs", mode="before")
    @classmethod
    def _mapping_from_json(cls, value: Any) -> Any:
        """The flag's value is JSON text ('{"image": 2}', as vLLM's); a file or kwargs give a mapping."""
        if not isinstance(value, str):
            return value
        import json

        try:
            return json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"not JSON ({error}); write it as '{{\"image\": 2}}'") from None

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _non_negative_limits(cls, limits: dict[str, int]) -> dict[str, int]:
        bad = {k: v for k, v in limits.items() if v < 0}
        if bad:
            raise ValueError(f"limits must be 0 or more, got {bad}")
        return limits

    @field_validator("quantization")
    @classmethod
    def _known_quantization(cls, name: str) -> str:
        """A runtime mode or the name of an installed `llmplug.quantization` method (its metadata read only when the
        name is not a mode; whether the allow-list lets the engine use it is the engine's registry's to say)."""
        if name in QUANTIZATION_MODES:
            return name
        from llmplug.core.plugins import PluginRegistry  # lazy: plugins imports the config

        methods = PluginRegistry().names("llmplug.quantization")  # metadata only, nothing imported
        if name not in methods:
            raise ValueError(
                f"{name!r} is neither a mode ({', '.join(QUANTIZATION_MODES)}) nor an installed llmplug.quantization "
                f"method ({', '.join(methods) or 'none installed'}); a quantized checkpoint's method is read from its "
                "config.json, so auto or none is usually right"
            )
        return name

    # whether batch_invariant was asked for (true) rather than resolved from auto; set at engine start
    # (engine/batch_invariance.py), not a setting
    _invariance_asked: bool = PrivateAttr(False)

    @property
    def batch_invariant_on(self) -> bool:
        """Whether the batch-invariant mode runs: set True, or resolved so from auto when the engine started."""
        return self.batch_invariant is True


class CacheConfig(_Section):
    """Paged KV cache."""

    block_size: int = Field(16, gt=0, description="Tokens per KV-cache block.")
    num_blocks: int | None = Field(None, gt=0, description="Exact number of KV blocks (overrides the memory budget).")
    kv_cache_memory: int | None = Field(
        None, gt=0,
        description="KV-cache memory budget in bytes (recurrent state included), allocated at start; never turned "
        "into more blocks than max_num_seqs requests of max_model_len tokens can use. Default on the CPU: a quarter "
        "of the free memory, at most 4 GiB (vLLM's VLLM_CPU_KVCACHE_SPACE).",
    )
    memory_fraction: float = Field(
        0.9, gt=0, le=1,
        description="Fraction of device memory for weights + KV cache when no budget is given (accelerators; unused "
        "on the CPU, which always sets kv_cache_memory).",
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
    max_num_encoder_input_tokens: int | None = Field(
        None, gt=0,
        description="Multimodal models: encoder tokens (image placeholders) one step may compute; default: the step's "
        "token budget. An item larger than it is computed alone in a step.",
    )
    encoder_cache_size: int | None = Field(
        None, gt=0,
        description="Multimodal models: encoder outputs (in placeholder tokens) kept for reuse by later chunks and "
        "requests, least recently used dropped first; default: max_num_encoder_input_tokens.",
    )
    policy: Literal["fcfs", "priority"] = Field("fcfs", description="Order of waiting requests.")

    def token_budget(self, max_model_len: int) -> int:
        """Tokens one step may hold: max_num_batched_tokens, else 2048 with chunked prefill, else max_model_len."""
        return self.max_num_batched_tokens or (2048 if self.enable_chunked_prefill else max_model_len)


class ParallelConfig(_Section):
    """Tensor, pipeline and data parallelism and the executor that runs the workers."""

    tensor_parallel_size: int = Field(1, gt=0, description="Ranks that split each layer.")
    pipeline_parallel_size: int = Field(1, gt=0, description="Ranks that split the layer stack.")
    data_parallel_size: int = Field(
        1,
        gt=0,
        description=(
            "Engine replicas, each in its own process on its own share of the cores (NUMA node by node), behind one "
            "LLM / server that routes requests by load and prefix affinity; each replica runs tensor x pipeline "
            "parallel workers of its own (docs/data_parallel.md)."
        ),
    )
    data_parallel_routing: Literal["prefix_affinity", "least_loaded", "round_robin"] = Field(
        "prefix_affinity",
        description=(
            "How data-parallel replicas get requests: prefix_affinity (to the replica that served the prompt's "
            "prefix, unless it is much busier), least_loaded (fewest waiting + running requests) or round_robin."
        ),
    )
    data_parallel_backend: Literal["mp", "ray"] = Field(
        "mp",
        description=(
            "What runs data-parallel replicas: mp (processes of this machine, each pinned to its share of the "
            "cores) or ray (Ray actors placed by Ray, num_cpus = each replica's threads, on the cluster of "
            "ray_address / RAY_ADDRESS, else a new local one)."
        ),
    )
    engine_iteration_timeout_s: float = Field(
        60.0,
        gt=0,
        description=(
            "A data-parallel replica that has requests and sends nothing (no step ends) for this long is declared "
            "hung: killed, its requests failed, restarted (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S)."
        ),
    )
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
            "Run the model's forward through torch.compile (inductor), attention and llmplug's CPU kernels left as "
            "opaque ops (so on the CPU it computes eager's bits); eager where capturing fails. Costs a compile at the "
            "first steps (cached on disk); see docs/benchmarks.md."
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
    max_prompts: int = Field(256, gt=0, description="Most prompts one completions request may give.")
    max_pooling_inputs: int = Field(
        2048, gt=0,
        description="Most inputs one pooling request may give (embeddings, classify, pooling; score pairs and rerank "
                    "documents).",
    )
    max_allowed_token_ids: int = Field(8192, gt=0, description="Longest `allowed_token_ids` list of a request.")
    max_bad_words: int = Field(128, ge=0, description="Most `bad_words` one request may give.")
    max_bad_word_length: int = Field(256, gt=0, description="Longest bad word, in characters.")
    max_tools: int = Field(128, ge=0, description="Most tools one chat or responses request may declare.")
    max_constraint_chars: int = Field(
        65536, gt=0,
        description="Longest structured-output constraint of a request, in characters: a JSON schema as JSON text, a "
                    "regex, a grammar, the choices together, the tools' parameter schemas together.",
    )
    guided_compile_timeout_s: float = Field(
        5.0, gt=0,
        description=(
            "Longest the automaton of one guided-decoding constraint may take to build where a backend builds it "
            "whole (outlines, lm_format_enforcer); measured in a separate process killed past it, and the "
            "request is a 400."
        ),
    )
    guided_max_states: int = Field(
        4096, gt=0,
        description=(
            "Most states that automaton may have (outlines' compile costs milliseconds per state on a large "
            "vocabulary); past it the request is a 400."
        ),
    )


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


class KVTransferConfig(_Section):
    """KV connectors (vLLM's `kv_transfer_config`): KV blocks saved to, and loaded from, other tiers."""

    kv_connector: str | None = Field(
        None,
        description="`llmplug.kv_connectors` name: cpu_offload (host memory), disk_offload (a directory), or a "
        "plugin's; None: no connector.",
    )
    kv_role: Literal["kv_both", "kv_producer", "kv_consumer"] = Field(
        "kv_both", description="kv_producer: only save blocks; kv_consumer: only load them; kv_both: both."
    )
    kv_connector_extra_config: dict[str, Any] = Field(
        default_factory=dict, description="Options of a third-party connector, passed to it as they are."
    )
    kv_offloading_size: float = Field(
        4.0, gt=0, description="cpu_offload: host memory for offloaded blocks, in GiB per worker (LRU)."
    )
    kv_offloading_path: str | None = Field(
        None, description="disk_offload: the directory of block files (created; blocks outlive the engine)."
    )
    kv_offloading_disk_size: float = Field(
        16.0, gt=0, description="disk_offload: disk space for block files, in GiB per worker (LRU)."
    )


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
    kv_transfer_config: KVTransferConfig = Field(default_factory=KVTransferConfig)
    plugins: PluginConfig = Field(default_factory=PluginConfig)
