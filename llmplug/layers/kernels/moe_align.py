"""MoE token grouping in Triton: the (token, expert) assignments sorted by expert, stable within an expert.

From the router's expert ids [T, k] (assignment i = t * k + j is token t's j-th expert) three launches
compute, without a host sync:

1. per chunk of `BLOCK` assignments, how many go to each expert (`chunk_counts [chunks, E]`);
2. one program: each chunk's start within every expert (exclusive prefix over chunks), the per-expert
   counts, and the experts' offsets (prefix sums of the counts, each rounded up to `block_size`);
3. per chunk, every assignment's row: its expert's offset + its chunk's start in that expert + how
   many earlier assignments of the chunk share its expert (so assignment order is kept: stable).

The padding rows of an expert (up to block_size - 1) hold the sentinel T * k, as vLLM's
`moe_align_block_size` does, so that a blocked matmul can take whole blocks of one expert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmplug.layers.kernels import require_triton_device

__all__ = ["moe_align_block_size"]

BLOCK = 64  # assignments per program (each compares its assignments pairwise: BLOCK x BLOCK)


@triton.jit
def _chunk_counts_kernel(ids_ptr, chunk_counts_ptr, numel, num_experts, BLOCK: tl.constexpr):
    chunk = tl.program_id(0)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + idx, mask=idx < numel, other=-1).to(tl.int32)
    ok = (idx < numel) & (expert >= 0) & (expert < num_experts)
    same = (expert[:, None] == expert[None, :]) & ok[None, :]
    in_chunk = tl.sum(same.to(tl.int32), axis=1)  # assignments of the chunk with this one's expert
    tl.store(chunk_counts_ptr + chunk * num_experts + expert, in_chunk, mask=ok)  # equal values per expert


@triton.jit
def _scan_kernel(chunk_counts_ptr, counts_ptr, offsets_ptr, num_chunks, num_experts, block_size,
                 BLOCK_E: tl.constexpr):
    experts = tl.arange(0, BLOCK_E)
    ok = experts < num_experts
    running = tl.zeros([BLOCK_E], dtype=tl.int32)
    for chunk in range(num_chunks):  # chunk counts become the chunk's start within each expert
        ptr = chunk_counts_ptr + chunk * num_experts + experts
        in_chunk = tl.load(ptr, mask=ok, other=0)
        tl.store(ptr, running, mask=ok)
        running += in_chunk
    tl.store(counts_ptr + experts, running, mask=ok)
    padded = (running + block_size - 1) // block_size * block_size
    tl.store(offsets_ptr + 1 + experts, tl.cumsum(padded, axis=0), mask=ok)


@triton.jit
def _scatter_kernel(ids_ptr, chunk_starts_ptr, offsets_ptr, sorted_ptr, numel, num_experts, BLOCK: tl.constexpr):
    chunk = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    idx = chunk * BLOCK + lanes
    expert = tl.load(ids_ptr + idx, mask=idx < numel, other=-1).to(tl.int32)
    ok = (idx < numel) & (expert >= 0) & (expert < num_experts)
    earlier = (expert[:, None] == expert[None, :]) & (lanes[None, :] < lanes[:, None]) & ok[None, :]
    rank = tl.sum(earlier.to(tl.int32), axis=1)  # earlier assignments of the chunk with this one's expert
    start = tl.load(offsets_ptr + expert, mask=ok, other=0) + tl.load(
        chunk_starts_ptr + chunk * num_experts + expert, mask=ok, other=0
    )
    tl.store(sorted_ptr + start + rank, idx.to(tl.int32), mask=ok)


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_size: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the assignments of expert ids topk_ids [T, k] (values in [0, num_experts); others are left out) by expert.

    Returns, all int32 on topk_ids' device:
    - sorted_ids [T * k + E * (block_size - 1)]: flat assignment indices (t * k + j), expert e's in
      rows offsets[e] .. offsets[e] + counts[e] in their original order, then T * k as padding up to
      offsets[e + 1] and after offsets[E];
    - offsets [E + 1]: where each expert's rows start, each expert's span rounded up to block_size;
    - counts [E]: assignments per expert.
    With block_size 1, sorted_ids is `topk_ids.flatten().argsort(stable=True)`.
    """
    require_triton_device(topk_ids, "moe_align_block_size")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    ids = topk_ids.reshape(-1).contiguous()
    numel, device = ids.numel(), ids.device
    sorted_ids = torch.full((numel + num_experts * (block_size - 1),), numel, dtype=torch.int32, device=device)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    num_chunks = triton.cdiv(numel, BLOCK)
    chunk_counts = torch.zeros(num_chunks, num_experts, dtype=torch.int32, device=device)
    if num_chunks:
        _chunk_counts_kernel[(num_chunks,)](ids, chunk_counts, numel, num_experts, BLOCK=BLOCK)
    _scan_kernel[(1,)](chunk_counts, counts, offsets, num_chunks, num_experts, block_size,
                       BLOCK_E=triton.next_power_of_2(num_experts))
    if num_chunks:
        _scatter_kernel[(num_chunks,)](ids, chunk_counts, offsets, sorted_ids, numel, num_experts, BLOCK=BLOCK)
    return sorted_ids, offsets, counts
