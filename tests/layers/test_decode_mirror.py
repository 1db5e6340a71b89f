"""The decode mirror of TorchSDPABackend: consecutive decode steps of the same requests only append
to each layer's gathered context, every other step gathers it again, and the output always equals
plain attention over each request's whole history."""

from __future__ import annotations

import pytest
import torch

from llmplug.layers.attention import Attention, bind_kv_cache
from llmplug.layers.attention import decode_mirror, kv_store
from llmplug.layers.attention.decode_mirror import DecodeMirror
from llmplug.layers.attention.key_layout import DecodeKeys
from llmplug.layers.attention.torch_sdpa import TorchSDPABackend
from llmplug.layers.forward_context import CommonAttentionMetadata, forward_context
from llmplug.layers.kernels.native import KERNELS_ENV


@pytest.fixture(autouse=True)
def torch_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mirror belongs to the torch paths: llmplug's CPU kernels (on by default) read the cache in place."""
    monkeypatch.setenv(KERNELS_ENV, "0")


BLOCK = 4
D = 8
HEADS, KV_HEADS = 4, 2


class History:
    """One request: q, k, v of every position, and the blocks it has been given so far."""

    def __init__(self, length: int, gen: torch.Generator, free: list[int]) -> None:
        self.q = torch.randn(length, HEADS * D, generator=gen)
        self.k = torch.randn(length, KV_HEADS * D, generator=gen)
        self.v = torch.randn(length, KV_HEADS * D, generator=gen)
        self.free, self.blocks, self.computed = free, [], 0

    def schedule(self, num_tokens: int) -> tuple[int, int]:
        """Positions [start, stop) of the next step, allocating blocks as the scheduler does."""
        start, stop = self.computed, self.computed + num_tokens
        while len(self.blocks) * BLOCK < stop:
            self.blocks.append(self.free.pop())
        return start, stop

    def expected(self, start: int, stop: int) -> torch.Tensor:
        """Causal attention of positions [start, stop) over positions [0, stop)."""
        g = HEADS // KV_HEADS
        q = self.q[start:stop].view(-1, HEADS, D).transpose(0, 1)  # [H, n, D]
        k = self.k[:stop].view(stop, KV_HEADS, D).transpose(0, 1).repeat_interleave(g, 0)
        v = self.v[:stop].view(stop, KV_HEADS, D).transpose(0, 1).repeat_interleave(g, 0)
        scores = q @ k.transpose(1, 2) * D**-0.5
        allowed = torch.arange(stop)[None, :] <= torch.arange(start, stop)[:, None]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return (probs @ v).transpose(0, 1).reshape(stop - start, -1)


def make_layer(num_blocks: int = 64) -> Attention:
    layer = Attention(HEADS, D, D**-0.5, KV_HEADS, prefix="layers.0.attn")
    cache = torch.zeros(TorchSDPABackend.kv_cache_shape(num_blocks, BLOCK, KV_HEADS, D))
    bind_kv_cache(layer, [cache], TorchSDPABackend)
    return layer


def step(layer: Attention, reqs: list[History], num_tokens: list[int], fused_qkv: bool = True) -> None:
    """One flattened step of `num_tokens[i]` tokens of each request; checks the output against the reference."""
    spans = [r.schedule(n) for r, n in zip(reqs, num_tokens)]
    width = max(len(r.blocks) for r in reqs)
    slots = [r.blocks[p // BLOCK] * BLOCK + p % BLOCK for r, (a, b) in zip(reqs, spans) for p in range(a, b)]
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.cumsum(torch.tensor(num_tokens), 0).tolist()]),
        seq_lens=torch.tensor([b for _, b in spans]),
        num_computed_tokens=torch.tensor([a for a, _ in spans]),
        block_tables=torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in reqs]),
        slot_mapping=torch.tensor(slots),
        positions=torch.tensor([p for a, b in spans for p in range(a, b)]),
        block_size=BLOCK, num_reqs=len(reqs), num_tokens=sum(num_tokens), max_query_len=max(num_tokens),
        max_seq_len=max(b for _, b in spans), query_lens_list=tuple(num_tokens),
        seq_lens_list=tuple(b for _, b in spans),
    )
    q, k, v = (torch.cat([getattr(r, name)[a:b] for r, (a, b) in zip(reqs, spans)]) for name in "qkv")
    if fused_qkv:  # k and v as views of one projection output, as the decoder passes them
        qkv = torch.cat([q, k, v], dim=1)
        q, k, v = qkv.split([HEADS * D, KV_HEADS * D, KV_HEADS * D], dim=1)
    with torch.inference_mode(), forward_context(TorchSDPABackend.build_metadata(common)):  # as the runner
        out = layer(q, k, v)
    expected = torch.cat([r.expected(a, b) for r, (a, b) in zip(reqs, spans)])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    for r, (_, b) in zip(reqs, spans):
        r.computed = b


@pytest.fixture
def gathers(monkeypatch) -> list[int]:
    """Counts the cache gathers of decode parts (one per layer pass that does not append)."""
    calls = []
    real = DecodeKeys.gather

    def counting(keys, cache, out):
        calls.append(1)
        return real(keys, cache, out)

    monkeypatch.setattr(DecodeKeys, "gather", counting)
    monkeypatch.setattr(decode_mirror, "MIRROR_CACHE_SHARE", 1.0)
    return calls


def requests(lengths: list[int], seed: int = 0) -> list[History]:
    gen = torch.Generator().manual_seed(seed)
    free = [1 + i for i in torch.randperm(63, generator=gen).tolist()]  # blocks out of order, as after reuse
    return [History(n, gen, free) for n in lengths]


def test_consecutive_decodes_append_and_a_new_padded_length_gathers(gathers) -> None:
    layer, reqs = make_layer(), requests([40, 40, 40])
    step(layer, reqs, [5, 9, 7])  # prompts: seq 5, 9, 7 -> kv_len 12
    step(layer, reqs, [1, 1, 1])  # first decode: gathers the mirror
    assert len(gathers) == 1 and isinstance(layer.backend_state, DecodeMirror)
    step(layer, reqs, [1, 1, 1])  # seq 7, 11, 9: the third request enters a new block, kv_len stays 12
    step(layer, reqs, [1, 1, 1])  # seq 8, 12, 10
    assert len(gathers) == 1
    step(layer, reqs, [1, 1, 1])  # seq 9, 13, 11: kv_len 16, gathered again
    assert len(gathers) == 2
    for _ in range(3):
        step(layer, reqs, [1, 1, 1])
    assert len(gathers) == 2


def test_a_changed_batch_gathers_again(gathers) -> None:
    layer, reqs = make_layer(), requests([40, 40, 40, 40])
    step(layer, reqs[:3], [6, 3, 5])
    step(layer, reqs[:3], [1, 1, 1])
    step(layer, reqs[:3], [1, 1, 1])
    assert len(gathers) == 1
    step(layer, reqs[:2], [1, 1])  # a request left
    assert len(gathers) == 2
    step(layer, [reqs[1], reqs[0]], [1, 1])  # same requests, other order
    assert len(gathers) == 3
    step(layer, [reqs[1], reqs[0], reqs[3]], [1, 1, 6])  # a prompt joins: decodes still append
    assert len(gathers) == 3
    step(layer, [reqs[1], reqs[0], reqs[3]], [1, 1, 1])  # the prompt now decodes: a new batch
    assert len(gathers) == 4


def test_a_pass_without_decodes_breaks_the_chain(gathers) -> None:
    layer, reqs = make_layer(), requests([40, 40, 40])
    step(layer, reqs[:2], [5, 6])
    step(layer, reqs[:2], [1, 1])
    step(layer, reqs[2:], [7])  # only a prompt: the mirror is dropped
    assert layer.backend_state is None
    step(layer, reqs[:2], [1, 1])
    assert len(gathers) == 2


def test_k_and_v_in_separate_tensors_append_the_same_way(gathers) -> None:
    layer, reqs = make_layer(), requests([30, 30], seed=1)
    step(layer, reqs, [5, 2], fused_qkv=False)
    for _ in range(3):  # seq 6, 7, 8: kv_len stays 8
        step(layer, reqs, [1, 1], fused_qkv=False)
    assert len(gathers) == 1


def test_without_room_for_a_mirror_each_step_gathers_into_scratch(monkeypatch, gathers) -> None:
    monkeypatch.setattr(decode_mirror, "MIRROR_CACHE_SHARE", 1 / 64)
    layer, reqs = make_layer(), requests([30, 30, 30], seed=2)
    step(layer, reqs, [6, 2, 9])
    for _ in range(3):
        step(layer, reqs, [1, 1, 1])
    assert layer.backend_state is None and len(gathers) == 3


def test_bind_kv_cache_drops_the_mirror(gathers) -> None:
    layer, reqs = make_layer(), requests([20, 20])
    step(layer, reqs, [3, 4])
    step(layer, reqs, [1, 1])
    assert layer.backend_state is not None
    bind_kv_cache(layer, [torch.zeros_like(layer.kv_cache)], TorchSDPABackend)
    assert layer.backend_state is None


def test_decodes_on_both_sides_of_a_chunk_keep_appending(gathers) -> None:
    layer, reqs = make_layer(), requests([40, 40, 40], seed=3)
    step(layer, reqs, [8, 3, 8])  # the decodes below reach seq 9 to 12: kv_len stays 12
    step(layer, reqs, [1, 1, 1])
    step(layer, [reqs[0], reqs[2]], [1, 1])  # the batch the mixed steps below decode
    for _ in range(2):  # decode, prompt chunk, decode: the decode tokens are not contiguous
        step(layer, [reqs[0], reqs[1], reqs[2]], [1, 2, 1])
    assert len(gathers) == 2


@pytest.mark.parametrize("inference", [False, True])
def test_k_and_v_views_of_one_projection_are_stored_by_one_copy(inference: bool) -> None:
    with torch.inference_mode(inference):
        qkv = torch.randn(5, (HEADS + 2 * KV_HEADS) * D)
        q, k, v = qkv.split([HEADS * D, KV_HEADS * D, KV_HEADS * D], dim=1)
    both = kv_store.adjacent_kv(k, v)
    assert both is not None and torch.equal(both[:, 0], k) and torch.equal(both[:, 1], v)
    assert kv_store.adjacent_kv(v, k) is None  # v before k
    assert kv_store.adjacent_kv(k.clone(), v.clone()) is None  # separate tensors
    fused, separate = make_layer(), make_layer()
    slots = torch.tensor([7, 3, 12, 0, 30])
    kv_store.write_kv(fused.kv_cache, k, v, slots)
    kv_store.write_kv(separate.kv_cache, k.clone(), v.clone(), slots)
    assert torch.equal(fused.kv_cache, separate.kv_cache)
