"""GGUF files of the mixture-of-experts and state-space architectures: config, weights and greedy tokens.

Each tiny file is written here as llama.cpp's convert_hf_to_gguf writes that architecture: its metadata
keys, gguf-py's tensor names, the experts as three stacked tensors per layer (`ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`, each [E, out, in]) where transformers holds [gate | up] as one
`experts.gate_up_proj`, Mamba's A as -exp(A_log) and Mamba's and LFM2's conv weights without their size-1
dim. The truth is the HF model the file was written from and transformers' own GGUF load of the same file.

transformers' GGUF loader reads neither `expert_feed_forward_length` nor `expert_shared_feed_forward_length`
(it keeps its config class's defaults), so the Qwen-MoE expert sizes here are those defaults: both loads
build the same model only then (MiniMax-M2's expert size is its `intermediate_size`, which both read).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest
import torch
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from llmplug.loaders.gguf import iter_gguf_weights, load_gguf_config

from .gguf_writer_utils import add_tiny_tokenizer, hf_state_dict, make_tiny_model, tokenizer_tokens, write_gguf
from .parity import hf_greedy, our_greedy

VOCAB = tokenizer_tokens()
SIZES = dict(
    vocab_size=len(VOCAB), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, bos_token_id=VOCAB.index("<|im_start|>"), eos_token_id=VOCAB.index("<|im_end|>"),
    pad_token_id=VOCAB.index("<|endoftext|>"),
)


@dataclass(frozen=True)
class MoECase:
    """A tiny HF MoE config and the metadata llama.cpp's converter writes for it (writer method -> value)."""

    arch: str  # general.architecture
    model_type: str
    fields: dict[str, Any]
    hparams: Callable[[PretrainedConfig], dict[str, Any]]


def _decoder(c: PretrainedConfig, experts: int, expert_size: int) -> dict[str, Any]:
    return {
        "context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
        "block_count": c.num_hidden_layers, "feed_forward_length": c.intermediate_size,
        "head_count": c.num_attention_heads, "head_count_kv": c.num_key_value_heads,
        "layer_norm_rms_eps": c.rms_norm_eps, "rope_freq_base": c.rope_parameters["rope_theta"],
        "expert_count": experts, "expert_used_count": c.num_experts_per_tok, "expert_feed_forward_length": expert_size,
    }


def _mamba(c: PretrainedConfig) -> dict[str, Any]:
    return {
        "context_length": 2**20, "embedding_length": c.hidden_size, "block_count": c.num_hidden_layers,
        "feed_forward_length": 0, "head_count": 0, "ssm_conv_kernel": c.conv_kernel,
        "ssm_inner_size": c.intermediate_size, "ssm_state_size": c.state_size, "ssm_time_step_rank": c.time_step_rank,
        "layer_norm_rms_eps": c.layer_norm_epsilon,
    }


def _lfm2(c: PretrainedConfig) -> dict[str, Any]:
    kv_heads = [c.num_key_value_heads if kind == "full_attention" else 0 for kind in c.layer_types]
    return {
        "context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
        "block_count": c.num_hidden_layers, "feed_forward_length": c.intermediate_size,
        "head_count": c.num_attention_heads, "head_count_kv": kv_heads, "layer_norm_rms_eps": c.norm_eps,
        "rope_freq_base": c.rope_parameters["rope_theta"], "shortconv_l_cache": c.conv_L_cache,
    }


CASES = [
    # a gated shared expert; transformers' default expert sizes (1408, 5632) but few experts
    MoECase("qwen2moe", "qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=128),
            lambda c: {**_decoder(c, c.num_experts, c.moe_intermediate_size),
                       "expert_shared_feed_forward_length": c.shared_expert_intermediate_size}),
    # per-head q/k norms, head_dim != hidden / heads, renormalised top-2 (what llama.cpp computes)
    MoECase("qwen3moe", "qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, head_dim=32, norm_topk_prob=True,
                                         intermediate_size=128),
            lambda c: {**_decoder(c, c.num_experts, c.moe_intermediate_size), "key_length": c.head_dim,
                       "value_length": c.head_dim}),
    # q/k norms over whole projections, partial rotary, sigmoid routing with a correction bias (`exp_probs_b`)
    MoECase("minimax-m2", "minimax_m2", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                             intermediate_size=32, rotary_dim=8),
            lambda c: {**_decoder(c, c.num_local_experts, c.intermediate_size), "key_length": c.head_dim,
                       "value_length": c.head_dim, "rope_dimension_count": 8,
                       "expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID}),
    # selective scan: A stored as -exp(A_log), conv1d as [C, K], tied embeddings
    MoECase("mamba", "mamba", dict(state_size=8, conv_kernel=4, time_step_rank=8), _mamba),
    # short-conv layers beside an attention layer (per-layer KV head counts, 0: conv), conv as [C, L]
    MoECase("lfm2", "lfm2", dict(intermediate_size=128, block_auto_adjust_ff_dim=False, full_attn_idxs=[1],
                                conv_L_cache=3), _lfm2),
]


def tiny_config(case: MoECase) -> PretrainedConfig:
    """SIZES the config class has (Mamba has no heads, no context length), then the case's fields."""
    known = set(CONFIG_MAPPING[case.model_type].__dataclass_fields__)
    return AutoConfig.for_model(case.model_type, **{k: v for k, v in SIZES.items() if k in known}, **case.fields)


def converter_tensors(model: PreTrainedModel) -> dict[str, np.ndarray]:
    """The checkpoint as llama.cpp's converter holds it before naming: experts as three stacked projections,
    `x_bias` parameters as the bias of `x`, Qwen2-MoE's shared-expert gate flattened."""
    tensors = {}
    for name, tensor in hf_state_dict(model).items():
        array = tensor.numpy()
        owner, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            gate, up = np.split(array, 2, axis=1)
            tensors[f"{owner}.gate_proj.weight"], tensors[f"{owner}.up_proj.weight"] = gate, up
        elif leaf == "down_proj" and owner.endswith(".experts"):
            tensors[f"{owner}.down_proj.weight"] = array
        elif name.endswith("shared_expert_gate.weight"):
            tensors[name] = array.reshape(-1)  # llama.cpp's ffn_gate_inp_shexp is [hidden]
        elif leaf == "A_log":
            tensors[name] = -np.exp(array)  # the converter stores A itself
        elif name.endswith(("conv1d.weight", "conv.conv.weight")):
            tensors[name] = array.squeeze(1)  # [C, 1, K] -> [C, K]
        elif leaf.endswith("_bias"):
            tensors[f"{owner}.{leaf.removesuffix('_bias')}.bias"] = array
        else:
            tensors[name] = array
    return tensors


def write_moe_gguf(path: Path, case: MoECase, model: PreTrainedModel) -> Path:
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch=case.arch)
    writer.add_name("tiny")
    for key, value in case.hparams(config).items():
        getattr(writer, f"add_{key}")(value)
    add_tiny_tokenizer(writer, config)
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == case.arch)
    table = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, array in converter_tensors(model).items():
        stem, suffix = name.rsplit(".", 1)
        gguf_stem = table.get_name(stem)  # a parameter without a leaf (Mamba's A_log, D) maps whole, suffix-less
        writer.add_tensor(f"{gguf_stem}.{suffix}" if gguf_stem else table.get_name(name), array)
    write_gguf(writer)
    return path


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[PreTrainedModel, Path]]:
    """Each case's tiny model and its F32 GGUF, written once."""
    folder = tmp_path_factory.mktemp("moe")
    files = {}
    for case in CASES:
        model = make_tiny_model(tiny_config(case))
        (folder / case.model_type).mkdir()
        files[case.arch] = model, write_moe_gguf(folder / case.model_type / f"{case.model_type}.gguf", case, model)
    return files


def restacked(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-expert tensors the loader yields (`experts.<e>.gate_proj.weight`, ...) stacked back into
    transformers' `experts.gate_up_proj` [E, 2I, hidden] / `experts.down_proj` layout."""
    out = {}
    for name in expected:
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".experts") and leaf in ("gate_up_proj", "down_proj"):
            num = expected[name].shape[0]
            parts = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
            out[name] = torch.stack(
                [torch.cat([ours.pop(f"{owner}.{e}.{part}.weight") for part in parts]) for e in range(num)]
            )
    return out | ours


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.arch)
def test_weights_are_the_hf_checkpoint_the_file_was_written_from(case: MoECase, moe_files) -> None:
    model, path = moe_files[case.arch]
    expected = hf_state_dict(model)
    ours = restacked(dict(iter_gguf_weights(str(path), torch.float32, progress=False)), expected)
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():  # Mamba's A_log went through -exp and back
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-6 if name.endswith("A_log") else 0, msg=name)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.arch)
def test_config_from_the_file_is_the_one_it_was_written_from(case: MoECase, moe_files) -> None:
    model, path = moe_files[case.arch]
    ours, theirs = load_gguf_config(str(path)).to_dict(), model.config.to_dict()
    skip = {"architectures", "_name_or_path", "transformers_version", "dtype"}
    differing = {k: (ours.get(k), theirs.get(k)) for k in theirs if k not in skip and ours.get(k) != theirs.get(k)}
    assert all(isinstance(a, float) and a == pytest.approx(b) for a, b in differing.values()), differing  # float32 eps


# the Qwen-MoE models carry transformers' default expert sizes (1408 / 5632 and 768 features): ~20 s each
SLOW_GREEDY = {"qwen2moe", "qwen3moe"}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[pytest.mark.slow] if c.arch in SLOW_GREEDY else []) for c in CASES],
    ids=lambda c: c.arch,
)
def test_greedy_tokens_equal_transformers_on_the_checkpoint_and_on_the_same_gguf(case: MoECase, moe_files) -> None:
    model, path = moe_files[case.arch]
    ours = our_greedy(path, "gguf")
    assert ours == hf_greedy(model)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    assert ours == hf_greedy(theirs)
