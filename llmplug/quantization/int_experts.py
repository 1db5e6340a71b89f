"""Integer group-quantized experts of a mixture-of-experts checkpoint (compressed-tensors `pack-quantized`
W4A16 / W8A16, GPTQ 4/8-bit, AWQ GEMM): each expert's projections as the linear layers of the
same format hold them (int_weights.py).

Until loaded, the checkpoint's tensors stacked over this rank's experts, per projection P (gate_up_proj: the
checkpoint's gate_proj rows, then up_proj's; down_proj), for an [N, K] projection in groups of g (pack = 32 / bits):

    compressed-tensors: P_weight_packed int32 [E, N, K / pack], P_weight_scale float32 [E, N, K / g],
        P_weight_zero_point int32 [E, N / pack, K / g] (asymmetric only), P_weight_shape (checked, not kept)
    GPTQ: P_qweight int32 [E, K / pack, N], P_qzeros int32 [E, K / g, N / pack], P_scales float32 [E, K / g, N],
        P_g_idx int32 [E, K] (act-order: x's columns are permuted once per call, as for the linear layers)
    AWQ: P_qweight int32 [E, K, N / 8], P_qzeros int32 [E, K / g, N / 8] (AWQ's nibble order), P_scales [E, K / g, N]

After loading, each expert's projection is unpacked once into `IntWeights` and repacked into torch's int4 kernel
planes (`pack_int4`: ~4 bits a weight per plane), and the checkpoint's tensors are freed; where the kernel cannot
serve (device, dtype, shape, or rows that depend on their number in batch-invariant mode) that projection computes
with a dense dequantized weight after one warning naming it, as a linear layer does. Tensor parallelism splits each
expert's intermediate features on whole groups and packs (a size that cuts one is refused by name).
"""

from __future__ import annotations

import abc
import logging
from typing import TYPE_CHECKING, Any

import torch

from llmplug.core.errors import ModelLoadError
from llmplug.layers.quantization import Int4LinearMethod, LinearMethod, int4_rows_invariant
from llmplug.quantization.base import QuantizedExpertsMethod
from llmplug.quantization.int_weights import IntWeights, dense_fallback, float_loader, pack_int4, unpack_int32

if TYPE_CHECKING:
    from llmplug.layers.moe.experts import FusedExperts
    from llmplug.layers.quantization import LinearOptions

__all__ = ["AWQExpertsMethod", "CTPackedExpertsMethod", "GPTQExpertsMethod", "IntExpertsMethod"]

log = logging.getLogger(__name__)

PROJECTIONS = ("gate_up_proj", "down_proj")


class _Projection:
    """One expert projection's compute: the int4 kernel (with the planes' row-invariance probe) or a dense copy."""

    def __init__(self, weights: IntWeights, dtype: torch.dtype, options: LinearOptions, name: str) -> None:
        reason, packed = pack_int4(weights, dtype, options)
        self.shape = tuple(weights.q.shape)  # [N, K]
        self.perm: torch.Tensor | None = None  # [K] input columns in the kernel's order (act-order)
        if packed is not None:
            self.compute: LinearMethod = Int4LinearMethod(packed[0], None, exact=True)
            self.perm = packed[1]
            self.probe: tuple[int, int, int, torch.dtype] | None = (*self.shape, packed[0].num_planes, dtype)
            self.dense_invariant = True
            return
        log.warning("%s computes with a dense dequantized weight: %s", name, reason)
        self.compute, self.dense_invariant = dense_fallback(weights, dtype, options)
        self.probe = None

    @property
    def row_invariant(self) -> bool:
        return self.dense_invariant if self.probe is None else int4_rows_invariant(*self.probe, torch.get_num_threads())


class IntExpertsMethod(QuantizedExpertsMethod):
    """Experts holding integer groups: the checkpoint's tensors until loaded, then int4 kernel planes per expert
    and projection. A format says which tensors it stores (`create_weights`, `leaves`) and how to unpack them."""

    leaves: tuple[str, ...]  # the checkpoint tensors of each projection (freed after repacking)
    name_of_format: str

    def __init__(self, bits: int, group_size: int | None) -> None:
        self.bits, self.group_size = bits, group_size  # group_size None: one group per row (channel)
        self.dtype = torch.get_default_dtype()  # the model's: layers are built inside the loader's dtype context
        self.projections: list[dict[str, _Projection]] | None = None  # per local expert, after loading

    @property
    def row_invariant(self) -> bool:  # type: ignore[override]
        """Whether every expert projection's rows are bitwise independent of their number (probed per shape)."""
        return self.projections is None or all(p.row_invariant for e in self.projections for p in e.values())

    @abc.abstractmethod
    def int_weights(self, experts: FusedExperts, expert: int, projection: str) -> IntWeights:
        """Local expert `expert`'s `projection`, unpacked from the checkpoint's tensors."""

    def check_split(self, experts: FusedExperts) -> None:
        """ModelLoadError naming the layer when this rank's intermediate features cut a pack or a group."""
        i, pack = experts.intermediate_size, 32 // self.bits
        if [size for size in (pack, self.group_size) if size and i % size]:
            raise ModelLoadError(
                f"{experts.prefix}: this rank's {i} intermediate features of each expert do not split into the "
                f"{self.name_of_format} checkpoint's packs of {pack} and groups of {self.group_size}; choose a "
                "tensor_parallel_size that keeps them whole (or enable expert parallelism)"
            )

    def groups(self, experts: FusedExperts, projection: str, inputs: int) -> int:
        """Groups along a projection's `inputs` on this rank (1 per row without groups); ModelLoadError when they
        do not divide."""
        if self.group_size is None:
            return 1
        if inputs % self.group_size:
            raise ModelLoadError(f"{experts.prefix}.{projection}: {inputs} inputs do not split into groups of "
                                 f"{self.group_size}")
        return inputs // self.group_size

    def process_weights_after_loading(self, experts: FusedExperts, options: LinearOptions) -> None:
        """Repack every local expert's projections for the int4 kernel, then free the checkpoint's tensors."""
        if self.projections is not None:
            return  # repacked once: the checkpoint's tensors are gone
        self.projections = [
            {p: _Projection(self.int_weights(experts, e, p), self.dtype, options, f"{experts.prefix}.{e}.{p}")
             for p in PROJECTIONS}
            for e in range(experts.num_local_experts)
        ]
        for name in (f"{projection}_{leaf}" for projection in PROJECTIONS for leaf in self.leaves):
            if hasattr(experts, name):
                delattr(experts, name)

    def apply(self, experts: FusedExperts, expert: int, projection: str, x: torch.Tensor) -> torch.Tensor:
        if self.projections is None:
            raise ModelLoadError(f"{experts.prefix}: its experts compute only after their weights are loaded")
        computed = self.projections[expert][projection]
        if computed.perm is not None:
            x = x.index_select(-1, computed.perm)
        return computed.compute.apply(experts, x, None)

    def dequantize(self, experts: FusedExperts, expert: int, projection: str) -> torch.Tensor:
        """Unpacked from the checkpoint's tensors before repacking; read back through the kernel (x = identity, one
        product per output: exact) after."""
        if self.projections is None:
            return self.int_weights(experts, expert, projection).dequantize()
        eye = torch.eye(self.projections[expert][projection].shape[1], dtype=self.dtype)
        return self.apply(experts, expert, projection, eye).t().float()

    def __repr__(self) -> str:
        groups = f"group {self.group_size}" if self.group_size else "channel"
        return f"{self.name_of_format}(w{self.bits}a16, {groups}, int4 kernel)"


class CTPackedExpertsMethod(IntExpertsMethod):
    """compressed-tensors pack-quantized experts (group or channel scales, symmetric or with zero points)."""

    leaves = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
    name_of_format = "compressed-tensors"

    def __init__(self, weights: dict[str, Any]) -> None:
        super().__init__(weights["num_bits"], weights.get("group_size") if weights.get("strategy") == "group" else None)
        self.symmetric = weights.get("symmetric", True)

    def create_weights(self, experts: FusedExperts) -> None:
        self.check_split(experts)
        i, h, pack = experts.intermediate_size, experts.hidden_size, 32 // self.bits
        for projection, (n, k) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            groups, group_dim = self.groups(experts, projection, k), 1 if self.group_size else None
            experts.create_parameter(f"{projection}_weight_packed", projection, (n, k // pack), torch.int32, 0, 1)
            float_loader(experts.create_parameter(f"{projection}_weight_scale", projection, (n, groups),
                                                  torch.float32, 0, group_dim))
            if not self.symmetric:
                experts.create_parameter(f"{projection}_weight_zero_point", projection, (n // pack, groups),
                                         torch.int32, 0, group_dim)
            shape = experts.create_parameter(f"{projection}_weight_shape", projection, (2,), torch.int64, None, None)
            shape.weight_loader = _shape_check(experts, projection)  # type: ignore[attr-defined]

    def int_weights(self, experts: FusedExperts, expert: int, projection: str) -> IntWeights:
        offset = 2 ** (self.bits - 1)  # stored values are signed: q - offset
        q = unpack_int32(getattr(experts, f"{projection}_weight_packed")[expert], self.bits, dim=1)
        scale = getattr(experts, f"{projection}_weight_scale")[expert]
        if self.symmetric:
            zero = torch.full_like(scale, offset)
        else:
            zero = unpack_int32(getattr(experts, f"{projection}_weight_zero_point")[expert], self.bits, dim=0).float()
        return IntWeights(q.contiguous(), scale.contiguous(), zero, self.bits)

    def __repr__(self) -> str:
        groups = f"group {self.group_size}" if self.group_size else "channel"
        zeros = "sym" if self.symmetric else "asym"
        return f"{self.name_of_format}(w{self.bits}a16, {groups}, {zeros}, int4 kernel)"


class GPTQExpertsMethod(IntExpertsMethod):
    """GPTQ experts (Qwen-MoE GPTQ layout): per expert and projection qweight int32 [K / pack, N], qzeros int32
    [G, N / pack], scales [G, N], g_idx [K] (act-order, desc_act: each input's group; gate and up share theirs)."""

    leaves = ("qweight", "qzeros", "scales", "g_idx")
    name_of_format = "GPTQ"

    def __init__(self, bits: int, group_size: int, zero_offset: int, desc_act: bool) -> None:
        super().__init__(bits, None if group_size == -1 else group_size)
        self.zero_offset, self.desc_act = zero_offset, desc_act  # v1 stores zero - 1
        self.first_group: dict[str, int] = {}  # g_idx counts groups from the whole projection's first input

    def create_weights(self, experts: FusedExperts) -> None:
        self.check_split(experts)
        i, h, pack = experts.intermediate_size, experts.hidden_size, 32 // self.bits
        rank, slices = experts.slice_index
        for projection, (n, k) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            # act-order scatters a group's inputs over the ranks: each rank then holds every group's scales
            whole = projection == "down_proj" and self.desc_act and slices > 1
            groups = self.groups(experts, projection, k * slices if whole else k)
            group_dim = None if whole or not self.group_size else 0
            self.first_group[projection] = rank * groups if projection == "down_proj" and not whole else 0
            experts.create_parameter(f"{projection}_qweight", projection, (k // pack, n), torch.int32, 1, 0)
            experts.create_parameter(f"{projection}_qzeros", projection, (groups, n // pack), torch.int32, 1,
                                     group_dim)
            float_loader(experts.create_parameter(f"{projection}_scales", projection, (groups, n), torch.float32, 1,
                                                  group_dim))
            g_idx = experts.create_parameter(f"{projection}_g_idx", projection, (k,), torch.int32, None, 0)
            if projection == "gate_up_proj":
                _shared_by_gate_and_up(experts, g_idx)

    def int_weights(self, experts: FusedExperts, expert: int, projection: str) -> IntWeights:
        q = unpack_int32(getattr(experts, f"{projection}_qweight")[expert], self.bits, dim=0).t()  # [N, K]
        zero = unpack_int32(getattr(experts, f"{projection}_qzeros")[expert], self.bits, dim=1).t().float()
        scale = getattr(experts, f"{projection}_scales")[expert].t()  # [N, G]
        g_idx = getattr(experts, f"{projection}_g_idx")[expert].long() - self.first_group[projection]
        if bool((g_idx < 0).any()) or bool((g_idx >= scale.shape[1]).any()):
            raise ModelLoadError(f"{experts.prefix}.{projection}_g_idx of expert {expert} holds groups outside "
                                 f"0..{scale.shape[1] - 1}")
        return IntWeights(q.contiguous(), scale.contiguous(), zero + self.zero_offset, self.bits, g_idx)


def _shared_by_gate_and_up(experts: FusedExperts, param: torch.nn.Parameter) -> None:
    """gate_proj's and up_proj's g_idx load into one row per expert: they share the input, so its act-order; a
    ModelLoadError when an expert's two differ."""
    load, seen = param.weight_loader, set()  # type: ignore[attr-defined]

    def load_shared(target: torch.nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        local = experts.local_expert(shard_id)
        if local is None:
            return
        before = target.data[local].clone() if local in seen else None
        load(target, loaded, shard_id)
        if before is not None and not torch.equal(before, target.data[local]):
            raise ModelLoadError(f"{experts.prefix}: expert {shard_id.expert}'s gate_proj and up_proj g_idx differ "
                                 "(they share an input, so the same act-order is expected)")
        seen.add(local)

    param.weight_loader = load_shared  # type: ignore[attr-defined]


class AWQExpertsMethod(IntExpertsMethod):
    """AWQ (GEMM) experts: per expert and projection qweight int32 [K, N / 8] and qzeros int32 [G, N / 8] (packed
    along N in AWQ's nibble order), scales [G, N]."""

    leaves = ("qweight", "qzeros", "scales")
    name_of_format = "AWQ"

    def create_weights(self, experts: FusedExperts) -> None:
        self.check_split(experts)
        i, h = experts.intermediate_size, experts.hidden_size
        for projection, (n, k) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            groups = self.groups(experts, projection, k)
            experts.create_parameter(f"{projection}_qweight", projection, (k, n // 8), torch.int32, 1, 0)
            experts.create_parameter(f"{projection}_qzeros", projection, (groups, n // 8), torch.int32, 1, 0)
            float_loader(experts.create_parameter(f"{projection}_scales", projection, (groups, n), torch.float32, 1,
                                                  0))

    def int_weights(self, experts: FusedExperts, expert: int, projection: str) -> IntWeights:
        from llmplug.quantization.awq import AWQ_ORDER  # it imports this module's base

        q, zero = (unpack_int32(getattr(experts, f"{projection}_{leaf}")[expert], 4, 1, AWQ_ORDER).t()
                   for leaf in ("qweight", "qzeros"))  # [N, K], [N, G]
        scale = getattr(experts, f"{projection}_scales")[expert].t()  # [N, G]
        return IntWeights(q.contiguous(), scale.contiguous(), zero.float().contiguous(), 4)


def _shape_check(experts: FusedExperts, projection: str) -> Any:
    """weight_shape ([out, in] of one expert's whole checkpoint projection): checked, not kept."""
    slices = experts.slice_index[1]
    full = experts.intermediate_size * slices
    expected = [full, experts.hidden_size] if projection == "gate_up_proj" else [experts.hidden_size, full]

    def check(target: torch.nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.reshape(-1).tolist() != expected:
            raise ModelLoadError(f"{experts.prefix}.{projection} weight_shape {loaded.tolist()} is not the "
                                 f"expert's {expected}")

    return check
