"""Helpers that write tiny GGUF files for the loader tests, the way llama.cpp's convert_hf_to_gguf does.

The HF -> GGUF name map and the Q/K permutation are written out here on purpose instead of being
imported from `llmplug.loaders.gguf`: the tests check the loader against this independent copy of the
conversion rules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Container

import gguf
import numpy as np
import torch
from transformers import PretrainedConfig, PreTrainedModel

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]

_BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def byte_level_tokens() -> list[str]:
    """The 256 byte-level BPE symbols (GPT-2's bytes_to_unicode) in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[byte] for byte in range(256)]


def tokenizer_tokens() -> list[str]:
    """Vocabulary of the tiny tokenizer: bytes, merged tokens, then the special tokens."""
    merged = [merge.replace(" ", "") for merge in MERGES]
    return byte_level_tokens() + merged + SPECIAL_TOKENS


def tiny_llama_config(model_type: str = "llama", **overrides: Any) -> PretrainedConfig:
    """A Llama-family config small enough to write in every quant type in milliseconds (vocab = the tiny tokenizer)."""
    from transformers import AutoConfig

    vocab = tokenizer_tokens()
    fields: dict[str, Any] = dict(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=vocab.index("<|im_start|>"),
        eos_token_id=vocab.index("<|im_end|>"),
    )
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)


def make_tiny_model(config: PretrainedConfig | None = None, seed: int = 0) -> PreTrainedModel:
    """A random tiny causal LM (Llama by default) whose norms are random too, so a swapped norm would show."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config or tiny_llama_config()).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def permute_qk(weight: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute` (HF rotate-half rows -> interleaved pairs)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_name(hf_name: str) -> str:
    """The llama.cpp tensor name of an HF checkpoint name."""
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    _, _, layer, part = stem.split(".", 3)  # model.layers.N.<part>
    return f"blk.{layer}.{_BLOCK_NAMES[part]}.{suffix}"


def hf_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of `model` in fp32, without lm_head when it is tied."""
    state = {name: tensor.detach().float().clone() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def encode_tensor(array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, Any]:
    """Quantize like llama.cpp: 1-D tensors (norms, biases) stay F32, the rest use `qtype`."""
    if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        return array.astype(np.float32), None
    if qtype == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array, qtype), qtype


def add_tiny_tokenizer(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    """A byte-level BPE (`gpt2`) tokenizer with a ChatML template, as llama.cpp stores tokenizers."""
    tokens = tokenizer_tokens()
    normal, control = gguf.TokenType.NORMAL, gguf.TokenType.CONTROL
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([control if token in SPECIAL_TOKENS else normal for token in tokens])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def add_hparams(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    """The hyperparameters llama.cpp writes for a Llama-family model."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    head_dim = getattr(config, "head_dim", None)  # Qwen2Config has none
    if head_dim not in (None, config.hidden_size // config.num_attention_heads):
        writer.add_key_length(head_dim)  # convert writes these for an explicit head_dim
        writer.add_value_length(head_dim)


def add_weights(
    writer: gguf.GGUFWriter, model: PreTrainedModel, qtype: gguf.GGMLQuantizationType, skip: Container[str] = ()
) -> None:
    """Every checkpoint tensor of `model` but those in `skip`, renamed, Q/K-permuted (llama only), quantized."""
    config = model.config
    permute = config.model_type == "llama"
    for hf_name, tensor in hf_state_dict(model).items():
        if gguf_name(hf_name) in skip:
            continue
        array = tensor.numpy()
        if permute and ".self_attn.q_proj." in hf_name:
            array = permute_qk(array, config.num_attention_heads, config.num_attention_heads)
        elif permute and ".self_attn.k_proj." in hf_name:
            array = permute_qk(array, config.num_attention_heads, config.num_key_value_heads)
        data, raw_dtype = encode_tensor(array, qtype)
        writer.add_tensor(gguf_name(hf_name), data, raw_dtype=raw_dtype)


def write_gguf(writer: gguf.GGUFWriter) -> None:
    """Write header, metadata and tensors, then close."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_model_gguf(
    path: Path,
    model: PreTrainedModel,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    *,
    arch: str | None = None,
    tokenizer: bool = True,
    extra_kv: dict[str, Any] | None = None,
    extra_tensors: dict[str, tuple[np.ndarray, Any]] | None = None,
) -> Path:
    """Write `model` to `path` as llama.cpp would.

    arch defaults to the model type; extra_kv adds metadata; extra_tensors adds (array, raw GGML type or
    None) tensors, replacing a model tensor of the same GGUF name.
    """
    extra_tensors = extra_tensors or {}
    writer = gguf.GGUFWriter(str(path), arch=arch or model.config.model_type)
    writer.add_name("tiny")
    add_hparams(writer, model.config)
    if tokenizer:
        add_tiny_tokenizer(writer, model.config)
    for key, value in (extra_kv or {}).items():
        add_kv(writer, key, value)
    add_weights(writer, model, qtype, skip=extra_tensors)
    for name, (array, raw_dtype) in extra_tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    write_gguf(writer)
    return path


def add_kv(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    """One metadata entry of a Python value (str, bool, int as uint32, float as float32)."""
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    else:
        writer.add_float32(key, float(value))
