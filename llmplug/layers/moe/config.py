"""The typed, frozen description of a mixture-of-experts MLP: its router, experts and shared experts.

A family's config adapter reads its HF config once into a `MoEConfig`; `SparseMoeBlock` reads nothing
else. Defaults are Mixtral's choices where a family has to pick one (softmax scores, SiLU experts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["MoEConfig", "RouterConfig"]


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """How each token picks `top_k` of `num_experts` experts and weighs their outputs.

    Order, as the families compute it: logits = x W^T (+ bias); scores = scoring(logits); experts are
    chosen on the scores (+ the correction bias), within the best `topk_groups` of `num_groups` groups;
    their weights are the chosen scores (without the correction bias), renormalised by their p-norm
    when `topk_norm` is set, times `scaling_factor`.
    """

    num_experts: int
    top_k: int
    # softmax over all experts (Mixtral, Qwen-MoE, DeepSeek V2); sigmoid per expert (DeepSeek V3, Llama 4);
    # sparsemixer: Phi-3.5-MoE's two masked softmaxes (top-2 only)
    scoring: Literal["softmax", "sigmoid", "sparsemixer"] = "softmax"
    topk_norm: float | None = None  # weights / ||weights||_p (1.0: they sum to one; DBRX: its p); None: as scored
    num_groups: int = 1  # grouped top-k (DeepSeek): experts in num_groups equal groups ...
    topk_groups: int = 1  # ... of which only the best topk_groups may be chosen from
    group_score: Literal["max", "top2_sum"] = "max"  # a group's score: its best expert (V2), its best two (V3)
    correction_bias: bool = False  # `e_score_correction_bias` added to the scores to choose, not to weigh
    scaling_factor: float = 1.0  # routed_scaling_factor (DeepSeek)
    bias: bool = False  # the router projection has a bias (GPT-OSS)
    sparsemixer_eps: float = 0.0  # sparsemixer's mask threshold (Phi-3.5-MoE's router_jitter_noise)
    float32: bool = False  # logits from float32 weights and inputs (DeepSeek V3, ERNIE keep the router in float32)
    weights_on_input: bool = False  # each chosen expert gets weight * x and its output is summed unscaled (Llama 4)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"router: top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(
                f"router: {self.num_experts} experts in num_groups={self.num_groups} groups with "
                f"topk_groups={self.topk_groups}: the groups must be equal and topk_groups in 1..num_groups"
            )
        if self.scoring == "sparsemixer" and self.top_k != 2:
            raise ValueError(f"router: sparsemixer routing picks exactly 2 experts, not top_k={self.top_k}")


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A sparse MLP: routed experts (gated MLPs of `intermediate_size`), optional shared experts."""

    router: RouterConfig
    intermediate_size: int  # of each routed expert
    activation: str = "silu"  # a gated activation of llmplug.layers.activation: act(gate) * up
    expert_bias: bool = False  # biases on the experts' projections (GPT-OSS)
    # GPT-OSS's clamped SwiGLU: gate clamped above at limit, up to [-limit, limit],
    # out = gate * sigmoid(alpha * gate) * (up + 1); None: plain act(gate) * up
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    shared_intermediate_size: int = 0  # the shared experts' MLP (all of them as one); 0: none
    shared_expert_gate: bool = False  # the shared output times sigmoid(x w) (Qwen2-MoE)
    shared_bias: bool = False  # biases on the shared experts' projections (ERNIE's use_bias)
    output_bias: bool = False  # a bias [hidden] added to the block's output (JetMoe)

    @property
    def num_experts(self) -> int:
        """Routed experts."""
        return self.router.num_experts
