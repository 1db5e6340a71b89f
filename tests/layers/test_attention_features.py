"""Sliding window, chunked local attention, logit soft-capping, ALiBi, sinks and values inside the keys
(latent attention) in TorchSDPABackend equal a dense reference —
plain masked softmax attention over each request's whole history (llmplug.testing.attention, the attention-backend
conformance kit), itself checked against transformers' own eager attention functions and mask functions — through every path a request takes: batched and
single prompts, chunked prefill across block boundaries, prefix-cache hits, and decode (mirror appends,
rings, regathers), for GQA ratios 1, 4 and 8, block sizes 4 and 16, and windows smaller than, equal to
and larger than a block. The triton backend is held to the same reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llmplug.layers.attention import Attention, decode_mirror
from llmplug.layers.attention.decode_mirror import DecodeMirror
from llmplug.layers.attention.key_layout import DecodeKeys
from llmplug.layers.attention.torch_sdpa import TorchSDPABackend
from llmplug.layers.forward_context import CommonAttentionMetadata
from llmplug.layers.kernels.native import KERNELS_ENV
from llmplug.testing.attention import (
    HEAD_DIM,
    SOFTCAP,
    AttentionFeatures,
    History,
    lifecycle,
    make_layer,
    reference,
    requests,
    step,
)


@pytest.fixture(autouse=True, params=["auto", "0"], ids=["cpu-kernels", "torch-paths"])
def kernel_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test on llmplug's CPU kernels (the default) and on the backend's torch paths."""
    monkeypatch.setenv(KERNELS_ENV, request.param)


D = HEAD_DIM
Features = AttentionFeatures


GQA = [(4, 4), (8, 2), (8, 1)]  # ratios 1, 4 and 8
WINDOWS = [(4, 3), (4, 4), (4, 11), (16, 6)]  # (block, window): window <, =, > block; a larger block
WINDOW_IDS = ["w<block", "w=block", "w>block", "b16"]
WINDOWED = {  # each with the window of the case
    "window": Features(),
    "window+softcap": Features(softcap=SOFTCAP),
    "window+alibi": Features(alibi=True),
    "window+sinks": Features(sinks=True),
    "all": Features(softcap=SOFTCAP, alibi=True, sinks=True),
}
UNWINDOWED = {"softcap": Features(softcap=SOFTCAP), "alibi": Features(alibi=True), "sinks": Features(sinks=True)}


def windowed(name: str, window: int) -> Features:
    return replace(WINDOWED[name], window=window)


@pytest.mark.parametrize("block,window", WINDOWS, ids=WINDOW_IDS)
@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("name", ["window", "all"])
def test_window_alone_and_with_every_feature_match_dense_reference(
    name: str, heads: int, kv_heads: int, block: int, window: int
) -> None:
    lifecycle(make_layer(heads, kv_heads, block, windowed(name, window)), block, window)


@pytest.mark.parametrize("block,window", WINDOWS, ids=WINDOW_IDS)
@pytest.mark.parametrize("name", ["window+softcap", "window+alibi", "window+sinks"])
def test_window_with_each_feature_matches_dense_reference(name: str, block: int, window: int) -> None:
    lifecycle(make_layer(8, 2, block, windowed(name, window)), block, window)


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("heads,kv_heads", GQA)
@pytest.mark.parametrize("name", sorted(UNWINDOWED))
def test_features_without_window_match_dense_reference(name: str, heads: int, kv_heads: int, block: int) -> None:
    lifecycle(make_layer(heads, kv_heads, block, UNWINDOWED[name]), block, window=6)


@pytest.mark.parametrize(
    "name,block,chunk",
    [*(("window", b, c) for b, c in WINDOWS), ("all", 4, 3), ("all", 16, 6)],
    ids=[*(f"chunk-{i.replace('w', 'c')}" for i in WINDOW_IDS), "all-c<block", "all-b16"],
)
def test_chunked_attention_alone_and_with_every_feature_matches_dense_reference(
    name: str, block: int, chunk: int
) -> None:
    """Chunks of Llama 4's local attention: prompts and chunked prefill crossing chunk starts, decode rings of
    one chunk, a prefix hit; "all" adds a window longer than the chunk, soft-capping, ALiBi and sinks."""
    features = replace(WINDOWED[name], window=chunk + 3 if name == "all" else None, chunk=chunk)
    lifecycle(make_layer(8, 2, block, features), block, chunk)


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("features", [Features(latent=5), Features(latent=D), Features(latent=5, window=6, sinks=True)],
                         ids=["latent", "latent=head_dim", "latent+window+sinks"])
def test_values_inside_the_keys_match_dense_reference_and_store_one_plane(features: Features, block: int) -> None:
    layer = make_layer(8, 1, block, features)
    assert layer.kv_cache.shape[0] == 1  # keys only: the values are read from them
    lifecycle(layer, block, window=6)


def hf_reference(layer: Attention, r: History, start: int, stop: int) -> torch.Tensor:
    """The same attention computed by transformers: its mask functions, Bloom's ALiBi tensor, and Gemma 2's
    (soft-capping) or GPT-OSS's (sinks) eager attention."""
    from types import SimpleNamespace

    from transformers.masking_utils import (
        causal_mask_function,
        chunked_causal_mask_function,
        sliding_window_causal_mask_function,
    )
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    heads, n = layer.num_heads, stop - start
    q = r.q[start:stop].view(1, n, heads, D).transpose(1, 2)  # [1, H, n, D]
    k = r.k[:stop].view(1, stop, -1, D).transpose(1, 2)  # [1, Hkv, stop, D]
    v = r.v[:stop].view(1, stop, -1, D).transpose(1, 2)
    window = layer.sliding_window
    mask_fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    if layer.attention_chunk is not None:
        mask_fn = chunked_causal_mask_function(layer.attention_chunk, torch.zeros(1, dtype=torch.long))
    seen = mask_fn(0, 0, torch.arange(start, stop)[:, None], torch.arange(stop)[None, :])  # [n, stop]
    mask = torch.zeros(1, 1, n, stop).masked_fill(~seen, float("-inf"))
    if layer.alibi_slopes is not None:  # Bloom adds slope * j: softmax cannot tell it from slope * (j - i)
        mask = mask + build_alibi_tensor(torch.ones(1, stop), heads, torch.float32).view(1, heads, 1, stop)
    module = SimpleNamespace(num_key_value_groups=layer.num_queries_per_kv, head_dim=D, training=False,
                             sinks=layer.sinks)
    if layer.sinks is not None:
        out, _ = gpt_oss_eager(module, q, k, v, mask, scaling=layer.scale)
    else:
        out, _ = gemma2_eager(module, q, k, v, mask, scaling=layer.scale, softcap=layer.logit_softcap)
    return out[0].reshape(n, heads * D)


@pytest.mark.parametrize("features", [
    Features(window=5), Features(window=5, softcap=SOFTCAP), Features(window=5, sinks=True), Features(alibi=True),
    Features(softcap=SOFTCAP), Features(chunk=5),
], ids=["window (Mistral)", "window+softcap (Gemma 2)", "window+sinks (GPT-OSS)", "alibi (Bloom)", "softcap",
        "chunk (Llama 4)"])
def test_the_dense_reference_is_transformers_attention(features: Features) -> None:
    layer = make_layer(8, 2, 4, features)
    r = requests(1, layer, 4)[0]
    for start, stop in [(0, 13), (9, 13), (12, 13)]:  # a prompt, a chunk, a decode
        torch.testing.assert_close(reference(layer, r, start, stop), hf_reference(layer, r, start, stop),
                                   rtol=0, atol=1e-5)


@pytest.fixture
def gathers(monkeypatch) -> list[tuple[int, ...]]:
    """Shapes of the decode contexts gathered from the cache (one per layer pass that does not append)."""
    calls = []
    real = DecodeKeys.gather

    def counting(keys, cache, out):
        calls.append(tuple(out.shape))
        return real(keys, cache, out)

    monkeypatch.setattr(DecodeKeys, "gather", counting)
    monkeypatch.setattr(decode_mirror, "MIRROR_CACHE_SHARE", 1.0)
    return calls


def test_windowed_decode_keeps_a_ring_of_the_window_and_only_appends(gathers) -> None:
    block, window = 4, 6
    layer = make_layer(4, 2, block, Features(window=window, alibi=True))
    reqs = requests(2, layer, block)
    step(layer, reqs, [3, 5])
    step(layer, reqs, [1, 1])  # seq 4, 6: within the window, every key from position 0
    step(layer, reqs, [1, 1])  # seq 5, 7: one is longer than the window -> the ring layout
    assert gathers == [(2, 2, 2, 8, D), (2, 2, 2, window, D)]
    mirror = layer.backend_state
    assert isinstance(mirror, DecodeMirror) and mirror.ring == window
    for _ in range(3 * block):  # crossing block boundaries: the ring is only appended to
        step(layer, reqs, [1, 1])
    assert len(gathers) == 2 and layer.backend_state is mirror


def test_windowed_prefill_gathers_only_the_blocks_the_window_reaches() -> None:
    block, window = 4, 6
    layer = make_layer(4, 2, block, Features(window=window))
    long, short = requests(2, layer, block)
    step(layer, [long], [40])
    step(layer, [long, short], [5, 3])  # a chunk at positions 40..44 next to a fresh prompt
    spans = [(45, 48), (0, 2)]  # build the next step's metadata without running it
    for r, (a, b) in zip([long, short], spans):
        r.schedule(b - a)
    tables = torch.tensor([r.blocks + [0] * (12 - len(r.blocks)) for r in (long, short)])
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 3, 5]), seq_lens=torch.tensor([48, 5]),
        num_computed_tokens=torch.tensor([45, 3]), block_tables=tables, slot_mapping=torch.zeros(5, dtype=torch.long),
        positions=torch.tensor([45, 46, 47, 3, 4]), block_size=block, num_reqs=2, num_tokens=5, max_query_len=3,
        max_seq_len=48, query_lens_list=(3, 2), seq_lens_list=(48, 5),
    )
    prefill = TorchSDPABackend.build_metadata(common).prefill
    assert prefill.keys(None).kv_len == 48
    # the earliest key seen is 45 - 6 + 1 = 40, in block 10: blocks 10 and 11 of `long`, 2 of `short`
    assert prefill.keys(window).kv_len == 2 * block


def test_windowed_decode_without_room_for_a_mirror_gathers_the_window_into_scratch(monkeypatch, gathers) -> None:
    monkeypatch.setattr(decode_mirror, "MIRROR_CACHE_SHARE", 1 / 1024)
    block, window = 4, 5
    layer = make_layer(8, 1, block, Features(window=window, sinks=True))
    reqs = requests(3, layer, block, seed=2)
    step(layer, reqs, [9, 2, 12])
    for _ in range(6):
        step(layer, reqs, [1, 1, 1])
    assert layer.backend_state is None and len(gathers) == 6
    assert all(shape[3] == window for shape in gathers)


def test_explicit_prefill_in_query_chunks_matches(monkeypatch) -> None:
    from llmplug.layers.attention import torch_sdpa

    monkeypatch.setattr(torch_sdpa, "EXPLICIT_SCORES_PER_CHUNK", 3 * 8 * 24)  # 1 query row of 3 requests per chunk
    layer = make_layer(8, 2, 4, Features(window=7, softcap=SOFTCAP, sinks=True))
    reqs = requests(3, layer, 4)
    step(layer, reqs, [17, 6, 11])
    step(layer, reqs, [4, 1, 7])


def test_bfloat16_features_stay_close_to_float32() -> None:
    block = 4
    layer = make_layer(8, 2, block, Features(window=6, softcap=SOFTCAP, alibi=True, sinks=True))
    layer.kv_cache = layer.kv_cache.to(torch.bfloat16)
    reqs = requests(3, layer, block)
    step(layer, reqs, [13, 4, 9], dtype=torch.bfloat16, atol=5e-2)
    for _ in range(5):
        step(layer, reqs, [1, 1, 1], dtype=torch.bfloat16, atol=5e-2)


@pytest.mark.parametrize("heads,kv_heads,chunk", [*((h, kv, None) for h, kv in GQA), (8, 2, 5)])
def test_the_triton_backend_matches_the_dense_reference_with_every_feature(
    heads: int, kv_heads: int, chunk: int | None
) -> None:
    """The triton backend's kernel (run by triton's interpreter here) against the same reference."""
    from llmplug.layers.attention.triton_backend import TritonAttentionBackend

    block, window = 4, 6
    features = Features(window=window, softcap=SOFTCAP, alibi=True, sinks=True, chunk=chunk)
    layer = make_layer(heads, kv_heads, block, features, num_blocks=32, backend=TritonAttentionBackend)
    r0, r1, r2 = requests(3, layer, block, length=24, num_blocks=32)
    step(layer, [r0, r1], [11, 3])  # prompts, one longer than the window
    step(layer, [r0, r2, r1], [1, 5, 1])  # decodes around a fresh prompt
    step(layer, [r2, r0, r1], [4, 1, 1])  # a chunk across a block boundary between decodes
    for _ in range(3):
        step(layer, [r0, r1, r2], [1, 1, 1])
