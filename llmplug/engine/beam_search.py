"""Beam search as transformers' `generate(num_beams=...)` runs it, advanced one step at a time by the engine.

Each step the engine computes, for every running beam, the top-k log-probabilities of its next token (one
request per beam, whose prompt is the beam's whole sequence: through prefix caching it reads the K/V of
every full block it shares with the prompt and with its parent beam, and computes only its last, partial
block). `BeamSearch` keeps transformers' bookkeeping:

- the `(1 + number of end tokens) * beam_width` best candidates of all beams (by cumulative logprob) are
  kept; the best `beam_width` of them that do not end become the next running beams;
- a candidate that ends (an end token, or the last allowed token) among the best `beam_width` joins the
  finished beams, scored `cum_logprob / num_generated_tokens ** length_penalty`; the best `beam_width`
  finished beams are kept;
- the search stops at `max_tokens`, when `early_stopping=True` and `beam_width` beams finished, or when no
  running beam can still beat the worst finished one (`early_stopping` False or "never", as transformers).
  One beam is greedy decoding, as transformers runs `num_beams=1`.

Each beam needs its top `(1 + number of end tokens) * beam_width` tokens: the global best candidates
are always among their own beam's best that many.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from llmplug.core.errors import InvalidRequestError
from llmplug.core.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, PositionLogprobs, RequestOutput
from llmplug.core.params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from llmplug.engine.input_processor import PromptType
    from llmplug.engine.llm_engine import LLMEngine


@dataclass(slots=True)
class Beam:
    """A running or finished beam: its generated tokens, their logprobs, and the sum of those."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    score: float = 0.0  # finished beams: cum_logprob / len(token_ids) ** length_penalty
    ended_by: int | None = None  # the end token that finished it


@dataclass(slots=True)
class _Candidate:
    beam: Beam
    token_id: int
    cum_logprob: float
    position: PositionLogprobs

    def extend(self) -> Beam:
        beam = self.beam
        return Beam(beam.token_ids + [self.token_id], beam.logprobs + [self.position], self.cum_logprob)


def logprobs_per_beam(params: BeamSearchParams, eos_token_ids: Sequence[int]) -> int:
    """How many top tokens each beam needs per step (transformers' candidates per step)."""
    num_eos = 0 if params.ignore_eos else len(eos_token_ids)
    return max(2, 1 + num_eos) * params.beam_width


def check_beam_search(params: BeamSearchParams, eos_token_ids: Sequence[int], max_logprobs: int) -> None:
    """InvalidRequestError when the engine cannot give each beam the logprobs it needs."""
    needed = logprobs_per_beam(params, eos_token_ids)
    if needed > max_logprobs:
        raise InvalidRequestError(
            f"BeamSearchParams.beam_width={params.beam_width} needs the top {needed} logprobs of each beam per step "
            f"((1 + {len(eos_token_ids)} end tokens) x beam_width), more than the engine's limit of {max_logprobs} "
            "(decoding.max_logprobs and the vocabulary size); lower beam_width or raise decoding.max_logprobs",
            param="beam_width",
        )


def start_search(engine: LLMEngine, prompt: PromptType, params: BeamSearchParams) -> BeamSearch:
    """The search of one prompt, its prompt and params checked against the model (InvalidRequestError)."""
    limits = engine.processor.limits
    check_beam_search(params, engine.eos_token_ids, min(limits.max_logprobs, limits.vocab_size))
    text, token_ids, _ = engine.processor.process(prompt, SamplingParams(max_tokens=params.max_tokens))
    return BeamSearch(token_ids, params, engine.eos_token_ids, prompt_text=text)


def step_params(params: BeamSearchParams, eos_token_ids: Sequence[int]) -> SamplingParams:
    """The SamplingParams of one beam's request in one step: one token, and the beam's top logprobs."""
    return SamplingParams(
        max_tokens=1, logprobs=logprobs_per_beam(params, eos_token_ids), temperature=params.temperature,
        ignore_eos=True, detokenize=False,
    )


def next_token_logprobs(output: RequestOutput) -> PositionLogprobs:
    """The top logprobs of a beam's step request; BeamSearchError when the step failed for it."""
    completion = output.outputs[0]
    if completion.error is not None or not completion.logprobs:
        raise BeamSearchError(f"a beam's step failed inside the engine: {completion.error or completion.finish_reason}")
    return completion.logprobs[0]


class BeamSearchError(RuntimeError):
    """A step of a beam search failed inside the engine (the search cannot go on without that beam)."""


class BeamSearch:
    """The beams of one prompt; `advance` takes each running beam's next-token logprobs."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: Sequence[int],
                 prompt_text: str | None = None):
        self.prompt_token_ids = prompt_token_ids
        self.prompt_text = prompt_text
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.num_candidates = logprobs_per_beam(params, eos_token_ids)
        # one beam is greedy decoding (as transformers runs num_beams=1): it ends with its first finished beam
        self.early_stopping = True if params.beam_width == 1 else params.early_stopping
        self.running: list[Beam] = [Beam()]  # transformers' other initial beams score -1e9: never chosen
        self.finished: list[Beam] = []  # best first, at most beam_width
        self.improvement_possible = True
        self.done = False

    def sequences(self) -> list[list[int]]:
        """The token ids of each running beam: what the engine computes next."""
        return [self.prompt_token_ids + beam.token_ids for beam in self.running]

    def advance(self, positions: Sequence[PositionLogprobs]) -> None:
        """Take the next-token logprobs of each running beam (in `running`'s order) and step the search."""
        width = self.params.beam_width
        candidates = [
            _Candidate(beam, token_id, beam.cum_logprob + lp.logprob, position)
            for beam, position in zip(self.running, positions)
            for token_id, lp in position.items()
        ]
        candidates.sort(key=lambda c: c.cum_logprob, reverse=True)
        candidates = candidates[: self.num_candidates]
        num_generated = len(self.running[0].token_ids) + 1
        last_step = num_generated >= self.params.max_tokens
        ends = [last_step or c.token_id in self.eos_token_ids for c in candidates]
        self.running = [c.extend() for c, end in zip(candidates, ends) if not end][:width]
        if self.improvement_possible and not (self.full and self.early_stopping is True):
            self._finish([c for c, end in zip(candidates[:width], ends[:width]) if end], num_generated)
        self._update_improvement_possible(num_generated)
        self.done = last_step or not self.improvement_possible or (self.full and self.early_stopping is True)

    @property
    def full(self) -> bool:
        """True once `beam_width` beams finished."""
        return len(self.finished) == self.params.beam_width

    def _finish(self, candidates: list[_Candidate], num_generated: int) -> None:
        penalty = num_generated ** self.params.length_penalty
        for candidate in candidates:
            beam = candidate.extend()
            beam.score = beam.cum_logprob / penalty
            if candidate.token_id in self.eos_token_ids:
                beam.ended_by = candidate.token_id
            self.finished.append(beam)
        self.finished.sort(key=lambda b: b.score, reverse=True)
        del self.finished[self.params.beam_width :]

    def _update_improvement_possible(self, num_generated: int) -> None:
        """transformers' heuristic: can the best running beam still beat the worst finished one?"""
        if not (self.improvement_possible and self.full and self.running):
            return
        length = num_generated
        if self.early_stopping == "never" and self.params.length_penalty > 0:
            length = self.params.max_tokens
        best_possible = self.running[0].cum_logprob / length ** self.params.length_penalty
        self.improvement_possible = best_possible > self.finished[-1].score

    def output(self, tokenizer: Any | None) -> BeamSearchOutput:
        """The finished beams, best first, as vLLM returns them (prompt tokens included)."""
        return BeamSearchOutput([self._sequence(beam, tokenizer) for beam in self.finished])

    def request_output(self, request_id: str, tokenizer: Any | None) -> RequestOutput:
        """The finished beams as one finished request with `beam_width` completions (what servers answer)."""
        completions = [
            CompletionOutput(
                index=i, token_ids=tokens, cumulative_logprob=beam.cum_logprob,
                text=tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else "",
                finish_reason="stop" if beam.ended_by is not None else "length", stop_reason=beam.ended_by,
            )
            for i, beam in enumerate(self.finished)
            for tokens in [self._generated(beam)]
        ]
        return RequestOutput(request_id, self.prompt_text, self.prompt_token_ids, completions, finished=True)

    def _generated(self, beam: Beam) -> list[int]:
        """The beam's generated tokens, its end token left out unless `include_stop_str_in_output`."""
        if beam.ended_by is not None and not self.params.include_stop_str_in_output:
            return beam.token_ids[:-1]
        return beam.token_ids

    def _sequence(self, beam: Beam, tokenizer: Any | None) -> BeamSearchSequence:
        tokens = self.prompt_token_ids + self._generated(beam)
        return BeamSearchSequence(
            tokens=tokens,
            logprobs=beam.logprobs,
            cum_logprob=beam.cum_logprob,
            text=tokenizer.decode(tokens) if tokenizer is not None else None,
            finish_reason="stop" if beam.ended_by is not None else "length",
            stop_reason=beam.ended_by,
        )
