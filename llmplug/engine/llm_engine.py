"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time."""

from __future__ import annotations

import logging
import time
from typing import Any

from llmplug.core.config import EngineConfig
from llmplug.core.errors import InvalidRequestError
from llmplug.core.outputs import PoolingOutput, PoolingRequestOutput, RequestMetrics, RequestOutput
from llmplug.core.params import PoolingParams, SamplingParams
from llmplug.core.plugins import PluginRegistry
from llmplug.engine.batch_invariance import resolve_batch_invariant
from llmplug.engine.engine_core import EngineCore
from llmplug.engine.guided_decoding import GuidedDecodingManager, RequestGrammar
from llmplug.engine.input_processor import InputProcessor, PromptType, is_embeds_prompt, is_multimodal_prompt
from llmplug.engine.output_processor import EngineCoreOutput, OutputProcessor
from llmplug.engine.pooling import PoolingInfo, resolve_model_kind, resolve_pooling_params
from llmplug.engine.request_limits import RequestLimits
from llmplug.engine.request import Request, RequestStatus
from llmplug.loaders import build_loader
from llmplug.lora.request import LoRARequest

logger = logging.getLogger(__name__)


def prepare_config(config: EngineConfig, registry: PluginRegistry) -> EngineConfig:
    """Resolve what the workers must agree on: the model path, the platform's dtype and backends."""
    from llmplug.loaders import resolve_load_format
    from llmplug.loaders.hub import resolve_model_source, resolve_tokenizer_source
    from llmplug.platforms import resolve_platform

    config = config.model_copy(deep=True)
    parallel = config.parallel
    if parallel.executor is None:  # one worker runs in this process; more need processes of their own
        one_worker = parallel.tensor_parallel_size * parallel.pipeline_parallel_size == 1
        parallel.executor = "uniproc" if one_worker else "multiproc"
    # The one place a model name becomes a local path (hub ids: from the HF cache, or downloaded there).
    config.model.tokenizer = resolve_tokenizer_source(config.model, config.load.download_dir)
    config.model.model = resolve_model_source(config.model, config.load.download_dir)
    config.load.format = resolve_load_format(config.model.model, config.load.format)
    resolve_model_kind(config, registry)
    platform = resolve_platform(config.device.platform, registry)
    config.device.platform = platform.name
    platform.check_and_update_config(config)
    resolve_batch_invariant(config, platform, registry)
    return config


def build_input_processor(config: EngineConfig, tokenizer: Any | None, info: dict[str, Any],
                          max_model_len: int, registry: PluginRegistry | None = None) -> InputProcessor:
    """The prompt checker and tokenizer of an engine whose model reported `info` (a worker's model_info)."""
    limits = RequestLimits.of(info["vocab_size"], max_model_len, config.decoding)
    embedding_size = info["embedding_size"] if config.model.enable_prompt_embeds else None
    from llmplug.engine.multimodal import mm_processor_for

    model = config.model  # an image or audio model: the folder's own HF processor, or the family's own processing
    multimodal = info.get("image_token_id") is not None or info.get("audio_token_id") is not None
    mm_processor = mm_processor_for(model.model, info, model.limit_mm_per_prompt, model.trust_remote_code,
                                    model.mm_processor_kwargs, family_hf_processor(config, registry) if multimodal
                                    else None)
    encoder_decoder_processor = None
    if info.get("is_encoder_decoder"):  # the model folder's Whisper processor: audio in, the decoder's prompt
        from llmplug.engine.encoder_decoder import EncoderDecoderProcessor

        encoder_decoder_processor = EncoderDecoderProcessor(config.model.model, config.model.trust_remote_code)
    return InputProcessor(tokenizer, limits, embedding_size, mm_processor, encoder_decoder_processor)


def family_hf_processor(config: EngineConfig, registry: PluginRegistry | None) -> Any | None:
    """The processing a model family brings for prompts (its class's `build_hf_processor(model_path, hf_config)`,
    for a family transformers has no processor for: Ultravox's); None for a family that uses transformers'."""
    from llmplug.core.plugins import get_registry

    loader = build_loader(registry or get_registry(), config.load.format, config.load)
    hf_config = loader.load_hf_config(config.model)
    build = getattr(loader.get_model_class(hf_config, config.model.model_impl), "build_hf_processor", None)
    return build(loader.model_path(config.model.model), hf_config) if build is not None else None


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of completion `index` of an n > 1 request: one sequence each, distinct seeds; only the first
    computes the prompt's logprobs (the prompt is shared), so the others may take its blocks from the cache."""
    child = params.clone()
    child.n = 1
    if params.seed is not None:
        child.seed = params.seed + index
    if index > 0:
        child.prompt_logprobs = None
    return child


class LLMEngine:
    """Tokenizes prompts, drives the EngineCore and turns its token updates into RequestOutputs.

    The engine owns `registry`, the plugins its config allows (built from `config.plugins` unless given),
    and hands it to everything it builds; no other engine in the process sees it.
    """

    def __init__(self, config: EngineConfig, registry: PluginRegistry | None = None):
        self.registry = registry or PluginRegistry.from_config(config.plugins)
        self.config = prepare_config(config, self.registry)
        loader = build_loader(self.registry, self.config.load.format, self.config.load)
        loader.download_model(self.config.model)  # once, here, before any worker starts (ModelLoader protocol)
        self.tokenizer = None if self.config.model.skip_tokenizer_init else loader.load_tokenizer(self.config.model)
        self.engine_core = EngineCore(self.config, self.registry)
        info = self.engine_core.model_info
        self.processor = build_input_processor(self.config, self.tokenizer, info, self.engine_core.max_model_len,
                                               self.registry)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_ids = self._eos_token_ids(loader.load_generation_config(self.config.model))
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None  # the tokenizer's, if it has one
        self.guided = GuidedDecodingManager(self.tokenizer, info["vocab_size"], self.eos_token_id, self.config.decoding,
                                            self.registry)
        self.hooks = self.registry.hook_manager().hook
        # a pooling engine: its model's tasks and defaults, and its unfinished requests' prompts and metrics
        self.pooling = PoolingInfo.from_model_info(info["pooling"]) if info.get("pooling") else None
        self._pooling_requests: dict[str, tuple[list[int], RequestMetrics]] = {}

    def _eos_token_ids(self, generation_config: dict[str, Any]) -> tuple[int, ...]:
        """Every end-of-sequence id the model declares (as vLLM): the tokenizer's, the model config's and the
        generation config's (Llama 3 lists several there), the tokenizer's first; ids past the vocabulary dropped."""
        declared = [self.tokenizer.eos_token_id if self.tokenizer is not None else None]
        for eos in (self.engine_core.model_info.get("eos_token_id"), generation_config.get("eos_token_id")):
            declared += eos if isinstance(eos, list) else [eos]
        vocab_size = self.engine_core.model_info["vocab_size"]
        return tuple(dict.fromkeys(int(t) for t in declared if t is not None and 0 <= t < vocab_size))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request; with n > 1 it becomes n sequences sharing the prompt. PoolingParams
        make it a pooling request (a pooling engine serves only those).

        With `lora_request` it runs with that adapter, loaded and checked here first (InvalidRequestError).
        """
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise InvalidRequestError("LoRA adapters apply to generation, not to pooling requests",
                                          param="lora_request")
            self._add_pooling_request(request_id, prompt, params, priority, arrival_time or time.time())
            return
        if self.pooling is not None:
            raise InvalidRequestError(
                f"this engine runs a pooling model (tasks: {', '.join(self.pooling.tasks)}); it does not generate "
                "text: use LLM.embed / classify / score / encode, or /v1/embeddings, /v1/score, /classify"
            )
        params = params or SamplingParams()
        if params.guided_decoding is not None and self.config.speculative_config.method is not None:
            raise InvalidRequestError(
                "guided_decoding cannot be combined with speculative decoding (speculative_config): each draft "
                "position would need the grammar advanced through the drafts before it", param="guided_decoding",
            )
        embeds, mm_features, encoder_feature = None, None, None
        if is_multimodal_prompt(prompt):  # images processed (here, on the caller's thread, unless done already)
            processed = self.processor.process_multimodal(prompt)
            mm_features = processed["mm_features"] or None
            encoder_feature = processed.get("encoder_feature")  # an encoder-decoder model's audio
            prompt = {"prompt": processed["prompt"], "prompt_token_ids": processed["prompt_token_ids"]}
        elif self.processor.encoder_decoder_processor is not None:
            raise InvalidRequestError("this model transcribes audio: give the prompt multi_modal_data={'audio': "
                                      "(samples, sampling_rate)}, or encoder_prompt / decoder_prompt",
                                      param="multi_modal_data")
        if is_embeds_prompt(prompt):  # placeholder token ids; the model runner puts the rows in their place
            embeds, token_ids, params = self.processor.process_embeds(prompt, params)
            text = None
        else:
            text, token_ids, params = self.processor.process(prompt, params)
        if lora_request is not None:
            self.engine_core.add_lora(lora_request)
        grammar = self.guided.prepare(params.guided_decoding) if params.guided_decoding is not None else None
        arrival_time = arrival_time or time.time()
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        self.output_processor.add_request(request_id, text, token_ids, params, arrival_time, child_ids,
                                          prompt_is_embeds=embeds is not None)
        for i, child_id in enumerate(child_ids):
            child = params if params.n == 1 else child_params(params, i)
            request = Request(
                child_id, token_ids, child, self.eos_token_ids, arrival_time, priority,
                # one matcher per child; it waits for the end of the reasoning when the constraint says so
                grammar=RequestGrammar(grammar, child.guided_decoding.start_after_token_ids) if grammar else None,
                lora_request=lora_request,
                prompt_embeds=embeds,
                mm_features=mm_features,
                encoder_feature=encoder_feature,
            )
            try:
                self.engine_core.add_request(request)
            except Exception:
                self.abort_request([request_id])
                raise
        self.hooks.llmplug_request_event(event="added", request_id=request_id, info={"num_prompt_tokens": len(token_ids)})

    def _add_pooling_request(
        self, request_id: str, prompt: PromptType, params: PoolingParams, priority: int, arrival_time: float
    ) -> None:
        """Validate and queue a pooling request (one sequence, no sampling)."""
        if self.pooling is None:
            raise InvalidRequestError(
                "pooling requests (embeddings, classification, scores) need a pooling model; this engine generates "
                "text (start it with runner='pooling' to embed with a causal LM)"
            )
        if request_id in self._pooling_requests or request_id in self.output_processor.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use; ids must be unique")
        params = resolve_pooling_params(params, self.pooling)
        _, token_ids = self.processor.process_pooling(self._pooling_prompt(prompt))
        token_types = self._token_type_ids(prompt, len(token_ids))
        request = Request(request_id, token_ids, None, (), arrival_time, priority,
                          pooling_params=params, token_type_ids=token_types)
        self.engine_core.add_request(request)
        self._pooling_requests[request_id] = (token_ids, RequestMetrics(arrival_time))
        info = {"num_prompt_tokens": len(token_ids)}
        self.hooks.llmplug_request_event(event="added", request_id=request_id, info=info)

    def _pooling_prompt(self, prompt: PromptType) -> PromptType:
        """The prompt as the model's sentence-transformers folder feeds it (lowercased text, if it says so)."""
        if not self.pooling.lowercase:
            return prompt
        if isinstance(prompt, str):
            return prompt.lower()
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str) and "prompt_token_ids" not in prompt:
            return {**prompt, "prompt": prompt["prompt"].lower()}
        return prompt

    def _token_type_ids(self, prompt: PromptType, num_tokens: int) -> list[int] | None:
        """The prompt's token types (segments of a text pair), checked against the model; None when not given."""
        types = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if types is None:
            return None
        types = list(types)
        limit = self.pooling.type_vocab_size if self.pooling.accepts_token_type_ids else 1
        if len(types) != num_tokens or not all(isinstance(t, int) and 0 <= t < max(limit, 1) for t in types):
            raise InvalidRequestError(
                f"token_type_ids must hold one type in [0, {max(limit, 1)}) per prompt token ({num_tokens}); "
                f"got {len(types)} values"
            )
        return types if self.pooling.accepts_token_type_ids else None

    def abort_request(self, request_ids: list[str]) -> None:
        """Stop requests (by the ids the user gave) and free their KV blocks."""
        pooling = [rid for rid in request_ids if self._pooling_requests.pop(rid, None) is not None]
        if pooling:
            self.engine_core.abort_requests(pooling)
        child_ids = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(child_ids)
        for request_id in request_ids:
            self.hooks.llmplug_request_event(event="aborted", request_id=request_id, info={})

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Run one engine step; return the outputs that changed (a pooling request's one, final output)."""
        core_outputs = self.engine_core.step()
        if self.pooling is not None:  # every request pools: one final output each
            pooled = [self._pooling_output(o) for o in core_outputs if o.req_id in self._pooling_requests]
            for out in pooled:
                self.hooks.llmplug_request_event(event="finished", request_id=out.request_id, info={})
            self.hooks.llmplug_stats(stats=self.engine_core.stats())
            return pooled
        processed = self.output_processor.process(core_outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        if processed.reqs_failed:  # their output processing raised: they end, the others go on
            self.engine_core.abort_requests(processed.reqs_failed)
        for out in processed.request_outputs:
            if out.finished:
                self.hooks.llmplug_request_event(event="finished", request_id=out.request_id, info={})
        self.hooks.llmplug_stats(stats=self.engine_core.stats())
        return processed.request_outputs

    def _pooling_output(self, update: EngineCoreOutput) -> PoolingRequestOutput:
        """A finished pooling request's output; `outputs` is None when it was aborted instead."""
        prompt_token_ids, metrics = self._pooling_requests.pop(update.req_id)
        metrics.finished_time = time.time()
        data = update.pooling_output
        outputs = None if data is None else PoolingOutput(data)
        return PoolingRequestOutput(update.req_id, outputs, prompt_token_ids, True, metrics, update.error)

    def has_unfinished_requests(self) -> bool:
        """True while any request is still generating."""
        return self.engine_core.has_unfinished_requests()

    def get_tokenizer(self) -> Any | None:
        """The tokenizer the engine uses (None with skip_tokenizer_init)."""
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the workers and the grammar compiler threads."""
        self.engine_core.shutdown()
        self.guided.shutdown()
