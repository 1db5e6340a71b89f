"""Draft-model proposals: a second, smaller llmplug engine over the same vocabulary continues the sequences.

All speculating requests of a step are added to the draft engine at once, so it runs one batched forward
per draft position (the first also computing what each request gained since its last proposal). The draft
engine keeps its own KV cache with prefix caching, so a request's proposal computes only the tokens the
draft model has not seen yet (its last, partial block and the new ones) plus the drafts.

A greedy request gets greedy drafts: deterministic, a one-hot draft distribution. A sampled request gets
drafts sampled with its temperature and top-p, and the distributions q they were drawn from, which the
rejection sampler needs (p / q) to keep the target's distribution exact; a draft that follows the target's
distribution more closely is accepted more often than its argmax would be.
"""

from __future__ import annotations

import itertools

import torch

from llmplug.core.config import EngineConfig, ModelConfig, SchedulerConfig
from llmplug.core.errors import ConfigError
from llmplug.core.params import SamplingParams
from llmplug.engine.sampling_state import step_seed
from llmplug.engine.spec_decode.draft import Draft, DraftRequest
from llmplug.engine.spec_decode.rejection_sampler import sampling_distribution

DRAFT_SEED_SALT = 0x5EED_D4AF7  # a seeded request's drafts draw from a stream apart from its own tokens'


class DraftLogits:
    """A per-request logits processor that records the draft model's logits at each draft position.

    The draft engine applies it before temperature and top-p, so the recorded rows are what the draft
    tokens were sampled from; it leaves them unchanged.
    """

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}  # draft position -> logits [V]

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.rows[len(output_token_ids)] = logits.clone()
        return logits


class DraftModelProposer:
    """Proposes with `model` (any llmplug architecture with the target's vocabulary) run by an engine of its own."""

    def __init__(self, target: EngineConfig, vocab_size: int, max_model_len: int):
        from llmplug.engine.llm_engine import LLMEngine  # the draft engine is an engine: imported when one is made

        draft = EngineConfig(
            model=ModelConfig(model=target.speculative_config.model, dtype=target.model.dtype,
                              max_model_len=max_model_len, skip_tokenizer_init=True),
            device=target.device.model_copy(),
            plugins=target.plugins.model_copy(),
            # it never runs more requests than the target: its KV cache is sized for as many
            scheduler=SchedulerConfig(max_num_seqs=target.scheduler.max_num_seqs),
        )
        self.engine = LLMEngine(draft)
        draft_vocab = self.engine.engine_core.model_info["vocab_size"]
        if draft_vocab != vocab_size:
            self.engine.shutdown()
            raise ConfigError(
                f"speculative_config.model={target.speculative_config.model!r} has a vocabulary of {draft_vocab} "
                f"tokens, the target {vocab_size}: a draft model must share the target's tokenizer"
            )
        self._ids = itertools.count()

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """The draft model's continuation of each request, all run as one batch of the draft engine."""
        asked: dict[str, tuple[DraftRequest, DraftLogits | None]] = {}
        for request in requests:
            request_id = f"draft-{next(self._ids)}"
            params, recorder = self._draft_params(request)
            self.engine.add_request(request_id, {"prompt_token_ids": request.token_ids}, params)
            asked[request_id] = (request, recorder)
        tokens: dict[str, list[int]] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                tokens[output.request_id] = list(output.outputs[0].token_ids)
        return [self._draft(tokens.get(rid, []), request, recorder) for rid, (request, recorder) in asked.items()]

    @staticmethod
    def _draft_params(request: DraftRequest) -> tuple[SamplingParams, DraftLogits | None]:
        """Greedy drafts for a greedy request; else sampled as it samples, their logits recorded."""
        params = request.params
        common = dict(max_tokens=request.num_tokens, ignore_eos=True, detokenize=False)
        if params.temperature < 1e-5:
            return SamplingParams(temperature=0.0, **common), None
        recorder = DraftLogits()
        seed = None if params.seed is None else step_seed(params.seed ^ DRAFT_SEED_SALT, len(request.token_ids))
        return SamplingParams(temperature=params.temperature, top_p=params.top_p, seed=seed,
                              logits_processors=[recorder], **common), recorder

    @staticmethod
    def _draft(token_ids: list[int], request: DraftRequest, recorder: DraftLogits | None) -> Draft:
        if recorder is None or not token_ids:
            return Draft(token_ids)
        logits = torch.stack([recorder.rows[i] for i in range(len(token_ids))])  # [k, V]
        return Draft(token_ids, sampling_distribution(logits, request.params.temperature, request.params.top_p))

    def shutdown(self) -> None:
        """Stop the draft engine."""
        self.engine.shutdown()
