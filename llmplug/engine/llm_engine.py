"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time."""

from __future__ import annotations

import logging
import time
from typing import Any

from llmplug.core.config import EngineConfig
from llmplug.core.outputs import RequestOutput
from llmplug.core.params import SamplingParams
from llmplug.core.plugins import PluginRegistry
from llmplug.engine.engine_core import EngineCore
from llmplug.engine.guided_decoding import GuidedDecodingManager, RequestGrammar
from llmplug.engine.input_processor import InputProcessor, PromptType
from llmplug.engine.output_processor import OutputProcessor
from llmplug.engine.request_limits import RequestLimits
from llmplug.engine.request import Request, RequestStatus
from llmplug.loaders import build_loader
from llmplug.lora.request import LoRARequest

logger = logging.getLogger(__name__)


def prepare_config(config: EngineConfig, registry: PluginRegistry) -> EngineConfig:
    """Resolve what the workers must agree on: the model path, the platform's dtype and backends."""
    from llmplug.loaders import resolve_load_format
    from llmplug.loaders.default_model import resolve_model_path
    from llmplug.platforms import resolve_platform

    config = config.model_copy(deep=True)
    parallel = config.parallel
    if parallel.executor is None:  # one worker runs in this process; more need processes of their own
        one_worker = parallel.tensor_parallel_size * parallel.pipeline_parallel_size == 1
        parallel.executor = "uniproc" if one_worker else "multiproc"
    config.model.model = resolve_model_path(config.model.model)
    config.load.format = resolve_load_format(config.model.model, config.load.format)
    platform = resolve_platform(config.device.platform, registry)
    config.device.platform = platform.name
    platform.check_and_update_config(config)
    return config


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
        limits = RequestLimits.of(info["vocab_size"], self.engine_core.max_model_len, self.config.decoding)
        self.processor = InputProcessor(self.tokenizer, limits)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_ids = self._eos_token_ids(loader.load_generation_config(self.config.model))
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None  # the tokenizer's, if it has one
        self.guided = GuidedDecodingManager(self.tokenizer, info["vocab_size"], self.eos_token_id, self.config.decoding,
                                            self.registry)
        self.hooks = self.registry.hook_manager().hook

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
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request; with n > 1 it becomes n sequences sharing the prompt.

        With `lora_request` it runs with that adapter, loaded and checked here first (InvalidRequestError).
        """
        params = params or SamplingParams()
        text, token_ids, params = self.processor.process(prompt, params)
        if lora_request is not None:
            self.engine_core.add_lora(lora_request)
        grammar = self.guided.prepare(params.guided_decoding) if params.guided_decoding is not None else None
        arrival_time = arrival_time or time.time()
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        self.output_processor.add_request(request_id, text, token_ids, params, arrival_time, child_ids)
        for i, child_id in enumerate(child_ids):
            child = params if params.n == 1 else child_params(params, i)
            request = Request(
                child_id, token_ids, child, self.eos_token_ids, arrival_time, priority,
                # one matcher per child; it waits for the end of the reasoning when the constraint says so
                grammar=RequestGrammar(grammar, child.guided_decoding.start_after_token_ids) if grammar else None,
                lora_request=lora_request,
            )
            try:
                self.engine_core.add_request(request)
            except Exception:
                self.abort_request([request_id])
                raise
        self.hooks.llmplug_request_event(event="added", request_id=request_id, info={"num_prompt_tokens": len(token_ids)})

    def abort_request(self, request_ids: list[str]) -> None:
        """Stop requests (by the ids the user gave) and free their KV blocks."""
        child_ids = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(child_ids)
        for request_id in request_ids:
            self.hooks.llmplug_request_event(event="aborted", request_id=request_id, info={})

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs that changed."""
        core_outputs = self.engine_core.step()
        processed = self.output_processor.process(core_outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort, RequestStatus.FINISHED_STOPPED)
        for out in processed.request_outputs:
            if out.finished:
                self.hooks.llmplug_request_event(event="finished", request_id=out.request_id, info={})
        self.hooks.llmplug_stats(stats=self.engine_core.stats())
        return processed.request_outputs

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
