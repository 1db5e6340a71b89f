"""LLM: the offline entry point, with vLLM's names (`from llmplug import LLM, SamplingParams`)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from tqdm.auto import tqdm

from llmplug.core.config import EngineConfig, load_config
from llmplug.core.outputs import RequestOutput
from llmplug.core.params import SamplingParams
from llmplug.engine.input_processor import PromptType
from llmplug.engine.llm_engine import LLMEngine
from llmplug.lora.request import LoRARequest

if TYPE_CHECKING:
    import torch

Conversation = list[dict[str, Any]]


class LLM:
    """Generate completions for batches of prompts with continuous batching and a paged KV cache.

    `LLM(model=..., **engine_kwargs)` takes vLLM's engine keywords (dtype, max_model_len, max_num_seqs,
    block_size, enable_prefix_caching, ...) or nested sections (`cache={"block_size": 32}`);
    `LLM(config="engine.yaml")` reads a config file, with keyword arguments overriding it.
    """

    def __init__(self, model: str | None = None, *, config: str | Path | EngineConfig | None = None, **kwargs: Any):
        if model is not None:
            kwargs["model"] = model
        if isinstance(config, EngineConfig):
            engine_config = config
        else:
            # keyword arguments given to LLM override the file they come with
            resolved = load_config(kwargs=kwargs, file=config, order=("file", "kwargs", "cli"))
            engine_config = resolved.config
        self._start(LLMEngine(engine_config))

    @classmethod
    def from_engine(cls, llm_engine: LLMEngine) -> "LLM":
        """Wrap an existing LLMEngine, e.g. one built with a plugin registry of the caller's making."""
        self = cls.__new__(cls)
        self._start(llm_engine)
        return self

    def _start(self, llm_engine: LLMEngine) -> None:
        self.llm_engine = llm_engine
        self._ids = itertools.count()

    @property
    def config(self) -> EngineConfig:
        """The resolved engine configuration."""
        return self.llm_engine.config

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer."""
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the order of the prompts.

        `lora_request`: one LoRA adapter for every prompt, or one (or None: the base model) per prompt.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        loras = self._per_prompt(lora_request, len(prompts), "lora_request")
        ids = self._add_requests(prompts, params, priority, loras)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them, using the tokenizer's chat template (and, with
        `lora_request`, a LoRA adapter: one for all, or one per conversation)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c, **(chat_template_kwargs or {})) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def chat_prompt(self, conversation: Conversation, **kwargs: Any) -> dict[str, Any]:
        """A conversation rendered by the chat template, as prompt text plus token ids."""
        text = self.llm_engine.processor.apply_chat_template(conversation, **kwargs)
        # the template already holds the special tokens: do not let the tokenizer add a BOS again
        token_ids = self.get_tokenizer().encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": token_ids}

    # ---- step-by-step use -------------------------------------------------------------------
    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue one request; returns its id."""
        request_id = request_id or str(next(self._ids))
        self.llm_engine.add_request(request_id, prompt, params, lora_request=lora_request)
        return request_id

    def step(self) -> list[RequestOutput]:
        """Run one engine step."""
        return self.llm_engine.step()

    def abort(self, request_ids: str | list[str]) -> None:
        """Stop requests and free their KV blocks."""
        self.llm_engine.abort_request([request_ids] if isinstance(request_ids, str) else request_ids)

    def shutdown(self) -> None:
        """Release the workers."""
        self.llm_engine.shutdown()

    # ---- between generations: new weights, sleep mode (RL) ------------------------------------
    def update_weights(self, weights: Iterable[tuple[str, "torch.Tensor"]]) -> None:
        """Load new weights into the running engine and reset the prefix cache (no request may be running).

        `weights` are (checkpoint name, tensor) pairs, e.g. a transformers model's `state_dict().items()`;
        any subset of the model's weights, on any device, in any dtype. Each goes through the same
        per-parameter weight loader as at start-up, so fused projections and tensor-parallel shards
        are handled alike. An unknown name or a wrong shape raises ModelLoadError naming the tensor.
        """
        self.llm_engine.engine_core.update_weights(weights)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (no request may be running)."""
        self.llm_engine.engine_core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache memory; level 1 also moves the weights to host memory, level 2 discards them.

        No request may be running, and none can be added until `wake_up`. After level 2, load weights
        with `update_weights` (after `wake_up(tags=["weights"])`) before generating.
        """
        self.llm_engine.engine_core.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore what sleep freed: tags "weights", "kv_cache", or both (None)."""
        self.llm_engine.engine_core.wake_up(tags)

    # ---- LoRA adapters (see docs/lora.md) -------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter ahead of its requests (InvalidRequestError when it cannot be served)."""
        self.llm_engine.engine_core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter; False when none was loaded under that id."""
        return self.llm_engine.engine_core.remove_lora(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded now."""
        return self.llm_engine.engine_core.list_loras()

    def is_sleeping(self) -> bool:
        """True while anything is asleep."""
        return bool(self.llm_engine.engine_core.asleep)

    # ---- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _params_per_prompt(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts")
        return list(sampling_params)

    @staticmethod
    def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
        """`value` for each of `n` prompts: a sequence of n, or one value for all."""
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"got {len(value)} {name} for {n} prompts")
            return list(value)
        return [value] * n

    def _add_requests(
        self, prompts: Sequence[PromptType], params: list[SamplingParams], priority, loras: list[LoRARequest | None]
    ) -> list[str]:
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                request_id = str(next(self._ids))
                self.llm_engine.add_request(
                    request_id, prompt, p, priority=priority[i] if priority else 0, lora_request=loras[i]
                )
                ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(ids)  # a bad prompt fails the call, not the engine
            raise
        return ids

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request finished; whatever escapes (an error, Ctrl-C) first aborts the unfinished ones,
        so the engine holds none of their blocks and the next call starts clean."""
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm, unit="req") as bar:
                while pending:
                    if not self.llm_engine.has_unfinished_requests():
                        raise RuntimeError(f"engine went idle with requests {sorted(pending)} unfinished")
                    for out in self.llm_engine.step():
                        if out.finished and out.request_id in pending:
                            finished[out.request_id] = out
                            pending.discard(out.request_id)
                            bar.update(1)
        except BaseException:
            self.llm_engine.abort_request(sorted(pending))
            raise
        return [finished[i] for i in request_ids]
