"""Prove an attention backend (an `llmplug.attention` plugin) against dense attention, as llmplug's own backends are.

`check_attention_backend(backend)` binds small `Attention` layers to the backend, runs them through the steps a
request takes in the engine — batched and single prompts, chunked prefill across block boundaries, decodes while the
batch changes, a prefix-cache hit on another request's blocks — and compares every output row with `reference`:
plain masked softmax attention over each request's whole history (scale, soft-cap, ALiBi, sliding window, chunked
local attention, sinks; llmplug's tests check it against transformers' own eager attention and mask functions). It
runs each scenario of `SCENARIOS` whose features the backend lists in `supported_features` (the plain one always),
for GQA ratios 1 and 4 and block sizes 4 and 16; checks that binding a layer with a feature the backend does not
list is refused; and, for a backend that says `supports_batch_invariant`, that each request's rows under
`batch_invariant=True` are bitwise the same alone and inside a batch. `torch_sdpa` and `triton` pass it
(tests/layers/test_attention_conformance.py), so a backend that passes agrees with them within `atol`.

A failure raises an AssertionError naming the scenario, the step and the largest difference; the returned
`AttentionReport` lists what ran and what was skipped (features the backend does not implement).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

import torch

from llmplug.layers.attention import Attention, AttentionBackend, alibi_slopes, bind_kv_cache
from llmplug.layers.forward_context import CommonAttentionMetadata, forward_context

__all__ = ["SCENARIOS", "AttentionFeatures", "AttentionReport", "History", "check_attention_backend", "lifecycle",
           "make_layer", "reference", "requests", "step"]

HEAD_DIM = 8
SOFTCAP = 2.0  # scores have std ~1 here, so tanh bends them visibly


@dataclass(frozen=True)
class AttentionFeatures:
    """The optional features a test layer uses (`Attention`'s arguments)."""

    window: int | None = None  # sliding_window
    softcap: float | None = None  # logit_softcap
    alibi: bool = False
    sinks: bool = False
    latent: int | None = None  # values_in_keys: the values are the keys' first `latent` dims (one KV head)
    chunk: int | None = None  # attention_chunk: keys of the query's own chunk only (Llama 4)

    def names(self) -> frozenset[str]:
        """The `Attention.features` names these give (what a backend must list in `supported_features`)."""
        named = {"sliding_window": self.window, "logit_softcap": self.softcap, "alibi": self.alibi or None,
                 "sinks": self.sinks or None, "values_in_keys": self.latent, "chunked": self.chunk}
        return frozenset(name for name, value in named.items() if value is not None)

    def within(self, supported: frozenset[str]) -> AttentionFeatures:
        """These features less the ones a backend does not list in `supported`."""
        names = self.names() & supported
        return AttentionFeatures(
            window=self.window if "sliding_window" in names else None,
            softcap=self.softcap if "logit_softcap" in names else None,
            alibi=self.alibi and "alibi" in names, sinks=self.sinks and "sinks" in names,
            latent=self.latent if "values_in_keys" in names else None,
            chunk=self.chunk if "chunked" in names else None,
        )


def make_layer(
    heads: int, kv_heads: int, block: int, features: AttentionFeatures, num_blocks: int = 256,
    backend: type[AttentionBackend] | None = None,
) -> Attention:
    """An Attention layer of `heads` query heads over a zeroed cache of `num_blocks` blocks, bound to `backend`
    (torch_sdpa when None); sinks, when used, are random."""
    if backend is None:
        from llmplug.layers.attention.torch_sdpa import TorchSDPABackend

        backend = TorchSDPABackend
    layer = Attention(
        heads, HEAD_DIM, HEAD_DIM**-0.5, kv_heads, prefix="layers.0.attn", sliding_window=features.window,
        logit_softcap=features.softcap, alibi_slopes=alibi_slopes(heads) if features.alibi else None,
        use_sinks=features.sinks, values_in_keys=features.latent, attention_chunk=features.chunk,
    )
    if features.sinks:
        with torch.no_grad():
            layer.sinks.copy_(torch.randn(heads, generator=torch.Generator().manual_seed(7)) * 2)
    bind_kv_cache(layer, [torch.zeros(backend.layer_kv_cache_shape(layer, num_blocks, block))], backend)
    return layer


class History:
    """One request: q, k, v of every position, its blocks so far, and how many tokens are cached."""

    def __init__(
        self, length: int, heads: int, kv_heads: int, gen: torch.Generator, free: list[int], block: int,
        latent: int | None = None,
    ) -> None:
        self.q = torch.randn(length, heads * HEAD_DIM, generator=gen)
        self.k = torch.randn(length, kv_heads * HEAD_DIM, generator=gen)
        self.v = torch.randn(length, kv_heads * HEAD_DIM, generator=gen) if latent is None else self.k[:, :latent]
        self.free, self.block, self.blocks, self.computed = free, block, [], 0

    def share_prefix(self, other: History, num_blocks: int) -> None:
        """A prefix-cache hit: `other`'s first blocks (same tokens, so the same keys) hold this one's start."""
        n = num_blocks * self.block
        self.k[:n], self.v[:n] = other.k[:n], other.v[:n]
        self.blocks, self.computed = list(other.blocks[:num_blocks]), n

    def schedule(self, num_tokens: int) -> tuple[int, int]:
        """Positions [start, stop) of the next `num_tokens`, with blocks taken from the free list as needed."""
        start, stop = self.computed, self.computed + num_tokens
        while len(self.blocks) * self.block < stop:
            self.blocks.append(self.free.pop())
        return start, stop


def requests(n: int, layer: Attention, block: int, length: int = 96, seed: int = 0,
             num_blocks: int = 256) -> list[History]:
    """`n` requests of `length` random positions sharing one free list of blocks, handed out of order."""
    gen, free = torch.Generator().manual_seed(seed), list(range(1, num_blocks))
    random.Random(seed).shuffle(free)  # blocks out of order, as after reuse
    return [History(length, layer.num_heads, layer.num_kv_heads, gen, free, block, layer.values_in_keys)
            for _ in range(n)]


def reference(layer: Attention, r: History, start: int, stop: int) -> torch.Tensor:
    """Dense attention of positions [start, stop) over keys [0, stop): scale, cap, ALiBi, mask, softmax with sink."""
    heads, g = layer.num_heads, layer.num_queries_per_kv
    q = r.q[start:stop].view(-1, heads, HEAD_DIM).transpose(0, 1)  # [H, n, D]
    k = r.k[:stop].view(stop, -1, HEAD_DIM).transpose(0, 1).repeat_interleave(g, 0)  # [H, stop, D]
    v = r.v[:stop].view(stop, layer.num_kv_heads, -1).transpose(0, 1).repeat_interleave(g, 0)
    scores = q @ k.transpose(1, 2) * layer.scale
    if layer.logit_softcap is not None:
        scores = layer.logit_softcap * torch.tanh(scores / layer.logit_softcap)
    i, j = torch.arange(start, stop)[:, None], torch.arange(stop)[None, :]
    if layer.alibi_slopes is not None:
        scores = scores + layer.alibi_slopes[:, None, None] * (j - i)
    seen = j <= i
    if layer.sliding_window is not None:
        seen &= j > i - layer.sliding_window
    if layer.attention_chunk is not None:
        seen &= j // layer.attention_chunk == i // layer.attention_chunk
    scores = scores.masked_fill(~seen, float("-inf"))
    if layer.sinks is not None:
        scores = torch.cat([scores, layer.sinks[:, None, None].expand(-1, stop - start, 1)], dim=-1)
    probs = scores.softmax(-1)[..., :stop]
    return (probs @ v).transpose(0, 1).reshape(stop - start, -1)


def _metadata(reqs: list[History], spans: list[tuple[int, int]], batch_invariant: bool) -> CommonAttentionMetadata:
    """The flattened step computing positions spans[i] of reqs[i], as the model runner builds it."""
    block, num_tokens = reqs[0].block, [b - a for a, b in spans]
    width = max(len(r.blocks) for r in reqs)
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.cumsum(torch.tensor(num_tokens), 0).tolist()]),
        seq_lens=torch.tensor([b for _, b in spans]),
        num_computed_tokens=torch.tensor([a for a, _ in spans]),
        block_tables=torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in reqs]),
        slot_mapping=torch.tensor(
            [r.blocks[p // block] * block + p % block for r, (a, b) in zip(reqs, spans) for p in range(a, b)]
        ),
        positions=torch.tensor([p for a, b in spans for p in range(a, b)]),
        block_size=block, num_reqs=len(reqs), num_tokens=sum(num_tokens), max_query_len=max(num_tokens),
        max_seq_len=max(b for _, b in spans), query_lens_list=tuple(num_tokens),
        seq_lens_list=tuple(b for _, b in spans), batch_invariant=batch_invariant,
    )


def _run(layer: Attention, reqs: list[History], spans: list[tuple[int, int]], dtype: torch.dtype,
         batch_invariant: bool = False) -> torch.Tensor:
    """The layer's output for one step (keys written to the cache as a side effect)."""
    q, k, v = (torch.cat([getattr(r, name)[a:b] for r, (a, b) in zip(reqs, spans)]) for name in "qkv")
    qkv = torch.cat([q, k, v], dim=1)  # k and v as views of one projection output, as the decoder passes them
    q, k, v = qkv.to(dtype).split([q.shape[1], k.shape[1], v.shape[1]], dim=1)
    with torch.inference_mode(), forward_context(layer.backend.build_metadata(_metadata(reqs, spans,
                                                                                        batch_invariant))):
        return layer(q, k, None if layer.values_in_keys else v)


def step(layer: Attention, reqs: list[History], num_tokens: list[int], dtype: torch.dtype = torch.float32,
         atol: float = 2e-5) -> None:
    """One flattened step of num_tokens[i] tokens of each request, every output row checked against `reference`."""
    spans = [r.schedule(n) for r, n in zip(reqs, num_tokens)]
    out = _run(layer, reqs, spans, dtype)
    expected = torch.cat([reference(layer, r, a, b) for r, (a, b) in zip(reqs, spans)])
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=atol,
                               msg=lambda m: f"step of {num_tokens} tokens at positions {spans}: {m}")
    for r, (_, b) in zip(reqs, spans):
        r.computed = b


def lifecycle(layer: Attention, block: int, window: int, dtype: torch.dtype = torch.float32,
              atol: float = 2e-5, num_blocks: int = 256) -> None:
    """Prompts, a chunked prompt, decodes with batch changes and a prefix hit, every step checked. `window` sizes
    the steps so windows and chunks of that many keys are crossed (no request goes past 2 * window + 3 * block +
    15 positions); the layer's cache holds `num_blocks` blocks."""
    r0, r1, r2, r3 = requests(4, layer, block, length=2 * window + 3 * block + 16, num_blocks=num_blocks)
    step(layer, [r0, r1], [window + 5, 3], dtype, atol)  # two prompts: padded batch, one longer than the window
    step(layer, [r2], [5], dtype, atol)  # one prompt, nothing cached
    step(layer, [r0, r2, r1], [1, 7, 1], dtype, atol)  # decodes around a chunk with 5 tokens of context
    for _ in range(window + block + 2):  # r1 grows past the window; blocks fill up
        step(layer, [r0, r1], [1, 1], dtype, atol)
    step(layer, [r2, r0, r1], [2 * block + 1, 1, 1], dtype, atol)  # a chunk across block boundaries between decodes
    r3.share_prefix(r0, r0.computed // block)
    step(layer, [r3, r2], [4, 1], dtype, atol)  # prefix hit of r0's full blocks: a context longer than the window
    for _ in range(block + 1):
        step(layer, [r3, r0, r2], [1, 1, 1], dtype, atol)
    step(layer, [r0, r3], [1, 1], dtype, atol)  # a request left


@dataclass(frozen=True)
class Scenario:
    """One conformance run: a layer with these features through `lifecycle` (steps sized by `window`)."""

    name: str
    features: AttentionFeatures
    window: int = 6  # the step sizes' scale: the window or chunk when the scenario has one


SCENARIOS = (
    Scenario("plain", AttentionFeatures()),
    Scenario("window<block", AttentionFeatures(window=3), 3),
    Scenario("window>block", AttentionFeatures(window=11), 11),
    Scenario("logit_softcap", AttentionFeatures(softcap=SOFTCAP)),
    Scenario("alibi", AttentionFeatures(alibi=True)),
    Scenario("sinks", AttentionFeatures(sinks=True)),
    Scenario("chunked", AttentionFeatures(chunk=5), 5),
    Scenario("values_in_keys", AttentionFeatures(latent=5)),
    Scenario("window+softcap+alibi+sinks", AttentionFeatures(window=6, softcap=SOFTCAP, alibi=True, sinks=True)),
)

GQA = ((4, 4), (8, 2))  # query heads per KV head: 1 and 4


@dataclass
class AttentionReport:
    """What `check_attention_backend` ran (scenario, heads, KV heads, block size) and skipped (scenario names)."""

    backend: str
    passed: list[tuple[str, int, int, int]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # features binding refused, as it must
    batch_invariant: bool | None = None  # None: the backend does not claim it


def check_attention_backend(
    backend: type[AttentionBackend], *, block_sizes: tuple[int, ...] = (4, 16), dtype: torch.dtype = torch.float32,
    atol: float = 2e-5, num_blocks: int = 256, scenarios: Sequence[str] | None = None,
) -> AttentionReport:
    """Run the conformance scenarios on `backend` (see the module docstring), or only those named in `scenarios`
    (a slow backend, e.g. under triton's interpreter); AssertionError naming what failed."""
    report = AttentionReport(backend.name or backend.__name__)
    unknown = set(scenarios or ()) - {s.name for s in SCENARIOS}
    if unknown:
        raise ValueError(f"unknown scenarios {sorted(unknown)}; the kit has {[s.name for s in SCENARIOS]}")
    for scenario in SCENARIOS:
        if scenarios is not None and scenario.name not in scenarios:
            continue
        if not scenario.features.names() <= backend.supported_features:
            report.skipped.append(scenario.name)
            continue
        for heads, kv_heads in GQA if scenario.features.latent is None else ((8, 1),):
            for block in block_sizes:
                layer = _layer(backend, heads, kv_heads, block, scenario.features, num_blocks, dtype)
                try:
                    lifecycle(layer, block, scenario.window, dtype, atol, num_blocks)
                except AssertionError as error:
                    raise AssertionError(f"attention backend {report.backend!r}, scenario {scenario.name!r} "
                                         f"({heads} heads, {kv_heads} KV heads, block size {block}): {error}") from None
                report.passed.append((scenario.name, heads, kv_heads, block))
    report.refused = _check_refusals(backend, num_blocks)
    if backend.supports_batch_invariant:
        _check_batch_invariance(backend, report.backend, block_sizes[0], dtype, num_blocks)
        report.batch_invariant = True
    return report


def _layer(backend: type[AttentionBackend], heads: int, kv_heads: int, block: int, features: AttentionFeatures,
           num_blocks: int, dtype: torch.dtype) -> Attention:
    layer = make_layer(heads, kv_heads, block, features, num_blocks, backend)
    layer.kv_cache = layer.kv_cache.to(dtype)
    return layer


def _check_refusals(backend: type[AttentionBackend], num_blocks: int) -> list[str]:
    """Binding a layer that uses a feature the backend does not list must fail (no backend silently ignores one)."""
    refused = []
    for scenario in SCENARIOS:
        missing = scenario.features.names() - backend.supported_features
        if len(missing) != 1 or len(scenario.features.names()) != 1:
            continue
        try:
            make_layer(8, 2 if scenario.features.latent is None else 1, 4, scenario.features, num_blocks, backend)
        except ValueError:
            refused.append(next(iter(missing)))
            continue
        raise AssertionError(f"attention backend {backend.name!r} does not list {sorted(missing)} in "
                             "supported_features, yet a layer using it was bound without an error")
    return refused


def _check_batch_invariance(backend: type[AttentionBackend], name: str, block: int, dtype: torch.dtype,
                            num_blocks: int) -> None:
    """Under batch_invariant=True each request's rows must be bitwise the same alone and beside others (each run
    on a fresh layer holding the same 11 cached tokens per request, so decodes and chunks read earlier blocks)."""
    features = AttentionFeatures(window=6, softcap=SOFTCAP, sinks=True).within(backend.supported_features)

    def run(batch: list[int], only: int | None) -> torch.Tensor:
        layer = _layer(backend, 8, 2, block, features, num_blocks, dtype)
        reqs = requests(len(batch), layer, block, num_blocks=num_blocks)
        for r in reqs:
            _run(layer, [r], [r.schedule(11)], dtype, batch_invariant=True)
            r.computed = 11
        spans = [r.schedule(n) for r, n in zip(reqs, batch)]
        chosen = range(len(reqs)) if only is None else [only]
        return _run(layer, [reqs[i] for i in chosen], [spans[i] for i in chosen], dtype, batch_invariant=True)

    for batch in ([17, 3], [1, 1, 1], [9, 1, 2, 5]):
        together, rows = run(batch, None), torch.tensor([0, *batch]).cumsum(0).tolist()
        for i in range(len(batch)):
            if not torch.equal(run(batch, i), together[rows[i]:rows[i + 1]]):
                raise AssertionError(f"attention backend {name!r} claims supports_batch_invariant, but request {i}'s "
                                     f"rows differ alone and in a step of {batch} tokens")
