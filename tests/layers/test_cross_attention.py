"""Cross-attention's paged keys and values: written into and read from a request's cross blocks of a decoder layer's
cache tensor, in each attention backend's own layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmplug.layers.attention.cross_attention import CrossBlocks, paged_view
from llmplug.layers.attention.torch_sdpa import TorchSDPABackend
from llmplug.layers.attention.triton_backend import TritonAttentionBackend

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, TOKENS = 12, 4, 3, 5, 10  # 10 encoder states: 3 blocks, the last half full


def _slot(backend, cache: torch.Tensor, kv: int, head: int, block: int, offset: int) -> torch.Tensor:
    """The cache's entry for one token, indexed as each backend documents its layout."""
    if backend is TorchSDPABackend:  # [2, heads, blocks, block_size, head_dim]
        return cache[kv, head, block, offset]
    return cache[kv, block, offset, head]  # Triton: [2, blocks, block_size, heads, head_dim]


@pytest.mark.parametrize("backend", [TorchSDPABackend, TritonAttentionBackend], ids=["torch_sdpa", "triton"])
@pytest.mark.parametrize("block_ids", [[4, 5, 6], [9, 2, 7]], ids=["consecutive", "scattered"])
def test_keys_and_values_go_to_the_request_blocks_and_come_back(backend, block_ids) -> None:
    torch.manual_seed(0)
    cache = torch.zeros(backend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM))
    layer = SimpleNamespace(kv_cache=cache, backend=backend)
    kv = torch.randn(2, HEADS, TOKENS, HEAD_DIM)
    blocks = CrossBlocks.of(block_ids, TOKENS, torch.device("cpu"))
    assert (blocks.first is not None) == (block_ids == [4, 5, 6])  # read as a view, or gathered
    blocks.write(paged_view(layer), kv)
    for token in range(TOKENS):
        block, offset = block_ids[token // BLOCK_SIZE], token % BLOCK_SIZE
        for which in (0, 1):
            for head in range(HEADS):
                assert torch.equal(_slot(backend, cache, which, head, block, offset), kv[which, head, token])
    assert int((cache != 0).sum()) == kv.numel()  # nothing outside the request's slots was written
    assert torch.equal(blocks.read(paged_view(layer)), kv)


def test_a_backend_whose_layout_is_no_permutation_is_refused_by_name() -> None:
    class Packed(TorchSDPABackend):
        name = "packed"

        @classmethod
        def kv_cache_shape(cls, num_blocks, block_size, num_kv_heads, head_dim):
            return (num_blocks, 2 * block_size * num_kv_heads * head_dim)

    layer = SimpleNamespace(kv_cache=torch.zeros(Packed.kv_cache_shape(2, 4, 3, 5)), backend=Packed)
    with pytest.raises(ValueError, match="'packed' .* not a permutation"):
        paged_view(layer)
    assert paged_view(SimpleNamespace(kv_cache=torch.zeros(2, 3, 2, 4, 5), backend=TorchSDPABackend)).shape == (
        2, 3, 2, 4, 5)
