"""CheckpointNames: renames on whole components, Conv1D transposes, fused q/k/v and gate/up splits."""

from __future__ import annotations

import pytest
import torch

from llmplug.layers.checkpoint_names import (
    GATE_UP,
    QKV_CODEGEN,
    QKV_CONTIGUOUS,
    QKV_GROUPED,
    QKV_PER_HEAD,
    CheckpointNames,
    HeadLayout,
)

NAMES = CheckpointNames(
    prefixes={"transformer.h": "model.layers", "h": "model.layers", "decoder.final_layer_norm": "model.norm"},
    renames={"attn.c_proj": "self_attn.o_proj", "c_proj": "down_proj", "final_layer_norm": "post_attention_layernorm"},
)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("transformer.h.0.attn.c_proj.weight", "model.layers.0.self_attn.o_proj.weight"),  # longest rule wins
        ("h.3.mlp.c_proj.bias", "model.layers.3.mlp.down_proj.bias"),  # the prefix without its base-model part
        ("decoder.final_layer_norm.weight", "model.norm.weight"),  # the prefix wins over the rename
        ("decoder.layers.1.final_layer_norm.weight", "decoder.layers.1.post_attention_layernorm.weight"),
        ("lm_head.weight", "lm_head.weight"),
        ("model.xattn.c_projection.weight", "model.xattn.c_projection.weight"),  # never a partial component
    ],
)
def test_renames_match_whole_components(name: str, expected: str) -> None:
    assert NAMES.rename(name) == expected


def translate(names: CheckpointNames, tensors: dict[str, torch.Tensor], heads: HeadLayout) -> dict[str, torch.Tensor]:
    return dict(names.translate(tensors.items(), heads))


def test_fused_qkv_layouts_split_into_the_parts_transformers_reads() -> None:
    heads, kv, d, hidden = 4, 2, 3, 5
    q, k, v = torch.randn(heads * d, hidden), torch.randn(kv * d, hidden), torch.randn(kv * d, hidden)
    layouts = {
        QKV_CONTIGUOUS: (HeadLayout(heads, kv, d), torch.cat([q, k, v])),  # Phi-3, GPT-2, MPT
        # GPT-NeoX / Bloom: [heads, (q, k, v), head_dim]
        QKV_PER_HEAD: (
            HeadLayout(heads, heads, d),
            torch.stack([t.view(heads, d, hidden) for t in (q, q.flip(0), q.flip(1))], dim=1).reshape(-1, hidden),
        ),
        # Falcon's new decoder: per KV group, its q heads then one k and one v
        QKV_GROUPED: (
            HeadLayout(heads, kv, d),
            torch.cat(
                [q.view(kv, heads // kv, d, hidden), k.view(kv, 1, d, hidden), v.view(kv, 1, d, hidden)], dim=1
            ).reshape(-1, hidden),
        ),
    }
    for layout, (shape, fused) in layouts.items():
        names = CheckpointNames(fused={"self_attn.qkv_proj": layout})
        out = translate(names, {"model.layers.0.self_attn.qkv_proj.weight": fused}, shape)
        expected = (q, q.flip(0), q.flip(1)) if layout == QKV_PER_HEAD else (q, k, v)
        got = [out[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, msg=layout)


def test_fused_bias_and_gate_up_split_and_conv1d_weights_transpose() -> None:
    names = CheckpointNames(fused={"qkv_proj": QKV_CONTIGUOUS, "gate_up_proj": GATE_UP}, transposed={"o_proj"})
    bias, gate_up, conv = torch.arange(12.0), torch.randn(8, 3), torch.randn(3, 5)
    out = translate(
        names,
        {"a.qkv_proj.bias": bias, "a.gate_up_proj.weight": gate_up, "a.o_proj.weight": conv, "a.o_proj.bias": bias},
        HeadLayout(2, 1, 3),
    )
    torch.testing.assert_close(out["a.q_proj.bias"], bias[:6])
    torch.testing.assert_close(out["a.v_proj.bias"], bias[9:])
    torch.testing.assert_close(out["a.gate_proj.weight"], gate_up[:4])
    torch.testing.assert_close(out["a.up_proj.weight"], gate_up[4:])
    torch.testing.assert_close(out["a.o_proj.weight"], conv.t())
    torch.testing.assert_close(out["a.o_proj.bias"], bias)  # a bias is never transposed


def test_ignored_names_are_dropped_and_unknown_layouts_refused() -> None:
    names = CheckpointNames(ignored=("attn.masked_bias",))
    assert translate(names, {"h.0.attn.masked_bias": torch.ones(1)}, HeadLayout(1, 1, 1)) == {}
    names = CheckpointNames(ignored_prefixes=("model.layers.2",))  # a layer after the model's own
    kept = {"model.layers.20.mlp.weight": torch.ones(1), "model.layers.1.mlp.weight": torch.ones(1)}
    weights = {"model.layers.2.mlp.weight": torch.ones(1), "model.layers.2": torch.ones(1), **kept}
    assert set(translate(names, weights, HeadLayout(1, 1, 1))) == set(kept)  # whole components only
    with pytest.raises(ValueError, match="unknown fused layouts"):
        CheckpointNames(fused={"qkv_proj": "qkv_sideways"})
    with pytest.raises(Exception, match="as many KV heads as heads"):
        translate(CheckpointNames(fused={"qkv": QKV_PER_HEAD}), {"qkv.weight": torch.ones(8, 2)}, HeadLayout(2, 1, 2))


def test_codegen_qkv_is_four_blocks_each_holding_q_v_k_of_a_quarter_of_the_heads() -> None:
    heads, d, hidden = 8, 2, 3
    q, k, v = (torch.randn(heads * d, hidden) for _ in range(3))
    quarter = lambda t: t.view(4, heads // 4 * d, hidden)  # noqa: E731
    fused = torch.stack([quarter(q), quarter(v), quarter(k)], dim=1).reshape(-1, hidden)  # as CodeGen splits it
    out = translate(CheckpointNames(fused={"qkv_proj": QKV_CODEGEN}), {"qkv_proj.weight": fused}, HeadLayout(8, 8, d))
    for name, expected in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
        torch.testing.assert_close(out[f"{name}.weight"], expected)


def test_stacked_pieces_are_gathered_in_index_order_and_a_gap_is_refused() -> None:
    names = CheckpointNames(stacked={"self_attn.q_layernorm.norms": "self_attn.q_norm"})
    rows = {f"m.0.self_attn.q_layernorm.norms.{h}.weight": torch.full((3,), float(h)) for h in (2, 0, 1)}
    out = translate(names, {**rows, "m.0.other.weight": torch.ones(1)}, HeadLayout(3, 3, 3))
    torch.testing.assert_close(out["m.0.self_attn.q_norm.weight"], torch.arange(3.0)[:, None].expand(3, 3))
    assert "m.0.other.weight" in out
    del rows["m.0.self_attn.q_layernorm.norms.1.weight"]
    with pytest.raises(Exception, match=r"pieces \[0, 2\]"):
        translate(names, rows, HeadLayout(3, 3, 3))
