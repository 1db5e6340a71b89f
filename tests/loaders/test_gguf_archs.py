"""GGUF files of the non-Llama dense architectures: config, weights and greedy tokens.

Each tiny file is written here the way llama.cpp's convert_hf_to_gguf writes that architecture (its
hyperparameter keys, gguf-py's tensor names, and its tensor changes: Gemma's and Nemotron's norms stored
as `1 + w`, GPT-2's Conv1D weights transposed, Bloom's per-head q/k/v regrouped as [q | k | v]). The
truth is the HF checkpoint the file was written from and transformers' own GGUF load of the same file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from llmplug.core.errors import ModelLoadError
from llmplug.loaders.gguf import iter_gguf_weights, load_gguf_config

from .gguf_writer_utils import add_tiny_tokenizer, hf_state_dict, make_tiny_model, tokenizer_tokens, write_gguf
from .parity import hf_greedy, our_greedy

VOCAB = tokenizer_tokens()
SIZES = dict(
    vocab_size=len(VOCAB), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256
)
IDS = dict(bos_token_id=VOCAB.index("<|im_start|>"), eos_token_id=VOCAB.index("<|im_end|>"),
           pad_token_id=VOCAB.index("<|endoftext|>"))  # the ids add_tiny_tokenizer writes


@dataclass(frozen=True)
class ArchCase:
    """A tiny HF config and the metadata llama.cpp's converter writes for it (writer method -> config value)."""

    arch: str  # general.architecture
    model_type: str
    fields: dict[str, Any]
    hparams: Callable[[PretrainedConfig], dict[str, Any]]
    norm_offset: float = 0.0
    conv1d: bool = False
    qkv_per_head: bool = False
    tied_output_copy: bool = False  # the converter writes output.weight as a copy of token_embd


def _decoder(config: PretrainedConfig, eps_key: str, eps: float) -> dict[str, Any]:
    return {
        "context_length": config.max_position_embeddings, "embedding_length": config.hidden_size,
        "block_count": config.num_hidden_layers, "feed_forward_length": config.intermediate_size,
        "head_count": config.num_attention_heads, "head_count_kv": config.num_key_value_heads, eps_key: eps,
    }


def _gemma(c: PretrainedConfig, softcaps: bool) -> dict[str, Any]:
    caps = {"attn_logit_softcapping": c.attn_logit_softcapping, "final_logit_softcapping": c.final_logit_softcapping}
    return {
        **_decoder(c, "layer_norm_rms_eps", c.rms_norm_eps), "key_length": c.head_dim, "value_length": c.head_dim,
        "sliding_window": c.sliding_window, "rope_freq_base": c.rope_parameters.get("full_attention", {}).get(
            "rope_theta", 10000.0), **(caps if softcaps else {}),
    }


def _rope_dims(c: PretrainedConfig) -> int:
    factor = getattr(c, "partial_rotary_factor", None) or c.rope_parameters.get("partial_rotary_factor", 1.0)
    return int(factor * c.hidden_size // c.num_attention_heads)


# head_dim 256 and the default soft-caps: what transformers assumes when the file does not say (its GGUF
# config reads neither soft-caps nor query_pre_attn_scalar), so both loads can be compared
CASES = [
    ArchCase("gemma2", "gemma2", dict(head_dim=256, intermediate_size=128, num_key_value_heads=2, sliding_window=8,
                                     query_pre_attn_scalar=256), lambda c: _gemma(c, softcaps=True), norm_offset=1.0),
    ArchCase("gemma3", "gemma3_text", dict(head_dim=256, intermediate_size=128, num_key_value_heads=1,
                                          num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=256),
             lambda c: _gemma(c, softcaps=False), norm_offset=1.0),
    ArchCase("phi3", "phi3", dict(intermediate_size=128, num_key_value_heads=2),
             lambda c: {**_decoder(c, "layer_norm_rms_eps", c.rms_norm_eps), "rope_dimension_count": _rope_dims(c),
                        "rope_freq_base": c.rope_parameters["rope_theta"]}),
    ArchCase("stablelm", "stablelm", dict(intermediate_size=128, num_key_value_heads=2, use_qkv_bias=True),
             lambda c: {**_decoder(c, "layer_norm_eps", c.layer_norm_eps), "rope_dimension_count": _rope_dims(c),
                        "parallel_residual": c.use_parallel_residual}),
    ArchCase("starcoder2", "starcoder2", dict(intermediate_size=128, num_key_value_heads=2),
             lambda c: _decoder(c, "layer_norm_eps", c.norm_epsilon)),
    ArchCase("nemotron", "nemotron", dict(intermediate_size=128, num_key_value_heads=2),
             lambda c: {**_decoder(c, "layer_norm_eps", c.norm_eps), "rope_dimension_count": _rope_dims(c),
                        "rope_freq_base": c.rope_parameters["rope_theta"]}, norm_offset=1.0),
    ArchCase("gpt2", "gpt2", dict(n_inner=256, max_position_embeddings=1024),  # transformers reads n_ctx, not n_positions
             lambda c: {"block_count": c.n_layer, "context_length": c.n_positions, "embedding_length": c.n_embd,
                        "feed_forward_length": 4 * c.n_embd, "head_count": c.n_head,
                        "layer_norm_eps": c.layer_norm_epsilon},
             conv1d=True, tied_output_copy=True),
    ArchCase("bloom", "bloom", dict(),
             lambda c: {"context_length": c.hidden_size, "embedding_length": c.hidden_size,
                        "feed_forward_length": 4 * c.hidden_size, "block_count": c.n_layer, "head_count": c.n_head,
                        "head_count_kv": c.n_head, "layer_norm_eps": c.layer_norm_epsilon},
             qkv_per_head=True, tied_output_copy=True),
]
CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")


def tiny_config(case: ArchCase) -> PretrainedConfig:
    return AutoConfig.for_model(case.model_type, **{**SIZES, **IDS, **case.fields})


def converted(case: ArchCase, config: PretrainedConfig, name: str, array: np.ndarray) -> np.ndarray:
    """What llama.cpp's converter stores for the HF tensor `name`."""
    if case.norm_offset and name.endswith("norm.weight"):
        return array + case.norm_offset
    if case.conv1d and name.endswith(CONV1D):
        return array.T.copy()
    if case.qkv_per_head and ".query_key_value." in name:
        heads = config.num_attention_heads  # [heads, (q, k, v), d, ...] -> [(q, k, v), heads, d, ...]
        return array.reshape(heads, 3, -1, *array.shape[1:]).swapaxes(0, 1).reshape(array.shape)
    return array


def write_arch_gguf(
    path: Path, case: ArchCase, model: PreTrainedModel, extra_tensors: dict[str, np.ndarray] | None = None
) -> Path:
    """`model` as llama.cpp's converter writes `case.arch`, F32, with the tiny tokenizer (+ `extra_tensors`)."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch=case.arch)
    writer.add_name("tiny")
    for key, value in case.hparams(config).items():
        getattr(writer, f"add_{key}")(value)
    add_tiny_tokenizer(writer, config)
    table = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == case.arch),
                                     config.num_hidden_layers)
    for name, tensor in hf_state_dict(model).items():
        stem, suffix = name.rsplit(".", 1)
        if case.arch == "bloom":
            stem = stem.removeprefix("transformer.")  # as the converter does before mapping
        writer.add_tensor(f"{table.get_name(stem)}.{suffix}", converted(case, config, name, tensor.numpy()))
    if case.tied_output_copy:
        writer.add_tensor("output.weight", model.get_input_embeddings().weight.detach().numpy().copy())
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    write_gguf(writer)
    return path


@pytest.fixture(scope="module")
def arch_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[PreTrainedModel, Path]]:
    """Each case's tiny model and its F32 GGUF, written once."""
    folder = tmp_path_factory.mktemp("archs")
    files = {}
    for case in CASES:
        model = make_tiny_model(tiny_config(case))
        (folder / case.arch).mkdir()
        files[case.arch] = model, write_arch_gguf(folder / case.arch / f"{case.arch}.gguf", case, model)
    return files


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.arch)
def test_weights_are_the_hf_checkpoint_the_file_was_written_from(case: ArchCase, arch_files) -> None:
    model, path = arch_files[case.arch]
    expected = hf_state_dict(model)
    ours = dict(iter_gguf_weights(str(path), torch.float32, progress=False))
    if case.tied_output_copy:
        assert torch.equal(ours.pop("lm_head.weight"), model.get_input_embeddings().weight)
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.arch)
def test_config_from_the_file_is_the_one_it_was_written_from(case: ArchCase, arch_files) -> None:
    model, path = arch_files[case.arch]
    ours, theirs = load_gguf_config(str(path)).to_dict(), model.config.to_dict()
    skip = {"architectures", "_name_or_path", "transformers_version", "tie_word_embeddings", "dtype",
            "max_position_embeddings"}  # tying: files with an output copy load untied (same logits)
    differing = {k: (ours.get(k), theirs.get(k)) for k in theirs if k not in skip and ours.get(k) != theirs.get(k)}
    assert all(isinstance(a, float) and a == pytest.approx(b) for a, b in differing.values()), differing  # float32 eps


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.arch)
def test_greedy_tokens_equal_transformers_on_the_checkpoint_and_on_the_same_gguf(case: ArchCase, arch_files) -> None:
    model, path = arch_files[case.arch]
    ours = our_greedy(path, "gguf")
    assert ours == hf_greedy(model)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    assert ours == hf_greedy(theirs)


def test_stablelm_per_head_qk_norms_are_a_clear_error(arch_files, tmp_path: Path) -> None:
    case = next(c for c in CASES if c.arch == "stablelm")
    model, _ = arch_files["stablelm"]
    norms = {"blk.0.attn_q_norm.weight": np.ones((4, 16), dtype=np.float32)}  # the converter stacks one per head
    with pytest.raises(ModelLoadError, match="per-head q/k norms"):
        load_gguf_config(str(write_arch_gguf(tmp_path / "qk.gguf", case, model, norms)))
