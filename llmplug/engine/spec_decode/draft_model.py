"""Draft-model proposals: a second, smaller llmplug engine over the same vocabulary continues the sequence greedily.

The draft engine keeps its own KV cache with prefix caching, so proposing for a request computes only the
tokens the draft model has not seen yet (its last, partial block and the new ones) plus the drafts. Greedy
drafts are deterministic (a one-hot draft distribution), so the rejection sampler's rule for them keeps the
target's distribution exact, as for n-gram drafts.
"""

from __future__ import annotations

from llmplug.core.config import EngineConfig, ModelConfig
from llmplug.core.errors import ConfigError
from llmplug.core.params import SamplingParams


class DraftModelProposer:
    """Proposes with `model` (any llmplug architecture with the target's vocabulary) run by an engine of its own."""

    def __init__(self, target: EngineConfig, vocab_size: int, max_model_len: int):
        from llmplug.engine.llm_engine import LLMEngine  # the draft engine is an engine: imported when one is made

        draft = EngineConfig(
            model=ModelConfig(model=target.speculative_config.model, dtype=target.model.dtype,
                              max_model_len=max_model_len, skip_tokenizer_init=True),
            device=target.device.model_copy(),
            plugins=target.plugins.model_copy(),
        )
        self.engine = LLMEngine(draft)
        draft_vocab = self.engine.engine_core.model_info["vocab_size"]
        if draft_vocab != vocab_size:
            self.engine.shutdown()
            raise ConfigError(
                f"speculative_config.model={target.speculative_config.model!r} has a vocabulary of {draft_vocab} "
                f"tokens, the target {vocab_size}: a draft model must share the target's tokenizer"
            )
        self._ids = 0

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """The draft model's greedy continuation of `token_ids`, `num_tokens` long."""
        if num_tokens <= 0:
            return []
        self._ids += 1
        request_id = f"draft-{self._ids}"
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, detokenize=False)
        self.engine.add_request(request_id, {"prompt_token_ids": token_ids}, params)
        drafts: list[int] = []
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                drafts = list(output.outputs[0].token_ids)
        return drafts

    def shutdown(self) -> None:
        """Stop the draft engine."""
        self.engine.shutdown()
