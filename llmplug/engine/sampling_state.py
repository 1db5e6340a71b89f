"""Per-request sampling state kept by the worker across steps, turned into batched tensors.

The worker owns one `SamplingState`. The model runner tells it when a request joins (new, or resumed
after preemption), leaves, and gains tokens; each step it asks for the `SamplingMetadata` of the
requests that sample, in batch order. The tensors are built once per batch composition (keyed on the
tuple of request ids) and only the parts that change per step are refreshed: the min_tokens mask, the
output token counts of the penalties (updated in place by `append_output`) and the seeded generators.

Every tensor describes only the rows that use its feature and is None when no row does, so the
sampler skips the work of features nobody in the batch uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmplug.core.params import SamplingParams
from llmplug.core.protocols import LogitsProcessor

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, step: int) -> int:
    """The generator seed of output position `step` of a request seeded with `seed` (splitmix64).

    Reseeding per position (instead of letting one generator run on) makes a seeded request's draws
    depend only on its seed and position: the same in any batch, and after preemption and resume.
    """
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # torch seeds are at most 63 bits here


@dataclass(slots=True)
class RequestSamplingState:
    """What the worker remembers about one request's sampling."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the live list: the sampler's logits processors read it
    stop_ids: list[int]  # tokens masked while fewer than min_tokens are generated
    generator: torch.Generator | None  # only for seeded requests
    allowed_ids: torch.Tensor | None = None  # [K] int64, allowed_token_ids as a tensor, made once per request

    @property
    def uses_penalties(self) -> bool:
        """True when any of the three penalties is active."""
        p = self.params
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


@dataclass(slots=True)
class TokenMask:
    """(row, token) positions of the logits to set to -inf."""

    rows: torch.Tensor  # [N] int64, batch rows
    token_ids: torch.Tensor  # [N] int64


@dataclass(slots=True)
class AllowedTokens:
    """Rows that may only sample their allowed_token_ids."""

    rows: torch.Tensor  # [A] int64, batch rows
    forbidden: torch.Tensor  # [A, W] bool, True: not allowed; W = V (or the largest allowed id + 1 if V is unknown)


@dataclass(slots=True)
class LogitBias:
    """(row, token) positions of the logits and the values added there."""

    rows: torch.Tensor  # [N] int64, batch rows
    token_ids: torch.Tensor  # [N] int64
    values: torch.Tensor  # [N] float32


class TokenOccurrences:
    """The distinct (row, token) pairs of the penalized rows' prompt and output tokens, with output counts.

    Sparse on purpose: penalties only change tokens a request has seen, so the sampler gathers and
    scatters N entries per step instead of sweeping [P, V]. Grows in place as tokens are generated.
    """

    def __init__(
        self, prompts: list[list[int]], outputs: list[list[int]], vocab_size: int | None, device: torch.device
    ) -> None:
        # [P, W] pair index of each (row, token), -1: unseen; W = V, or grown to the largest id seen
        self._slot = torch.full((len(prompts), vocab_size or 1024), -1, dtype=torch.int64, device=device)
        self._rows = torch.empty(0, dtype=torch.int64, device=device)  # [capacity], penalty row
        self._token_ids = torch.empty(0, dtype=torch.int64, device=device)  # [capacity]
        self._counts = torch.empty(0, dtype=torch.float32, device=device)  # [capacity], output occurrences
        self.size = 0
        self.add(*_flatten([p + o for p, o in zip(prompts, outputs)], device), count=False)
        self.add(*_flatten(outputs, device))

    @property
    def rows(self) -> torch.Tensor:
        """[N] int64 penalty row of each pair."""
        return self._rows[: self.size]

    @property
    def token_ids(self) -> torch.Tensor:
        """[N] int64 token of each pair."""
        return self._token_ids[: self.size]

    @property
    def output_counts(self) -> torch.Tensor:
        """[N] float32 occurrences of each pair's token in its row's output (0: prompt only)."""
        return self._counts[: self.size]

    def add(self, rows: torch.Tensor, token_ids: torch.Tensor, count: bool = True) -> None:
        """Record tokens of rows [M], token_ids [M]; count them as output occurrences unless `count` is False."""
        if rows.numel() == 0:
            return
        self._widen(int(token_ids.max()) + 1)
        slots = self._slot[rows, token_ids]  # [M]
        new = slots < 0
        if bool(new.any()):
            self._append(torch.unique(rows[new] * self._slot.shape[1] + token_ids[new]))
            slots = self._slot[rows, token_ids]
        if count:
            self._counts.index_put_((slots,), torch.ones_like(slots, dtype=torch.float32), accumulate=True)

    def _append(self, keys: torch.Tensor) -> None:
        """Add new distinct pairs, given as row * W + token."""
        start, end, width = self.size, self.size + keys.numel(), self._slot.shape[1]
        self._reserve(end)
        self._rows[start:end] = keys // width
        self._token_ids[start:end] = keys % width
        self._counts[start:end] = 0.0
        self._slot[self._rows[start:end], self._token_ids[start:end]] = torch.arange(start, end, device=keys.device)
        self.size = end

    def _widen(self, width: int) -> None:
        """Make the slot map cover token ids below `width` (only when the vocabulary size is unknown)."""
        old = self._slot
        if width <= old.shape[1]:
            return
        self._slot = torch.full((old.shape[0], max(width, 2 * old.shape[1])), -1, dtype=old.dtype, device=old.device)
        self._slot[:, : old.shape[1]] = old

    def _reserve(self, capacity: int) -> None:
        """Grow the pair arrays (doubling) to hold `capacity` pairs."""
        if capacity <= self._rows.numel():
            return
        new_capacity = max(capacity, 2 * self._rows.numel(), 256)
        for name in ("_rows", "_token_ids", "_counts"):
            old = getattr(self, name)
            grown = old.new_empty(new_capacity)
            grown[: self.size] = old[: self.size]
            setattr(self, name, grown)


def _bad_word_ends(state: RequestSamplingState) -> list[int]:
    """The last token of each bad word whose other tokens the output ends with (so it must not come next)."""
    output = state.output_token_ids
    return [
        seq[-1]
        for seq in state.params.bad_words_token_ids
        if len(seq) <= len(output) + 1 and (len(seq) == 1 or output[len(output) - len(seq) + 1 :] == seq[:-1])
    ]


def _flatten(token_lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) of every token of every list: rows [M], token_ids [M]."""
    rows = [row for row, tokens in enumerate(token_lists) for _ in tokens]
    token_ids = [t for tokens in token_lists for t in tokens]
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(token_ids, dtype=torch.int64, device=device),
    )


@dataclass(slots=True)
class PenaltyTensors:
    """Penalties of the P rows that use any, with the tokens they have seen."""

    rows: torch.Tensor  # [P] int64, batch rows
    repetition: torch.Tensor  # [P] float32, 1.0: none
    frequency: torch.Tensor  # [P] float32
    presence: torch.Tensor  # [P] float32
    occurrences: TokenOccurrences  # grows as append_output reports tokens


@dataclass(slots=True)
class RandomSampling:
    """The rows that sample at random (temperature > 0), with filters indexed within that sub-batch."""

    rows: torch.Tensor  # [R] int64, batch rows
    temperature: torch.Tensor  # [R, 1] float32
    top_k_rows: torch.Tensor | None  # [K] int64 sub-batch rows using top-k; None: no row does
    top_k: torch.Tensor | None  # [K, 1] int64
    top_p: torch.Tensor | None  # [R] float32, 1.0 where unused; None: no row uses top-p
    min_p: torch.Tensor | None  # [R, 1] float32, 0.0 where unused; None: no row uses min-p
    generators: list[tuple[int, torch.Generator]]  # (sub-batch row, generator); others use torch's default

    @property
    def num_rows(self) -> int:
        """R, the number of rows that sample at random."""
        return int(self.rows.shape[0])


@dataclass(slots=True)
class SamplingMetadata:
    """Everything the sampler needs about one batch of B requests, in batch order."""

    req_ids: tuple[str, ...]
    random: RandomSampling | None  # None: every row is greedy
    all_random: bool  # no row is greedy, so the sampler need not take any argmax
    output_token_ids: list[list[int]]  # each row's live output list (for engine-wide processors)
    logits_processors: list[tuple[int, list[LogitsProcessor], list[int]]]  # (row, processors, output ids)
    allowed_tokens: AllowedTokens | None  # rows with allowed_token_ids
    logit_bias: LogitBias | None
    # refreshed every step: stop tokens of rows short of min_tokens, the next token of a bad word begun
    banned_tokens: TokenMask | None
    penalties: PenaltyTensors | None  # its occurrences grow with the tokens append_output reports
    max_num_logprobs: int | None  # None: no row wants logprobs

    @property
    def num_rows(self) -> int:
        """B, the number of requests in the batch."""
        return len(self.req_ids)


class SamplingState:
    """The worker's persistent per-request sampling state; builds batched SamplingMetadata."""

    def __init__(self, vocab_size: int | None = None, device: torch.device | str = "cpu") -> None:
        self.vocab_size = vocab_size  # None: unknown (penalties then grow their token map as ids arrive)
        self.device = torch.device(device)
        self.requests: dict[str, RequestSamplingState] = {}
        self._cached: SamplingMetadata | None = None
        self._penalty_rows: dict[str, int] = {}  # req_id -> row of the cached PenaltyTensors
        self._pending_occurrences: list[tuple[int, int]] = []  # (penalty row, token) since the last step

    def add_request(
        self,
        req_id: str,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        """Start tracking a request that is new or resumed after preemption (replaces any old state).

        Its token ids (stop_token_ids, logit_bias, ...) were checked against the vocabulary when it was added.
        """
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids += eos_token_ids
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
        allowed = self._long(params.allowed_token_ids) if params.allowed_token_ids else None
        self.requests[req_id] = RequestSamplingState(
            params, list(prompt_token_ids), list(output_token_ids), stop_ids, generator, allowed
        )
        self._invalidate_if_cached(req_id)

    def remove_request(self, req_id: str) -> None:
        """Forget a request (finished, aborted or preempted)."""
        self.requests.pop(req_id, None)
        self._invalidate_if_cached(req_id)

    def params(self, req_id: str) -> SamplingParams:
        """The SamplingParams of a tracked request."""
        return self.requests[req_id].params

    def append_output(self, req_id: str, token_ids: list[int]) -> None:
        """Record tokens just sampled for a request; call before the next `metadata`."""
        state = self.requests[req_id]
        state.output_token_ids.extend(token_ids)
        row = self._penalty_rows.get(req_id)
        if row is not None:
            self._pending_occurrences.extend((row, t) for t in token_ids)

    def metadata(self, req_ids: list[str]) -> SamplingMetadata:
        """The SamplingMetadata of the batch `req_ids`, in that order."""
        key = tuple(req_ids)
        if self._cached is None or self._cached.req_ids != key:
            self._cached = self._build(key)
        states = [self.requests[r] for r in key]
        self._flush_occurrences()
        self._cached.banned_tokens = self._banned_tokens(states)
        if self._cached.random is not None:
            self._reseed(states, self._cached.random)
        return self._cached

    # --- building, once per batch composition ---

    def _build(self, req_ids: tuple[str, ...]) -> SamplingMetadata:
        """Build the per-composition tensors of a batch."""
        states = [self.requests[r] for r in req_ids]
        random = self._random_sampling(states)
        logprobs = [s.params.logprobs for s in states if s.params.logprobs is not None]
        return SamplingMetadata(
            req_ids=req_ids,
            random=random,
            all_random=random is not None and random.num_rows == len(states),
            output_token_ids=[s.output_token_ids for s in states],
            logits_processors=[
                (i, list(s.params.logits_processors), s.output_token_ids)
                for i, s in enumerate(states)
                if s.params.logits_processors
            ],
            allowed_tokens=self._allowed_tokens(states),
            logit_bias=self._logit_bias(states),
            banned_tokens=None,
            penalties=self._penalties(req_ids, states),
            max_num_logprobs=max(logprobs) if logprobs else None,
        )

    def _random_sampling(self, states: list[RequestSamplingState]) -> RandomSampling | None:
        """The random rows' parameters, or None when every row is greedy."""
        rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if not rows:
            return None
        params = [states[i].params for i in rows]
        top_k_rows = [j for j, p in enumerate(params) if p.top_k is not None and p.top_k < (self.vocab_size or 1 << 62)]
        seeded = [j for j, i in enumerate(rows) if states[i].generator is not None]
        return RandomSampling(
            rows=self._long(rows),
            temperature=self._float([p.temperature for p in params]).unsqueeze(1),
            top_k_rows=self._long(top_k_rows) if top_k_rows else None,
            top_k=self._long([params[j].top_k for j in top_k_rows]).unsqueeze(1) if top_k_rows else None,
            top_p=self._float([p.top_p for p in params]) if any(p.top_p < 1.0 for p in params) else None,
            min_p=self._float([p.min_p for p in params]).unsqueeze(1) if any(p.min_p > 0 for p in params) else None,
            generators=[(j, states[rows[j]].generator) for j in seeded],
        )

    def _allowed_tokens(self, states: list[RequestSamplingState]) -> AllowedTokens | None:
        """The rows restricted to their allowed_token_ids, with what each forbids; None when no row is."""
        rows = [i for i, s in enumerate(states) if s.params.allowed_token_ids]
        if not rows:
            return None
        allowed = [states[i].allowed_ids for i in rows]  # tensors made when each request was added
        width = self.vocab_size or 1 + max(int(ids.max()) for ids in allowed)
        forbidden = torch.ones(len(rows), width, dtype=torch.bool, device=self.device)  # [A, V]
        for j, ids in enumerate(allowed):
            forbidden[j, ids] = False
        return AllowedTokens(self._long(rows), forbidden)

    def _logit_bias(self, states: list[RequestSamplingState]) -> LogitBias | None:
        """The logit_bias entries of every row, flattened; None when no row has any."""
        entries = [(i, t, v) for i, s in enumerate(states) for t, v in (s.params.logit_bias or {}).items()]
        if not entries:
            return None
        rows, token_ids, values = zip(*entries)
        return LogitBias(self._long(rows), self._long(token_ids), self._float(values))

    def _penalties(self, req_ids: tuple[str, ...], states: list[RequestSamplingState]) -> PenaltyTensors | None:
        """Penalty factors and seen tokens of the rows that use penalties."""
        rows = [i for i, s in enumerate(states) if s.uses_penalties]
        self._penalty_rows = {req_ids[i]: j for j, i in enumerate(rows)}
        self._pending_occurrences = []
        if not rows:
            return None
        used = [states[i] for i in rows]
        return PenaltyTensors(
            rows=self._long(rows),
            repetition=self._float([s.params.repetition_penalty for s in used]),
            frequency=self._float([s.params.frequency_penalty for s in used]),
            presence=self._float([s.params.presence_penalty for s in used]),
            occurrences=TokenOccurrences(
                [s.prompt_token_ids for s in used], [s.output_token_ids for s in used], self.vocab_size, self.device
            ),
        )

    # --- refreshing, every step ---

    def _banned_tokens(self, states: list[RequestSamplingState]) -> TokenMask | None:
        """The (row, token) pairs no row may sample this step; None when there are none."""
        pairs: list[tuple[int, int]] = []
        for i, s in enumerate(states):
            if len(s.output_token_ids) < s.params.min_tokens:
                pairs += [(i, t) for t in s.stop_ids]
            if s.params.bad_words_token_ids:
                pairs += [(i, t) for t in _bad_word_ends(s)]
        if not pairs:
            return None
        rows, token_ids = zip(*pairs)
        return TokenMask(self._long(rows), self._long(token_ids))

    def _flush_occurrences(self) -> None:
        """Count the tokens appended since the last step into the cached penalties, in one batched update."""
        pending, self._pending_occurrences = self._pending_occurrences, []
        if pending and self._cached is not None and self._cached.penalties is not None:
            rows, token_ids = zip(*pending)
            self._cached.penalties.occurrences.add(self._long(rows), self._long(token_ids))

    def _reseed(self, states: list[RequestSamplingState], random: RandomSampling) -> None:
        """Position every seeded generator at its request's current output position."""
        random_states = [s for s in states if not s.params.greedy]  # sub-batch row j is the j-th of them
        for j, generator in random.generators:
            state = random_states[j]
            generator.manual_seed(step_seed(state.params.seed, len(state.output_token_ids)))

    # --- helpers ---

    def _invalidate_if_cached(self, req_id: str) -> None:
        """Drop the cached batch when it contains `req_id`, whose state just changed."""
        if self._cached is not None and req_id in self._cached.req_ids:
            self._cached = None
            self._penalty_rows = {}
            self._pending_occurrences = []

    def _long(self, values) -> torch.Tensor:
        """An int64 tensor on this state's device."""
        return torch.tensor(list(values), dtype=torch.int64, device=self.device)

    def _float(self, values) -> torch.Tensor:
        """A float32 tensor on this state's device."""
        return torch.tensor(list(values), dtype=torch.float32, device=self.device)
