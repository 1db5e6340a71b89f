"""The mixture-of-experts block against transformers' own MoE modules, weights loaded through the checkpoint maps.

Each transformers block gets random parameters *and* buffers (DeepSeek V3's score-correction bias is
a buffer the parity checkpoints leave at zero), is saved in its family's checkpoint layout, and loaded
into a SparseMoeBlock through `CheckpointNames` + `load_mapped_weights(..., experts=EXPERT_PARAMS)`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    DbrxConfig,
    DeepseekV2Config,
    DeepseekV3Config,
    Ernie4_5_MoeConfig,
    GptOssConfig,
    Llama4TextConfig,
    MixtralConfig,
    PhimoeConfig,
    Qwen2MoeConfig,
)
from transformers.models.dbrx.modeling_dbrx import DbrxFFN
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeSparseMoeBlock
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.phimoe.modeling_phimoe import PhimoeSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

from llmplug.core.errors import ModelLoadError
from llmplug.layers.checkpoint_names import (
    EXPERTS,
    EXPERTS_FLAT,
    EXPERTS_FLAT_T,
    EXPERTS_T,
    EXPERTS_T_INTERLEAVED,
    CheckpointNames,
    HeadLayout,
)
from llmplug.layers.moe import EXPERT_PARAMS, MoEConfig, RouterConfig, SparseMoeBlock
from llmplug.layers.packed_linear import prepack_supported
from llmplug.layers.quantization import LinearOptions, process_weights_after_loading
from llmplug.layers.weight_utils import load_mapped_weights, missing_parameters

H, I, E = 32, 16, 8
SIZES = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)

# transformers' in-memory expert layouts (its checkpoints convert to these on load): parameters
# `experts.gate_up_proj` / `experts.down_proj` without a `.weight` leaf
WEIGHT_LEAF = {"experts.gate_up_proj": "experts.gate_up_proj.weight", "experts.down_proj": "experts.down_proj.weight"}


def stacked(layout: str, gate_up_layout: str | None = None, **renames: str) -> CheckpointNames:
    fused = {"experts.gate_up_proj": gate_up_layout or layout, "experts.down_proj": layout}
    return CheckpointNames(renames=WEIGHT_LEAF | renames, fused=fused)


STACKED = stacked(EXPERTS)
# GPT-OSS: [E, in, 2 * out] with gate / up columns alternating, biases beside the weights
GPT_OSS = stacked(
    EXPERTS_T,
    EXPERTS_T_INTERLEAVED,
    router="gate",
    **{"experts.gate_up_proj_bias": "experts.gate_up_proj.bias", "experts.down_proj_bias": "experts.down_proj.bias"},
)
LLAMA4 = stacked(EXPERTS_T, router="gate", shared_expert="shared_experts")
QWEN2_MOE = stacked(EXPERTS, shared_expert="shared_experts")
ERNIE = stacked(EXPERTS, **{"gate.moe_statics": "gate"})
# DBRX (its own checkpoint names): w1 / v1 [E * I, H] gate / up, w2 [E * I, H] down transposed
DBRX = CheckpointNames(
    renames={"router.layer": "gate", "experts.mlp.w1": "experts.gate_proj.weight",
             "experts.mlp.v1": "experts.up_proj.weight", "experts.mlp.w2": "experts.down_proj.weight"},
    fused={"experts.gate_proj": EXPERTS_FLAT, "experts.up_proj": EXPERTS_FLAT, "experts.down_proj": EXPERTS_FLAT_T},
)


def randomized_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter and buffer random (std 0.5: routers far from ties)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5)
    return module.eval()


def checkpoint(module: torch.nn.Module, names: CheckpointNames, prefix: str = "mlp") -> list[tuple[str, torch.Tensor]]:
    """The module's state dict under `prefix`, translated by `names` (stacked experts split per expert)."""
    tensors = [(f"{prefix}.{name}" if name else prefix, t) for name, t in module.state_dict().items()]
    tensors = [(name.replace("..", "."), t) for name, t in tensors]
    return list(names.translate(tensors, HeadLayout(4, 2, 8, num_experts=E)))


class Wrapper(torch.nn.Module):
    """Holds the block as `mlp`, as a decoder layer does."""

    def __init__(self, block: SparseMoeBlock) -> None:
        super().__init__()
        self.mlp = block


def ours(config: MoEConfig, weights: list[tuple[str, torch.Tensor]]) -> SparseMoeBlock:
    model = Wrapper(SparseMoeBlock(config, H, "mlp"))
    loaded = load_mapped_weights(model, weights, {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)},
                                 experts=EXPERT_PARAMS)
    assert not missing_parameters(model, loaded)
    return model.mlp


def output(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = block(x)
    return out[0] if isinstance(out, tuple) else out


CASES = {
    # softmax, top-2 renormalised
    "mixtral": (
        lambda: MixtralSparseMoeBlock(MixtralConfig(**SIZES, num_local_experts=E, intermediate_size=I)),
        STACKED,
        MoEConfig(RouterConfig(E, 2, topk_norm=1.0), I),
    ),
    # softmax top-4 without renormalising, a sigmoid-gated shared expert
    "qwen2_moe": (
        lambda: Qwen2MoeSparseMoeBlock(
            Qwen2MoeConfig(**SIZES, num_experts=E, num_experts_per_tok=4, moe_intermediate_size=I,
                           shared_expert_intermediate_size=24, norm_topk_prob=False)
        ),
        QWEN2_MOE,
        MoEConfig(RouterConfig(E, 4), I, shared_intermediate_size=24, shared_expert_gate=True),
    ),
    # softmax, groups scored by their best expert, routed scaling, shared experts
    "deepseek_v2": (
        lambda: DeepseekV2Moe(
            DeepseekV2Config(**SIZES, n_routed_experts=E, num_experts_per_tok=3, moe_intermediate_size=I,
                             n_shared_experts=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                             routed_scaling_factor=2.5)
        ),
        STACKED,
        MoEConfig(RouterConfig(E, 3, num_groups=4, topk_groups=2, scaling_factor=2.5), I, shared_intermediate_size=32),
    ),
    # sigmoid, score-correction bias, groups scored by their best two, renormalised, scaled, float32 router
    "deepseek_v3": (
        lambda: DeepseekV3MoE(
            DeepseekV3Config(**SIZES, n_routed_experts=E, num_experts_per_tok=3, moe_intermediate_size=I,
                             n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5)
        ),
        STACKED,
        MoEConfig(
            RouterConfig(E, 3, "sigmoid", 1.0, 4, 2, "top2_sum", correction_bias=True, scaling_factor=2.5, float32=True),
            I,
            shared_intermediate_size=I,
        ),
    ),
    # softmax chosen with a correction bias ([1, E] in the checkpoint), shared experts
    "ernie4_5_moe": (
        lambda: Ernie4_5_MoeSparseMoeBlock(
            Ernie4_5_MoeConfig(**SIZES, moe_num_experts=E, moe_k=2, moe_intermediate_size=I, moe_num_shared_experts=1)
        ),
        ERNIE,
        MoEConfig(RouterConfig(E, 2, topk_norm=1.0, correction_bias=True, float32=True), I, shared_intermediate_size=I),
    ),
    # router bias, top-k then softmax, clamped SwiGLU with expert biases, interleaved stacked gate/up
    "gpt_oss": (
        lambda: GptOssMLP(GptOssConfig(**SIZES, num_local_experts=E, num_experts_per_tok=2, intermediate_size=I)),
        GPT_OSS,
        MoEConfig(RouterConfig(E, 2, topk_norm=1.0, bias=True), I, expert_bias=True, swiglu_limit=7.0),
    ),
    # sigmoid weights applied to the expert's input, an ungated shared expert
    "llama4": (
        lambda: Llama4TextMoe(
            Llama4TextConfig(**SIZES, num_local_experts=E, num_experts_per_tok=1, intermediate_size=I)
        ),
        LLAMA4,
        MoEConfig(RouterConfig(E, 1, "sigmoid", weights_on_input=True), I, shared_intermediate_size=I),
    ),
    # sparsemixer
    "phimoe": (
        lambda: PhimoeSparseMoeBlock(PhimoeConfig(**SIZES, num_local_experts=E, intermediate_size=I,
                                                  router_jitter_noise=0.3)),
        stacked(EXPERTS, router="gate"),
        MoEConfig(RouterConfig(E, 2, "sparsemixer", sparsemixer_eps=0.3), I),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_block_matches_transformers(name: str) -> None:
    make, names, config = CASES[name]
    torch.manual_seed(0)
    theirs = randomized_(make())
    block = ours(config, checkpoint(theirs, names))
    x = torch.randn(13, H)
    with torch.no_grad():
        torch.testing.assert_close(block(x), output(theirs, x.unsqueeze(0)).reshape(13, H), rtol=1e-4, atol=1e-5)


def test_dbrx_flat_expert_tensors_load_per_expert_and_match_transformers() -> None:
    config = DbrxConfig(d_model=H, n_heads=4, n_layers=1, attn_config={"kv_n_heads": 2, "rope_theta": 10000.0},
                        ffn_config={"ffn_hidden_size": I, "moe_num_experts": E, "moe_top_k": 2,
                                    "moe_normalize_expert_weights": 2.0})
    theirs = randomized_(DbrxFFN(config))
    block = ours(MoEConfig(RouterConfig(E, 2, topk_norm=2.0), I), checkpoint(theirs, DBRX))
    x = torch.randn(9, H)
    with torch.no_grad():
        torch.testing.assert_close(block(x), output(theirs, x.unsqueeze(0)).reshape(9, H), rtol=1e-4, atol=1e-5)


def test_an_expert_tensor_of_the_wrong_shape_is_a_load_error_naming_it() -> None:
    config = MoEConfig(RouterConfig(E, 2), I)
    weights = [("mlp.experts.3.gate_proj.weight", torch.zeros(I + 1, H))]
    with pytest.raises(ModelLoadError, match="mlp.experts.3.gate_proj.weight"):
        load_mapped_weights(Wrapper(SparseMoeBlock(config, H, "mlp")), weights, experts=EXPERT_PARAMS)


def test_a_missing_expert_leaves_its_stacked_parameter_unloaded() -> None:
    theirs = randomized_(MixtralSparseMoeBlock(MixtralConfig(**SIZES, num_local_experts=E, intermediate_size=I)))
    weights = [(n, t) for n, t in checkpoint(theirs, STACKED) if ".experts.5.down_proj" not in n]
    model = Wrapper(SparseMoeBlock(MoEConfig(RouterConfig(E, 2), I), H, "mlp"))
    loaded = load_mapped_weights(model, weights, experts=EXPERT_PARAMS)
    assert missing_parameters(model, loaded) == ["mlp.experts.down_proj"]


def test_router_config_refuses_impossible_routing() -> None:
    with pytest.raises(ValueError, match="top_k=9"):
        RouterConfig(8, 9)
    with pytest.raises(ValueError, match="num_groups=3"):
        RouterConfig(8, 2, num_groups=3)
    with pytest.raises(ValueError, match="sparsemixer"):
        RouterConfig(8, 3, "sparsemixer")



@pytest.mark.skipif(not prepack_supported("cpu", torch.bfloat16), reason="oneDNN bf16 packed linear not available")
def test_packed_expert_weights_compute_what_the_dense_ones_do_and_never_go_stale() -> None:
    theirs = randomized_(MixtralSparseMoeBlock(MixtralConfig(**SIZES, num_local_experts=E, intermediate_size=I)))
    weights = [(n, t.bfloat16()) for n, t in checkpoint(theirs, STACKED)]
    block = ours(MoEConfig(RouterConfig(E, 2, topk_norm=1.0), I), weights).bfloat16()
    x = torch.randn(9, H).bfloat16()
    dense = block(x)
    process_weights_after_loading(block, LinearOptions(int4=False))
    assert block.experts.packed is not None and torch.equal(block(x), dense)
    name, tensor = next((n, t) for n, t in weights if n.startswith("mlp.experts.1.down_proj"))
    load_mapped_weights(Wrapper(block), [(name, tensor * 2)], experts=EXPERT_PARAMS)
    assert block.experts.packed is None and not torch.equal(block(x), dense)
