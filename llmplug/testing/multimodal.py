"""Greedy generation with images through the whole engine against transformers, on a tiny checkpoint.

A `MultimodalParityCase` holds a vision-language checkpoint folder, its transformers processor and model, and
prompts with pictures. `MultimodalParityRunner.check(case, variant)` runs transformers' greedy `generate` on
each prompt's processor output (once per runner and prompt) and llmplug's engine on the text and pictures,
then asserts:

- the engine's prompt is the processor's, placeholder for placeholder;
- the generated tokens are identical, prompt by prompt;
- every log-probability llmplug reports for a generated token (the chosen and the top ones) is within
  `case.atol` of transformers' log-softmax at that step;
- the variant did what it exists for (steps smaller than the prompts together; `preemption` preempted);
- the case can fail: two prompts of the same text and other pictures differ in transformers' tokens or odds.

`check_prefix_cache(case, llm)` then sends a prompt again (every block through its images is a hit) and with
another picture (no hit past the text before the picture), both against transformers.

Variants (`MULTIMODAL_VARIANTS`): `plain`; `chunked_prefill` (steps of `case.chunk_budget` tokens, chosen
smaller than an image where the model may split one); `preemption` (those chunks and `case.preemption_blocks`
KV blocks, too few for the batch); `tp2` (those chunks over two tensor-parallel worker processes).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from llmplug.core.params import SamplingParams
from llmplug.testing.parity import TOP_LOGPROBS, _one_thread

__all__ = [
    "MULTIMODAL_VARIANTS",
    "MultimodalParityCase",
    "MultimodalParityReport",
    "MultimodalParityRunner",
    "MultimodalPrompt",
    "MultimodalReference",
    "processor_inputs",
]

MULTIMODAL_VARIANTS = ("plain", "chunked_prefill", "preemption", "tp2")
# one CPU thread, as the text kit's (llmplug.testing.parity.BASE_ENGINE_KWARGS)
BASE_ENGINE_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": 4,
    "num_gpu_blocks_override": 256,
    "device": {"num_threads": 1},
}
# two prompts of the same text and other pictures differ in transformers' first log-probability by more than this
PICTURE_MATTERS = 1e-2


@dataclass(frozen=True)
class MultimodalPrompt:
    """A prompt's text, placeholders as the processor wants them, and its PIL pictures (none: a text prompt)."""

    text: str
    images: tuple[Any, ...] = ()

    def engine_prompt(self) -> str | dict[str, Any]:
        """The prompt as `LLM.generate` takes it."""
        if not self.images:
            return self.text
        return {"prompt": self.text, "multi_modal_data": {"image": list(self.images)}}


def processor_inputs(processor: Any, text: str, images: Sequence[Any], **kwargs: Any) -> dict[str, Any]:
    """transformers' inputs for a prompt: `processor(text=..., images=..., return_tensors="pt", **kwargs)`."""
    inputs = processor(text=text, images=list(images) or None, return_tensors="pt", **kwargs)
    return {name: value for name, value in inputs.items() if value is not None}


@dataclass(frozen=True)
class MultimodalParityCase:
    """A vision-language checkpoint with its transformers processor and model, and the prompts to check."""

    name: str  # the test id, e.g. "LlavaForConditionalGeneration"
    model: str | Path  # the checkpoint folder the engine loads (config, weights, the processor's files)
    processor: Any  # the transformers processor saved in `model`
    hf_model: torch.nn.Module  # transformers' model on the same weights, float32, in eval mode
    prompts: tuple[MultimodalPrompt, ...]
    # tokens a step under chunked_prefill, preemption and tp2: less than an image where the model may split one
    # (a model whose images or prompts are bidirectional spans: less than the prompts together)
    chunk_budget: int | None = None
    preemption_blocks: int | None = None  # KV blocks (of 4 tokens) under `preemption`: too few for the prompts
    max_tokens: int = 8
    atol: float = 1e-4  # on log-probabilities
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)  # added to every variant's
    # transformers' inputs for (processor, text, images): a family whose model wants more than its processor
    # returns (or less) says so here; `generate` gets them as keyword arguments
    hf_inputs: Callable[[Any, str, Sequence[Any]], Mapping[str, Any]] = processor_inputs

    def variant_kwargs(self, variant: str) -> dict[str, Any]:
        """The engine settings of `variant` (one of MULTIMODAL_VARIANTS) for this case, before its own."""
        if variant != "plain" and self.chunk_budget is None:
            raise ValueError(f"{self.name}: the {variant} variant needs the case's chunk_budget")
        if variant == "preemption" and self.preemption_blocks is None:
            raise ValueError(f"{self.name}: the preemption variant needs the case's preemption_blocks")
        chunked = {"max_num_batched_tokens": self.chunk_budget}
        by_name = {
            "plain": {},
            "chunked_prefill": chunked,
            "preemption": {**chunked, "num_gpu_blocks_override": self.preemption_blocks},
            "tp2": {**chunked, "tensor_parallel_size": 2},
        }
        if variant not in by_name:
            raise ValueError(f"unknown variant {variant!r}: one of {MULTIMODAL_VARIANTS}")
        return by_name[variant]

    def image_token_id(self) -> int:
        """The placeholder token of the model's config (`image_token_id` or `image_token_index`)."""
        config = self.hf_model.config
        token = getattr(config, "image_token_id", None)
        return config.image_token_index if token is None else token


@dataclass(frozen=True)
class MultimodalReference:
    """transformers' processed prompt, greedy tokens and log-softmax of each generated step."""

    prompt_token_ids: list[int]
    tokens: list[int]
    log_probs: torch.Tensor  # [max_tokens, vocab]: row t is the step that chose tokens[t]


@dataclass(frozen=True)
class MultimodalParityReport:
    """A passed check: the engine's outputs, the worst log-probability difference and the preemptions."""

    case: str
    variant: str
    outputs: list[Any]  # the engine's RequestOutput of each prompt, in the case's order
    max_logprob_diff: float
    num_preemptions: int


class MultimodalParityRunner:
    """Runs multimodal parity cases; transformers' answer to each prompt is computed once per runner."""

    def __init__(self) -> None:
        self._references: dict[tuple, MultimodalReference] = {}

    def reference(self, case: MultimodalParityCase, prompt: MultimodalPrompt) -> MultimodalReference:
        """transformers' greedy generation of `prompt` (computed on first use)."""
        key = (case.name, prompt.text, *map(_image_key, prompt.images))
        if key not in self._references:
            self._references[key] = _hf_reference(case, prompt)
        return self._references[key]

    @contextlib.contextmanager
    def engine(self, case: MultimodalParityCase, variant: str = "plain", **engine_kwargs: Any) -> Iterator[Any]:
        """An `LLM` on the case's folder under `variant` (more settings in `engine_kwargs`), shut down after."""
        from llmplug import LLM

        most_images = max([1, *(len(p.images) for p in case.prompts)])
        kwargs = {**BASE_ENGINE_KWARGS, "limit_mm_per_prompt": {"image": most_images},
                  **case.variant_kwargs(variant), **case.engine_kwargs, **engine_kwargs}
        llm = LLM(str(case.model), **kwargs)
        try:
            yield llm
        finally:
            llm.shutdown()

    def generate(self, case: MultimodalParityCase, llm: Any, prompts: Sequence[MultimodalPrompt]) -> list[Any]:
        """The engine's greedy outputs of `prompts` (in one batch), with log-probabilities."""
        params = SamplingParams(temperature=0.0, max_tokens=case.max_tokens, ignore_eos=True, logprobs=TOP_LOGPROBS)
        return llm.generate([p.engine_prompt() for p in prompts], params, use_tqdm=False)

    def assert_matches(self, case: MultimodalParityCase, output: Any, prompt: MultimodalPrompt) -> float:
        """Assert one engine output answers `prompt` as transformers does; the worst log-probability difference."""
        reference = self.reference(case, prompt)
        where = f"{case.name}: {prompt.text!r} with {len(prompt.images)} image(s)"
        if list(output.prompt_token_ids) != reference.prompt_token_ids:
            raise AssertionError(f"{where}: the engine's prompt is not the processor's: "
                                 f"{list(output.prompt_token_ids)} != {reference.prompt_token_ids}")
        got = list(output.outputs[0].token_ids)
        if got != reference.tokens:
            first = next(i for i, (a, b) in enumerate(zip([*got, None], reference.tokens)) if a != b)
            raise AssertionError(f"{where}: tokens differ from transformers at {first}: "
                                 f"llmplug {got} != {reference.tokens}")
        worst = _max_logprob_diff(output.outputs[0].logprobs, reference.log_probs)
        if not worst <= case.atol:
            raise AssertionError(f"{where}: log-probabilities differ from transformers by up to {worst:.3g} "
                                 f"> {case.atol}")
        return worst

    def check(self, case: MultimodalParityCase, variant: str = "plain", llm: Any = None) -> MultimodalParityReport:
        """Assert llmplug answers every prompt of the case as transformers does under `variant` (the module doc).

        `llm`: an engine `engine(case, variant)` started, for more checks on the same engine; else one is started
        and shut down here."""
        if llm is None:
            with self.engine(case, variant) as started:
                return self.check(case, variant, started)
        self._check_case_can_fail(case)
        outputs = self.generate(case, llm, case.prompts)
        worst = max(self.assert_matches(case, out, prompt) for out, prompt in zip(outputs, case.prompts))
        preemptions = llm.llm_engine.engine_core.scheduler.num_preemptions if variant != "tp2" else 0
        total = sum(len(out.prompt_token_ids) for out in outputs)
        if variant != "plain" and case.chunk_budget >= total:
            raise AssertionError(f"{case.name} [{variant}]: chunk_budget {case.chunk_budget} holds every prompt "
                                 f"({total} tokens) in one step: nothing was chunked")
        if variant == "preemption" and preemptions == 0:
            raise AssertionError(f"{case.name} [preemption]: nothing was preempted with {case.preemption_blocks} "
                                 "KV blocks; fewer would")
        return MultimodalParityReport(case.name, variant, outputs, worst, preemptions)

    def check_prefix_cache(self, case: MultimodalParityCase, llm: Any, prompt: MultimodalPrompt | None = None,
                           other_image: Any = None) -> tuple[Any, Any]:
        """Send `prompt` (the case's first with images) to `llm` twice, then with its first picture replaced by
        `other_image` (that picture mirrored): assert the second run reuses every KV block through its last
        image, the other picture no block past the text before it, and both answer as transformers does.
        Returns the repeated output and the other picture's."""
        prompt = prompt or next(p for p in case.prompts if p.images)
        other = MultimodalPrompt(prompt.text, (other_image or _mirrored(prompt.images[0]), *prompt.images[1:]))
        self.generate(case, llm, [prompt])
        same, changed = (self.generate(case, llm, [p])[0] for p in (prompt, other))
        ids, image_token = list(same.prompt_token_ids), case.image_token_id()
        first_image, image_end = ids.index(image_token), len(ids) - ids[::-1].index(image_token)
        block_size = llm.llm_engine.config.cache.block_size
        # every full block but the one holding the last prompt token (computed again, for its logits)
        through_images = min(-(-image_end // block_size), (len(ids) - 1) // block_size) * block_size
        if same.num_cached_tokens < through_images:
            raise AssertionError(f"{case.name}: the same prompt and pictures again reused {same.num_cached_tokens} "
                                 f"tokens, not the {through_images} through its last image (at {image_end})")
        if changed.num_cached_tokens > first_image:
            raise AssertionError(f"{case.name}: another picture reused {changed.num_cached_tokens} tokens, past the "
                                 f"first image's start ({first_image}): block hashes must name the picture")
        self.assert_matches(case, same, prompt)
        self.assert_matches(case, changed, other)
        return same, changed

    def _check_case_can_fail(self, case: MultimodalParityCase) -> None:
        """Two prompts of the same text and other pictures must differ in transformers' tokens or odds."""
        by_text: dict[str, MultimodalReference] = {}
        for prompt in case.prompts:
            if not prompt.images:
                continue
            reference = self.reference(case, prompt)
            seen = by_text.setdefault(prompt.text, reference)
            if seen is not reference and seen.tokens == reference.tokens:
                first = seen.tokens[0]
                if abs(float(seen.log_probs[0, first] - reference.log_probs[0, first])) <= PICTURE_MATTERS:
                    raise ValueError(f"{case.name}: transformers answers {prompt.text!r} alike whatever the picture; "
                                     "the case cannot tell an engine that ignores pictures (draw larger weights)")


def _hf_reference(case: MultimodalParityCase, prompt: MultimodalPrompt) -> MultimodalReference:
    inputs = dict(case.hf_inputs(case.processor, prompt.text, prompt.images))
    with torch.inference_mode(), _one_thread():
        out = case.hf_model.generate(**inputs, max_new_tokens=case.max_tokens, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
    prompt_ids = inputs["input_ids"][0].tolist()
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    if len(tokens) != case.max_tokens:  # transformers stopped at an end token; the engine ignores them
        raise ValueError(f"{case.name}: transformers stopped after {len(tokens)} of {case.max_tokens} tokens on "
                         f"{prompt.text!r}; give the checkpoint's generation no eos_token_id")
    return MultimodalReference(prompt_ids, tokens, torch.log_softmax(torch.cat(out.logits).float(), dim=-1))


def _max_logprob_diff(logprobs: Sequence[Mapping[int, Any]], log_probs: torch.Tensor) -> float:
    """Largest |llmplug - transformers| over every reported log-probability of the generated tokens."""
    worst = 0.0
    for step, reported in enumerate(logprobs):
        for token, logprob in reported.items():
            diff = abs(logprob.logprob - float(log_probs[step, token]))
            if math.isnan(diff):
                return math.inf
            worst = max(worst, diff)
    return worst


def _image_key(image: Any) -> tuple:
    """A PIL picture's content, as the key of the reference cache."""
    return image.mode, image.size, hashlib.sha256(image.tobytes()).hexdigest()


def _mirrored(image: Any) -> Any:
    """The picture flipped left to right: the same size and placeholders, another content."""
    from PIL import ImageOps

    return ImageOps.mirror(image)
