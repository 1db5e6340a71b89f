"""DefaultLoader reads HF checkpoints (safetensors single/sharded, torch .bin) into the generic decoder;
DummyLoader builds the same model with reproducible random weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from llmplug.core.config import EngineConfig, LoadConfig, ModelConfig
from llmplug.core.errors import ModelLoadError
from llmplug.layers.attention import bind_kv_cache
from llmplug.layers.attention.torch_sdpa import TorchSDPABackend
from llmplug.layers.forward_context import CommonAttentionMetadata, forward_context
from llmplug.layers.rotary import get_rope
from llmplug.loaders import resolve_load_format
from llmplug.loaders.default import DefaultLoader
from llmplug.loaders.dummy import DummyLoader
from llmplug.plugins.models.llama import LlamaForCausalLM

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def tiny_config(**overrides) -> LlamaConfig:
    sizes = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, architectures=["LlamaForCausalLM"],
    )
    return LlamaConfig(**{**sizes, **overrides})


def tiny_state_dict(config: LlamaConfig) -> dict[str, torch.Tensor]:
    """A random HF-named state dict of the tiny Llama."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def write_checkpoint(
    path: Path, state: dict[str, torch.Tensor], config: LlamaConfig, kind: str = "safetensors"
) -> Path:
    """config.json plus the weights as one safetensors file or a torch-saved .bin."""
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    if kind == "safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    else:
        torch.save(state, path / "pytorch_model.bin")
    return path


def load(path: Path, loader_cls: type = DefaultLoader, fmt: str = "auto", **model_kwargs) -> torch.nn.Module:
    config = EngineConfig(model=ModelConfig(model=str(path), **model_kwargs), load=LoadConfig(format=fmt))
    return loader_cls(config.load).load_model(config, model_class=LlamaForCausalLM)


def expected_param(name: str, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """What our parameter `name` must hold: the HF tensor, or the concatenation of the fused ones."""
    for fused, parts in FUSED.items():
        if f".{fused}." in name:
            return torch.cat([state[name.replace(fused, part)] for part in parts])
    return state[name]


def assert_matches(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        assert torch.equal(param, expected_param(name, state)), name


def test_single_safetensors_file_fills_every_parameter(tmp_path: Path) -> None:
    config = tiny_config(tie_word_embeddings=True)
    state = tiny_state_dict(config)
    model = load(write_checkpoint(tmp_path, state, config), dtype="float32")
    assert_matches(model, state)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.training


def test_sharded_safetensors_with_index_loads_every_shard(tmp_path: Path) -> None:
    config = tiny_config()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert_matches(load(tmp_path, dtype="float32"), hf.state_dict())


def test_torch_bin_checkpoint_loads_with_weights_only(tmp_path: Path) -> None:
    config = tiny_config()
    state = tiny_state_dict(config)
    assert_matches(load(write_checkpoint(tmp_path, state, config, kind="bin"), dtype="float32"), state)


class NotATensor:
    """Pickled into a checkpoint, it would run code on a plain torch.load."""


def test_bin_holding_python_objects_is_refused_naming_the_file(tmp_path: Path) -> None:
    config = tiny_config()
    write_checkpoint(tmp_path, {"model.embed_tokens.weight": NotATensor()}, config, kind="bin")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin holds more than tensors.*weights_only"):
        load(tmp_path, dtype="float32")


def test_pt_file_that_is_not_a_flat_state_dict_is_refused_naming_the_entry(tmp_path: Path) -> None:
    config = tiny_config()
    write_checkpoint(tmp_path, {"state_dict": tiny_state_dict(config)}, config, kind="bin")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin is not a flat .*'state_dict' holds a dict"):
        load(tmp_path, dtype="float32")


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_truncated_checkpoint_is_an_error_naming_the_file(kind: str, tmp_path: Path) -> None:
    config = tiny_config()
    write_checkpoint(tmp_path, tiny_state_dict(config), config, kind=kind)
    [weights] = [f for f in tmp_path.iterdir() if f.suffix in (".safetensors", ".bin")]
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match=rf"{weights.name} is not a readable .*truncated or corrupted"):
        load(tmp_path, dtype="float32")


def test_safetensors_preferred_over_bin_unless_format_pt(tmp_path: Path) -> None:
    config = tiny_config()
    state = tiny_state_dict(config)
    write_checkpoint(tmp_path, state, config)
    zeros = {name: torch.zeros_like(t) for name, t in state.items()}
    write_checkpoint(tmp_path, zeros, config, kind="bin")
    assert_matches(load(tmp_path, dtype="float32"), state)
    assert_matches(load(tmp_path, fmt="pt", dtype="float32"), zeros)


def test_model_is_built_in_the_configured_dtype(tmp_path: Path) -> None:
    config = tiny_config()
    model = load(write_checkpoint(tmp_path, tiny_state_dict(config), config), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_embs[0].cos_sin_cache.dtype == torch.float32  # tables keep full precision


def test_missing_weight_names_the_parameter(tmp_path: Path) -> None:
    config = tiny_config()
    state = tiny_state_dict(config)
    del state["model.layers.1.mlp.up_proj.weight"], state["model.norm.weight"]
    with pytest.raises(ModelLoadError) as info:
        load(write_checkpoint(tmp_path, state, config), dtype="float32")
    assert "model.layers.1.mlp.gate_up_proj.weight" in str(info.value)
    assert "model.norm.weight" in str(info.value)


def test_unexpected_weight_names_every_stray_tensor(tmp_path: Path) -> None:
    config = tiny_config()
    state = tiny_state_dict(config)
    state["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(4)
    state["model.layers.0.q_proj_typo.weight"] = torch.zeros(4)
    with pytest.raises(ModelLoadError) as info:
        load(write_checkpoint(tmp_path, state, config), dtype="float32")
    assert "model.layers.0.self_attn.extra_proj.weight" in str(info.value)
    assert "model.layers.0.q_proj_typo.weight" in str(info.value)


def test_rotary_inv_freq_of_old_checkpoints_is_ignored(tmp_path: Path) -> None:
    config = tiny_config()
    state = tiny_state_dict(config)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    assert_matches(load(write_checkpoint(tmp_path, state, config), dtype="float32"), state)


def test_shape_mismatch_names_the_tensor(tmp_path: Path) -> None:
    config = tiny_config()
    state = tiny_state_dict(config)
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(40, 64)
    with pytest.raises(ModelLoadError, match="model.layers.0.self_attn.k_proj.weight"):
        load(write_checkpoint(tmp_path, state, config), dtype="float32")


@pytest.mark.parametrize("name", ["/nonexistent/model-dir", "some-org/some-model-not-in-cache"])
def test_absent_model_says_it_is_not_downloaded(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    loader = DefaultLoader(LoadConfig(download_dir=str(tmp_path)))
    with pytest.raises(ModelLoadError, match="not found.*does not download"):
        loader.download_model(ModelConfig(model=name))


def test_hf_overrides_apply_to_the_config(tmp_path: Path) -> None:
    config = tiny_config()
    write_checkpoint(tmp_path, tiny_state_dict(config), config)
    model_config = ModelConfig(model=str(tmp_path), hf_overrides={"rms_norm_eps": 0.25})
    hf = DefaultLoader(LoadConfig()).load_hf_config(model_config)
    assert hf.rms_norm_eps == 0.25


def test_config_without_architectures_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="architectures"):
        DefaultLoader(LoadConfig()).get_model_class(tiny_config(architectures=None))


def test_tokenizer_loads_from_local_files(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path)
    tokenizer = DefaultLoader(LoadConfig()).load_tokenizer(ModelConfig(model=str(tmp_path)))
    assert tokenizer("hello world")["input_ids"] == [1, 2]


def test_resolve_load_format(tmp_path: Path) -> None:
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert resolve_load_format(str(gguf_file), "auto") == "gguf"
    assert resolve_load_format(str(tmp_path), "auto") == "gguf"  # a folder holding only a .gguf
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_load_format(str(tmp_path), "auto") == "default"
    assert resolve_load_format(str(gguf_file), "dummy") == "dummy"


def prefill_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Logits of one prompt, run without a KV cache."""
    bind_kv_cache(model, None, TorchSDPABackend)
    n = len(tokens)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, n]), seq_lens=torch.tensor([n]), num_computed_tokens=torch.tensor([0]),
        block_tables=torch.zeros(1, 1, dtype=torch.int64), slot_mapping=torch.arange(n), positions=torch.arange(n),
        block_size=n, num_reqs=1, num_tokens=n, max_query_len=n, max_seq_len=n,
        query_lens_list=(n,), seq_lens_list=(n,),
    )
    with torch.inference_mode(), forward_context(TorchSDPABackend.build_metadata(common)):
        return model.compute_logits(model(torch.tensor(tokens), torch.arange(n)))


def test_dummy_weights_are_reproducible_finite_and_rotary_tables_real(tmp_path: Path) -> None:
    tiny_config().save_pretrained(tmp_path)  # a config and no weights at all
    first = load(tmp_path, DummyLoader, fmt="dummy", dtype="float32", seed=3)
    again = load(tmp_path, DummyLoader, fmt="dummy", dtype="float32", seed=3)
    other = load(tmp_path, DummyLoader, fmt="dummy", dtype="float32", seed=4)
    for (name, a), b, c in zip(first.named_parameters(), again.parameters(), other.parameters()):
        assert torch.equal(a, b) and not torch.equal(a, c), name
    rotary = first.model.rotary_embs[0].cos_sin_cache
    assert rotary.device.type == "cpu" and torch.equal(rotary, get_rope(16, 16, 128, 10000.0).cos_sin_cache)
    logits = prefill_logits(first, [1, 5, 9, 3])
    assert logits.shape == (4, 256) and logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_dummy_model_in_bfloat16_gives_finite_logits(tmp_path: Path) -> None:
    tiny_config(tie_word_embeddings=True).save_pretrained(tmp_path)
    model = load(tmp_path, DummyLoader, fmt="dummy", dtype="bfloat16")
    assert torch.isfinite(prefill_logits(model, list(range(10)))).all()
