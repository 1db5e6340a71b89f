"""The vectorized sampler: logits of a batch -> one token per request (and logprobs when asked).

Order of one step (as vLLM): per-request logits processors, the batched token bitmask of guided
decoding, allowed_token_ids, logit_bias, banned tokens (min_tokens, bad_words), repetition /
frequency / presence penalties, the engine-wide processors of the `llmplug_logits_processors` hook,
logprobs, then greedy rows take the argmax and random rows go through temperature, top-k, top-p,
min-p and sampling.

Logprobs (a choice): the log-softmax of the logits after everything above (processors, bitmask,
bias, min_tokens, penalties) and before temperature and the top-k/top-p/min-p filters, i.e. the
model's distribution as the request shaped it, independent of how it is then sampled. vLLM's default
("raw_logprobs") is taken before any shaping; here tokens a grammar or min_tokens forbids show -inf.

Sampling draws one uniform number per row and inverts the CDF in two levels (blocks of 128 tokens,
then tokens), so it costs one exp over the batch rather than one random number per vocabulary entry.
Top-p never sorts: a token is drawn from the top-k/min-p filtered distribution and accepted when it
lies in the nucleus (the mass of strictly more likely tokens is below top_p); otherwise the tokens at
or below it are excluded and the row draws again. Each draw is accepted with probability >= top_p,
and the accepted token follows exactly the renormalized nucleus distribution (all tokens tied with
the nucleus boundary belong to it). Rows with a seed draw from their own generator, which
`SamplingState` reseeds from (seed, output position) every step, so a seeded row gives the same
tokens alone or in any batch; other rows share one batched draw from torch's default generator.

The sampler modifies `logits` in place, as the model runner no longer needs them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch

from llmplug.core.protocols import LogitsProcessor
from llmplug.engine.core_outputs import LogprobsLists
from llmplug.engine.sampling_state import (
    AllowedTokens,
    LogitBias,
    PenaltyTensors,
    RandomSampling,
    SamplingMetadata,
    TokenMask,
)
from llmplug.layers.kernels import use_triton
from llmplug.layers.kernels.native import ops, use_native

BLOCK = 128  # tokens per block of the two-level argmax and CDF inversion
_NEG_INF = float("-inf")
_FLT_MIN = 2.0**-126  # the smallest normal float32
_JUST_BELOW_ONE = 1.0 - 2.0**-24  # the float32 right below 1: "> this" means ">= 1"


@dataclass(slots=True)
class LogprobsTensors:
    """Logprobs of N positions: the chosen token first, then the top-k of the distribution."""

    logprob_token_ids: torch.Tensor  # [N, 1 + k] int64
    logprobs: torch.Tensor  # [N, 1 + k] float32
    selected_token_ranks: torch.Tensor  # [N] int64, 1: the most likely (ties count as better)

    def tolists(self) -> LogprobsLists:
        """The same data as Python lists, to send to the engine process."""
        return LogprobsLists(
            self.logprob_token_ids.tolist(), self.logprobs.tolist(), self.selected_token_ranks.tolist()
        )

    def row(self, index: int) -> LogprobsLists:
        """Position `index` alone (one request's row of a batch), as lists."""
        return LogprobsLists(
            [self.logprob_token_ids[index].tolist()],
            [self.logprobs[index].tolist()],
            [int(self.selected_token_ranks[index])],
        )


@dataclass(slots=True)
class SamplerOutput:
    """The sampler's result for a batch of B requests."""

    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # None when no request asked for logprobs
    # [B] bool, on the logits' device: the row's shaped logits hold NaN or +inf, or mask every token (its token is junk)
    unsampleable: torch.Tensor
    # rows whose logits processor raised: why (their token is junk too)
    failed_rows: dict[int, str] = field(default_factory=dict)


class Sampler:
    """Turns a batch's logits into sampled tokens, following each request's SamplingParams."""

    def __init__(self, logits_processors: Sequence[LogitsProcessor] = ()) -> None:
        # Engine-wide processors (the llmplug_logits_processors hook): every row, after its own shaping.
        self.logits_processors = list(logits_processors)
        self._buffers: dict[str, torch.Tensor] = {}  # reused [rows, V] scratch: fresh ones page-fault

    def __call__(
        self, logits: torch.Tensor, metadata: SamplingMetadata, bitmask: torch.Tensor | None = None
    ) -> SamplerOutput:
        """Sample one token per row of `logits` [B, V] float32 (modified in place).

        A row that cannot be sampled fails alone and the batch's other rows sample as usual: a row whose
        logits processor raised is reported in `failed_rows`; a row whose logits (as the request shaped
        them) hold NaN or +inf, or mask every token, in `unsampleable`. That check costs no extra pass
        over the logits: it reads the block maxima the argmax computes anyway (and, for random rows, the
        total weight their sampling computes), and sampling is safe on such rows, so no host sync is needed.
        """
        failed: dict[int, str] = {}
        logits = self._shape_logits(logits, metadata, bitmask, failed)
        logprobs = None
        if metadata.max_num_logprobs is not None:  # [B, V], before temperature
            logprobs = torch.ops.aten._log_softmax.out(logits, -1, False, out=self._buffer("lp", len(logits), logits))
        sampled, sampleable = self._sample(logits, metadata)
        if logprobs is not None:
            logprobs = gather_logprobs(logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, logprobs, ~sampleable, failed)

    def _shape_logits(
        self, logits: torch.Tensor, metadata: SamplingMetadata, bitmask: torch.Tensor | None, failed: dict[int, str]
    ) -> torch.Tensor:
        """Apply what the request asks of the distribution itself (not of how it is sampled)."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        apply_logits_processors(logits, metadata.logits_processors, failed)
        if bitmask is not None:
            apply_token_bitmask(logits, bitmask)
        if metadata.allowed_tokens is not None:
            apply_allowed_tokens(logits, metadata.allowed_tokens)
        if metadata.logit_bias is not None:
            apply_logit_bias(logits, metadata.logit_bias)
        if metadata.banned_tokens is not None:
            apply_token_mask(logits, metadata.banned_tokens)
        if metadata.penalties is not None:
            apply_penalties(logits, metadata.penalties)
        if self.logits_processors:
            every_row = [(row, self.logits_processors, ids) for row, ids in enumerate(metadata.output_token_ids)]
            apply_logits_processors(logits, every_row, failed)
        return logits

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy rows take the argmax, random rows sample: tokens [B] int64, and which rows could be [B] bool."""
        random = metadata.random
        if metadata.all_random:
            return self._sample_random(logits, random)
        sampled, top = greedy(logits)  # [B] each; for every row: cheaper than gathering the greedy rows first
        sampleable = torch.isfinite(top)  # [B]: no NaN, no +inf, not every token -inf
        if random is not None:
            x = torch.index_select(logits, 0, random.rows, out=self._buffer("x", random.num_rows, logits))
            random_tokens, random_ok = self._sample_random(x, random)
            sampled[random.rows] = random_tokens
            sampleable[random.rows] &= random_ok
        return sampled, sampleable

    def _sample_random(self, x: torch.Tensor, random: RandomSampling) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample each row of x [R, V] (modified in place) after temperature and filters: [R] int64, and
        whether each row's sampling weights were finite and positive [R] bool."""
        x.div_(random.temperature)
        if random.top_k is not None:
            apply_top_k(x, random.top_k_rows, random.top_k)
        probs = torch.ops.aten._softmax.out(x, -1, False, out=self._buffer("w", random.num_rows, x))  # [R, V]
        proposal = probs
        if random.min_p is not None:
            proposal = min_p_weights(probs, random.min_p, out=self._buffer("p", random.num_rows, x))
        uniforms = draw_uniforms(random, list(range(random.num_rows)), x.device)
        tokens, weight = inverse_cdf_sample(proposal, uniforms)
        ok = torch.isfinite(weight) & (weight > 0)  # softmax of a NaN, +inf or all -inf row is all NaN
        if random.top_p is None:
            return tokens, ok
        return self._resample_outside_nucleus(probs, tokens, random, ok), ok

    def _resample_outside_nucleus(
        self, probs: torch.Tensor, tokens: torch.Tensor, random: RandomSampling, ok: torch.Tensor
    ) -> torch.Tensor:
        """Redraw the rows whose token lies outside their nucleus until none does (rows not `ok` never): [R] int64."""
        rows = torch.arange(random.num_rows, device=probs.device)  # [A], sub-batch rows still drawing
        top_p, total, done = random.top_p, row_sums(probs), ~ok | (random.top_p >= 1.0)  # [A]
        while True:
            above = mass_above(probs, tokens[rows], out=self._buffer("a", rows.numel(), probs))  # [A, V]
            chosen = probs.gather(1, tokens[rows, None]).squeeze(1)  # [A]
            mass = row_sums(above) * chosen  # [A], of the strictly more likely tokens
            # the most likely token is always inside, also when top_p rounds to 0 in float32 (else: no end)
            inside = (mass < top_p * total) | (mass == 0) | done
            if bool(inside.all()):
                return tokens
            redraw = (~inside).nonzero().squeeze(1)  # [A']
            # Every nucleus token is more likely than the rejected one, so the next proposal keeps only
            # the tokens strictly above it (min-p and top-k hold there too): exactly `above`.
            proposal, probs = above[redraw], probs[redraw]
            rows, top_p, total, done = rows[redraw], top_p[redraw], total[redraw], done[redraw]
            tokens[rows] = inverse_cdf_sample(proposal, draw_uniforms(random, rows.tolist(), probs.device))[0]

    def _buffer(
        self, name: str, rows: int, like: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """A reusable scratch tensor [rows, like.shape[1]] (grown on demand)."""
        dtype, cols = dtype or like.dtype, like.shape[1]
        buf = self._buffers.get(name)
        fits = buf is not None and buf.shape[0] >= rows and buf.shape[1] == cols
        if not fits or buf.dtype != dtype or buf.device != like.device:
            buf = torch.empty(max(rows, 1), cols, dtype=dtype, device=like.device)
            self._buffers[name] = buf
        return buf[:rows]


# --- shaping the distribution ---


def apply_logits_processors(
    logits: torch.Tensor, processors: list[tuple[int, list[LogitsProcessor], list[int]]], failed: dict[int, str]
) -> None:
    """Run each request's LogitsProcessors on its row, in order; a processor that raises fails its row only."""
    for row, procs, output_token_ids in processors:
        if row in failed:
            continue
        values = logits[row]  # [V], a view
        try:
            for proc in procs:
                values = proc(output_token_ids, values)
            if values.data_ptr() != logits[row].data_ptr():
                logits[row] = values
        except Exception as error:  # user code: whatever it raises must not take the batch down
            failed[row] = f"logits processor {getattr(proc, '__name__', type(proc).__name__)} raised {error!r}"
            logits[row] = 0.0


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf every token whose bit is 0 in `bitmask` [B, ceil(V/32)] int32 (xgrammar layout).

    Bit j of word i is token 32 * i + j. Rows whose bits are all 1 are left alone; tokens past the
    bitmask's width count as disallowed. The words are read as little-endian bytes, each expanded to its
    8 bits by one table lookup: a quarter of the memory traffic of shifting every int32 word 32 times.
    On a GPU one Triton kernel reads the bits in place (`use_triton`).
    """
    bitmask = bitmask.to(logits.device, non_blocking=True)  # the engine builds it on the CPU
    if use_triton(logits):
        from llmplug.layers.kernels.bitmask import apply_token_bitmask_

        apply_token_bitmask_(logits, bitmask)
        return
    constrained = (bitmask != -1).any(dim=-1).nonzero().squeeze(1)  # [C]
    num_constrained, vocab = constrained.numel(), logits.shape[1]
    if num_constrained == 0:
        return
    every_row = num_constrained == len(logits)
    words = bitmask if every_row else bitmask[constrained]  # [C, W], contiguous
    allowed = _byte_bits(logits.device)[words.view(torch.uint8).long()].view(num_constrained, -1)  # [C, 32 W]
    allowed = allowed[:, :vocab]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    if every_row:  # in place, no gather and scatter of the rows
        logits.masked_fill_(~allowed, _NEG_INF)
        return
    rows = logits[constrained]
    rows.masked_fill_(~allowed, _NEG_INF)
    logits[constrained] = rows


@functools.lru_cache(maxsize=8)
def _byte_bits(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: bit k of each byte value (little-endian words: byte k of word i holds tokens 32 i + 8 k...)."""
    values = torch.arange(256, dtype=torch.int32)
    return ((values.unsqueeze(1) >> torch.arange(8, dtype=torch.int32)) & 1).bool().to(device)


def apply_allowed_tokens(logits: torch.Tensor, allowed: AllowedTokens) -> None:
    """Set to -inf every token outside each restricted row's allowed_token_ids."""
    forbidden, vocab = allowed.forbidden, logits.shape[1]
    if forbidden.shape[1] < vocab:  # the vocabulary size was unknown: ids past the widest are not allowed either
        forbidden = torch.nn.functional.pad(forbidden, (0, vocab - forbidden.shape[1]), value=True)
    rows = logits[allowed.rows]  # [A, V]
    logits[allowed.rows] = rows.masked_fill_(forbidden, _NEG_INF)


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> None:
    """Add each request's logit_bias values."""
    logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """Forbid the (row, token) positions of `mask`."""
    logits.index_put_((mask.rows, mask.token_ids), torch.tensor(_NEG_INF, device=logits.device))


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> None:
    """Repetition penalty over prompt and output tokens (HF), frequency and presence over output (OpenAI).

    Only the tokens each row has seen are touched: gather them, penalize, scatter back.
    """
    occ = penalties.occurrences
    rows, token_ids, counts = penalties.rows[occ.rows], occ.token_ids, occ.output_counts  # [N] each
    values = logits[rows, token_ids]  # [N]
    repetition = penalties.repetition[occ.rows]
    values = torch.where(values > 0, values / repetition, values * repetition)
    values -= penalties.frequency[occ.rows] * counts + penalties.presence[occ.rows] * (counts > 0)
    logits[rows, token_ids] = values


# --- sampling ---


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise argmax (first index of the maximum) of logits [B, V] float32 and the maximum: [B] int64, [B]
    float32 (NaN for a row holding a NaN, whose index is then some column in range). One kernel call on the CPU
    (llmplug's, `use_native`), else the two-level `argmax` below."""
    if use_native(logits) and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        return ops().greedy(logits)
    maxima = _block_reduce(logits, "amax")  # [B, NB]; NaN propagates through max
    return argmax(logits, maxima), maxima.amax(dim=-1)


def argmax(logits: torch.Tensor, maxima: torch.Tensor | None = None) -> torch.Tensor:
    """Row-wise argmax (first index of the maximum) of logits [B, V]: [B] int64.

    Two levels, block maxima (`maxima` [B, NB] if the caller has them) then the winning block, because a
    plain argmax over the vocabulary is several times slower on CPU than the vectorized max reduction.
    A row holding NaN gets some index in range.
    """
    maxima = _block_reduce(logits, "amax") if maxima is None else maxima  # [B, NB]
    block = maxima.argmax(dim=-1)  # [B]
    cols, _ = _block_columns(block, logits.shape[1])  # [B, BLOCK]; repeats of V - 1 never win first
    return cols.gather(1, logits.gather(1, cols).argmax(dim=-1, keepdim=True)).squeeze(1)


def apply_top_k(x: torch.Tensor, rows: torch.Tensor, top_k: torch.Tensor) -> None:
    """Set to -inf what is below the k-th largest value of each listed row (rows [K], top_k [K, 1]).

    The kept rows come back shifted by their k-th value (softmax does not care), so that one
    in-place threshold, much faster on CPU than masked_fill, can cut every row at 0.
    """
    sub = x[rows]  # [K, V]
    top_k = top_k.clamp(max=sub.shape[1])  # k >= V keeps everything
    kth = sub.topk(int(top_k.max()), dim=-1).values.gather(1, top_k - 1)  # [K, 1]
    if bool(torch.isneginf(kth).any()):  # fewer than k tokens allowed (bitmask, bias): keep them all
        smallest = torch.where(torch.isneginf(sub), float("inf"), sub).amin(dim=-1, keepdim=True)
        kth = torch.where(torch.isneginf(kth), smallest, kth)
    # x - kth >= 0 exactly when x >= kth; -FLT_MIN as the cut is immune to flush-to-zero.
    torch.nn.functional.threshold_(sub.sub_(kth), -_FLT_MIN, _NEG_INF)
    x[rows] = sub


def min_p_weights(probs: torch.Tensor, min_p: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Sampling weights of probs [R, V] with tokens below min_p x the row's top probability set to 0.

    Each row is divided by its cut, so one threshold at 1 serves all rows; the division is exact at the
    boundary (p >= cut iff p / cut >= 1 in IEEE arithmetic). Rows without min-p (0) are divided by
    FLT_MIN instead, which only drops probabilities below 1e-38. The result is scaled per row, which
    the CDF inversion ignores.
    """
    cut = min_p * probs.amax(dim=-1, keepdim=True)  # [R, 1]
    cut = torch.where(min_p > 0, cut, torch.full_like(cut, _FLT_MIN))
    return torch.nn.functional.threshold_(torch.div(probs, cut, out=out), _JUST_BELOW_ONE, 0.0)


def mass_above(probs: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """probs [A, V] / probs of tokens [A], with every entry not strictly above 1 set to 0: [A, V].

    Row sums times the chosen probability are the mass of the strictly more likely tokens; p / c > 1
    holds exactly when p > c in IEEE arithmetic, and one threshold is far cheaper than torch.where.
    """
    chosen = probs.gather(1, tokens[:, None])  # [A, 1]
    return torch.nn.functional.threshold_(torch.div(probs, chosen, out=out), 1.0, 0.0)


def draw_uniforms(random: RandomSampling, rows: list[int], device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per listed sub-batch row, seeded rows from their own generator: [len(rows)]."""
    uniforms = torch.rand(len(rows), device=device)
    generators = dict(random.generators)
    for pos, row in enumerate(rows):
        generator = generators.get(row)
        if generator is not None:
            uniforms[pos] = torch.rand(1, generator=generator, device=generator.device)[0]
    return uniforms


def inverse_cdf_sample(weights: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample a token per row with probability proportional to weights [R, V] (>= 0): tokens [R] int64 and each
    row's total weight [R]. A row of NaN weights gets some token in range (and a NaN total)."""
    block_mass = _block_reduce(weights, "sum")  # [R, NB]
    block_cdf = block_mass.cumsum(dim=-1)  # [R, NB]
    total = block_cdf[:, -1:]  # [R, 1]
    # Clamp below the total so rounding can never pick a block (or token) of zero mass.
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, target, right=True)  # [R, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)  # [R, 1]
    cols, valid = _block_columns(block.squeeze(1), weights.shape[1])  # [R, BLOCK]
    inner_cdf = (weights.gather(1, cols) * valid).cumsum(dim=-1)  # [R, BLOCK]
    inner_total = inner_cdf[:, -1:]
    inner_target = (target - before).clamp(min=0.0)
    inner_target = torch.minimum(inner_target, torch.nextafter(inner_total, torch.zeros_like(inner_total)))
    token = torch.searchsorted(inner_cdf, inner_target, right=True).clamp_(max=BLOCK - 1)  # [R, 1]; NaN: past the end
    return cols.gather(1, token).squeeze(1), total.squeeze(1)


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """Sum of each row of x [R, V] -> [R], in an order that does not depend on R: block sums, then their sum.

    A plain sum over one long row is split across threads, and so sums in another order than the
    same row among others (batch invariance, docs/determinism.md).
    """
    return _block_reduce(x, "sum").sum(dim=-1)


def _block_reduce(x: torch.Tensor, op: str) -> torch.Tensor:
    """Reduce x [R, V] over blocks of BLOCK columns ("amax" or "sum"); a short last block too: [R, NB]."""
    rows, vocab = x.shape
    full = vocab // BLOCK * BLOCK
    reduce = getattr(torch, op)
    head = reduce(x[:, :full].view(rows, full // BLOCK, BLOCK), dim=-1)  # [R, V // BLOCK]
    if full == vocab:
        return head
    return torch.cat([head, reduce(x[:, full:], dim=-1, keepdim=True)], dim=-1)


def _block_columns(block: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column indices of each row's block [R] -> [R, BLOCK], and which are real (the last may be short).

    Columns past the vocabulary repeat V - 1, so gathers stay in range.
    """
    cols = block[:, None] * BLOCK + torch.arange(BLOCK, device=block.device)
    valid = cols < vocab
    return cols.clamp_(max=vocab - 1), valid


# --- logprobs ---


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """The chosen tokens' logprobs and ranks plus the top-k of logprobs [N, V] (overwritten)."""
    chosen = logprobs.gather(1, token_ids[:, None])  # [N, 1]
    top_values, top_ids = top_k(logprobs, k)  # [N, k]
    return LogprobsTensors(
        logprob_token_ids=torch.cat([token_ids[:, None], top_ids], dim=1),
        logprobs=torch.cat([chosen, top_values], dim=1),
        selected_token_ranks=_count_at_least_(logprobs, chosen),
    )


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of x [N, V] and their indices, largest first: [N, k] each.

    Two levels, like `argmax`: the k largest values lie in the k blocks with the largest maxima, so a
    full-width topk (slow on CPU) runs only over those k * BLOCK candidates.
    """
    rows, vocab = x.shape
    if k == 0 or k * BLOCK * 4 > vocab:
        return x.topk(k, dim=-1)
    blocks = _block_reduce(x, "amax").topk(k, dim=-1).indices  # [N, k]
    cols, valid = _block_columns(blocks.reshape(-1), vocab)  # [N k, BLOCK]
    cols, valid = cols.view(rows, k * BLOCK), valid.view(rows, k * BLOCK)
    candidates = x.gather(1, cols).masked_fill_(~valid, _NEG_INF)  # [N, k BLOCK]
    values, picked = candidates.topk(k, dim=-1)
    return values, cols.gather(1, picked)


def _count_at_least_(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """How many entries of each row of x [N, V] are >= values [N, 1] (x is overwritten): [N] int64.

    x - v < 0 exactly when x < v, so sign(min(x - v, 0)) is -1 for each smaller entry; in-place float
    ops are several times faster on CPU than a comparison into a new bool tensor.
    """
    smaller = -x.sub_(values).clamp_(max=0.0).sign_().sum(dim=-1)  # [N]
    return (x.shape[1] - smaller).to(torch.int64)


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Logprobs of each prompt position's next token (target_token_ids [N]) from logits [N, V], with top-k."""
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), target_token_ids, k)
