"""Greedy generation through the whole engine against transformers' `generate`, on a tiny checkpoint.

A `ParityCase` names a tiny transformers config; `ParityRunner.check(case, variant)` builds and saves
the checkpoint (once per runner), runs transformers' greedy `generate` on the case's prompts (once per
runner) and llmplug's engine under the variant, then asserts:

- the generated tokens are identical, prompt by prompt;
- every log-probability llmplug reports (top-k of every prompt position and every generated position,
  plus the chosen token) is within `case.atol` of transformers' log-softmax at that position;
- the variant did what it exists for (the preemption variant preempted at least once);
- in batch-invariant mode (docs/determinism.md, on by default on the CPU), the variants that change only how
  the requests are batched (`plain`, `chunked_prefill`, `preemption`, `chunked_preemption`) give bitwise the
  same tokens and log-probabilities (generated and prompt positions) as each other.

Variants (`VARIANTS`): `plain`; `chunked_prefill` (a step budget smaller than the longer prompts);
`preemption` (too few KV blocks for the batch, so requests are preempted and recomputed); `chunked_preemption`
(both in one run); `tp2` and `pp2` (tensor or pipeline parallelism over two worker processes).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from transformers import PretrainedConfig

from llmplug.core.params import SamplingParams
from llmplug.testing.tiny import TinyCheckpoint, save_tiny_checkpoint

__all__ = ["VARIANTS", "Completion", "ParityCase", "ParityReport", "ParityRunner", "Reference", "Variant"]

PROMPT_LENGTHS = (3, 11, 7, 20, 1, 14, 29, 5)
TOP_LOGPROBS = 5


@dataclass(frozen=True)
class ParityCase:
    """One architecture (or one flag combination of it) on a tiny random config."""

    name: str  # the test id, e.g. "Gemma2ForCausalLM" or "GPTNeoXForCausalLM-sequential"
    make_config: Callable[[], PretrainedConfig]  # the tiny transformers config (see llmplug.testing.tiny_config)
    prompt_lengths: tuple[int, ...] = PROMPT_LENGTHS
    max_new_tokens: int = 24
    atol: float = 1e-4  # on log-probabilities
    seed: int = 0
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)  # e.g. max_model_len for ALiBi models
    # transformers' attention for the reference: eager, unless its eager path of the family is wrong
    hf_attn_implementation: str = "eager"
    # the `architectures` entry config.json gets, when not transformers' class name: hub checkpoints of a
    # config-only alias (model_type exaone, run by LlamaForCausalLM) name their own class (ExaoneForCausalLM)
    architecture: str | None = None
    # RoBERTa-style learned positions from row pad_token_id + 1: transformers' `generate` passes positions
    # from 0 that the model uses as rows, while its own forward counts from the offset (a pad token in the
    # prompt taking the pad row): the reference passes rows from `hf_position_offset` to both
    hf_position_offset: int | None = None

    def prompts(self, vocab_size: int) -> list[list[int]]:
        """Random prompts of `prompt_lengths` tokens, the same for every run of the case."""
        generator = torch.Generator().manual_seed(self.seed + 1)
        return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in self.prompt_lengths]


@dataclass(frozen=True)
class Variant:
    """Engine settings that send the same generation down another path of the engine."""

    name: str
    engine_kwargs: Mapping[str, Any]
    expects_preemption: bool = False
    # only the batching changes (step budget, preemption): in batch-invariant mode, bitwise the other such variants
    batching_only: bool = False


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("plain", {}, batching_only=True),
        Variant("chunked_prefill", {"max_num_batched_tokens": 8}, batching_only=True),
        Variant("preemption", {"num_gpu_blocks_override": 24, "max_num_seqs": 8}, expects_preemption=True,
                batching_only=True),
        # both at once: prompts split across steps, and requests preempted (recomputed in chunks) for blocks
        Variant("chunked_preemption", {"max_num_batched_tokens": 8, "num_gpu_blocks_override": 24, "max_num_seqs": 8},
                expects_preemption=True, batching_only=True),
        Variant("tp2", {"tensor_parallel_size": 2}),
        Variant("pp2", {"pipeline_parallel_size": 2}),
        Variant("compiled", {"device.compile": True}),  # the forward through torch.compile
    )
}
# one CPU thread: a tiny model gains nothing from more, and on a shared machine threads only contend
BASE_ENGINE_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "skip_tokenizer_init": True,
    "block_size": 4,
    "device": {"num_threads": 1},
}


@dataclass(frozen=True)
class Reference:
    """transformers' greedy tokens and its log-probabilities at every position of prompt + tokens."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    log_probs: list[torch.Tensor]  # per prompt: [prompt + new tokens - 1, vocab]; row j predicts token j + 1


@dataclass(frozen=True)
class Completion:
    """What llmplug generated for one prompt."""

    tokens: list[int]
    logprobs: list[dict[int, float]]  # per generated token: the chosen and the top-k tokens
    prompt_logprobs: list[dict[int, float]]  # per prompt token after the first


@dataclass(frozen=True)
class ParityReport:
    """A passed check: the worst log-probability difference and the engine's preemptions."""

    case: str
    variant: str
    max_logprob_diff: float
    num_preemptions: int


class ParityRunner:
    """Runs parity cases; each case's checkpoint and transformers reference are made once per runner."""

    def __init__(self, workdir: str | Path) -> None:
        self.workdir = Path(workdir)
        self._checkpoints: dict[str, TinyCheckpoint] = {}
        self._references: dict[str, Reference] = {}
        # per case: the first batching-only variant run in batch-invariant mode, and its completions
        self._invariant_runs: dict[str, tuple[str, list[Completion]]] = {}

    def checkpoint(self, case: ParityCase) -> TinyCheckpoint:
        """The case's saved tiny checkpoint (built on first use)."""
        if case.name not in self._checkpoints:
            self._checkpoints[case.name] = save_tiny_checkpoint(
                case.make_config(), self.workdir / case.name, case.seed, case.hf_attn_implementation, case.architecture
            )
        return self._checkpoints[case.name]

    def reference(self, case: ParityCase) -> Reference:
        """transformers' greedy generation of the case's prompts (computed on first use)."""
        if case.name not in self._references:
            self._references[case.name] = _hf_reference(self.checkpoint(case).hf_model, case)
        return self._references[case.name]

    def generate(self, case: ParityCase, variant: str | Variant = "plain") -> tuple[list[Completion], int, bool]:
        """llmplug's greedy completions of the case's prompts under `variant`, the engine's preemptions, and
        whether the engine ran in batch-invariant mode."""
        from llmplug import LLM

        variant = VARIANTS[variant] if isinstance(variant, str) else variant
        prompts = self.reference(case).prompts
        kwargs = {**BASE_ENGINE_KWARGS, **case.engine_kwargs, **variant.engine_kwargs}
        llm = LLM(str(self.checkpoint(case).path), **kwargs)
        try:
            params = SamplingParams(
                temperature=0.0,
                max_tokens=case.max_new_tokens,
                ignore_eos=True,
                logprobs=TOP_LOGPROBS,
                prompt_logprobs=TOP_LOGPROBS,
            )
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            preemptions = llm.llm_engine.engine_core.scheduler.num_preemptions
            invariant = llm.llm_engine.config.model.batch_invariant_on
        finally:
            llm.shutdown()
        return [_completion(out) for out in outputs], preemptions, invariant

    def check(self, case: ParityCase, variant: str | Variant = "plain") -> ParityReport:
        """Assert llmplug matches transformers on the case under `variant` (see the module doc)."""
        variant = VARIANTS[variant] if isinstance(variant, str) else variant
        reference = self.reference(case)
        completions, preemptions, invariant = self.generate(case, variant)
        where = f"{case.name} [{variant.name}]"
        worst = 0.0
        for i, (prompt, expected, got) in enumerate(zip(reference.prompts, reference.tokens, completions)):
            _assert_same_tokens(got.tokens, expected, f"{where} prompt {i} ({len(prompt)} tokens)")
            worst = max(worst, _max_logprob_diff(got, reference.log_probs[i], len(prompt)))
        if not worst <= case.atol:
            raise AssertionError(
                f"{where}: log-probabilities differ from transformers by up to {worst:.3g} > {case.atol}"
            )
        if variant.expects_preemption and preemptions == 0:
            raise AssertionError(f"{where}: nothing was preempted; the variant proves nothing for this case")
        if invariant and variant.batching_only:
            first, expected_completions = self._invariant_runs.setdefault(case.name, (variant.name, completions))
            for i, (got, expected) in enumerate(zip(completions, expected_completions)):
                if got != expected:
                    raise AssertionError(
                        f"{where} prompt {i}: batch-invariant mode, but the tokens or log-probabilities differ "
                        f"bitwise from the [{first}] run of the same prompts"
                    )
        return ParityReport(case.name, variant.name, worst, preemptions)


def _hf_reference(hf_model: torch.nn.Module, case: ParityCase) -> Reference:
    """Greedy tokens of each prompt alone (no padding), and log-softmax rows over prompt + tokens."""
    if hf_model.config.eos_token_id is not None:  # transformers would stop (or mask) at it; the engine ignores it
        raise ValueError(f"{case.name}: a parity config must have eos_token_id=None (tiny_config clears it)")
    prompts = case.prompts(hf_model.config.vocab_size)
    tokens, log_probs = [], []
    offset = case.hf_position_offset
    rows = lambda n: {} if offset is None else {"position_ids": torch.arange(offset, offset + n)[None]}  # noqa: E731
    with torch.inference_mode(), _one_thread():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = hf_model.generate(  # generate extends position_ids by one per token
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=case.max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                **rows(len(prompt)),
            )
            full = out[0].tolist()
            tokens.append(full[len(prompt) :])
            logits = hf_model(torch.tensor([full[:-1]]), **rows(len(full) - 1)).logits[0]  # [P + N - 1, vocab]
            log_probs.append(torch.log_softmax(logits.float(), dim=-1))
    return Reference(prompts, tokens, log_probs)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread inside (see BASE_ENGINE_KWARGS), the previous count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _completion(output: Any) -> Completion:
    completion = output.outputs[0]
    as_dict = lambda position: {t: lp.logprob for t, lp in position.items()}  # noqa: E731
    return Completion(
        list(completion.token_ids),
        [as_dict(p) for p in completion.logprobs],
        [as_dict(p) for p in (output.prompt_logprobs or [None])[1:]],  # None for a 1-token prompt
    )


def _assert_same_tokens(got: list[int], expected: list[int], where: str) -> None:
    if got != expected:
        first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        raise AssertionError(f"{where}: tokens differ from transformers at {first}: llmplug {got} != {expected}")


def _max_logprob_diff(got: Completion, log_probs: torch.Tensor, prompt_len: int) -> float:
    """Largest |llmplug - transformers| over every reported log-probability; row j of log_probs predicts token j + 1."""
    positions = [(j, lp) for j, lp in enumerate(got.prompt_logprobs)]  # prompt token j + 1 <- row j
    positions += [(prompt_len - 1 + t, lp) for t, lp in enumerate(got.logprobs)]  # generated token t <- row P - 1 + t
    worst = 0.0
    for row, reported in positions:
        for token, logprob in reported.items():
            diff = abs(logprob - float(log_probs[row, token]))
            if math.isnan(diff):
                return math.inf
            worst = max(worst, diff)
    return worst
