"""Quantized checkpoints through the transformers backend (`model_impl="transformers"`): its linear layers hold the
checkpoint's packed tensors (llmplug's quantized methods, as the native models' layers), and the greedy tokens equal
both llmplug's native model on the same folder and transformers: its own load of the folder where it runs on the
CPU (compressed-tensors decompressing, fine-grained fp8 dequantizing), else transformers holding the weights the
format's own dequantizer gives (GPTQ: AutoGPTQ's definition; AWQ: AutoAWQ's; GGUF: gguf-py's). The checkpoints are
the quantization tests' writers (tests/quantization).
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmplug import LLM, SamplingParams
from llmplug.core.errors import ModelLoadError
from llmplug.layers.linear import ReplicatedLinear
from llmplug.layers.quantization import int4_kernel_supported
from llmplug.quantization import QuantizedLinearMethod
from llmplug.testing.tiny import TinyCheckpoint
from tests.loaders.parity import GREEDY_PROMPTS, MAX_TOKENS, hf_greedy

pytestmark = pytest.mark.skipif(not int4_kernel_supported("cpu", torch.float32), reason="no CPU int4 kernel here")


def gptq(path: Path) -> TinyCheckpoint:
    from tests.quantization.test_gptq import gptq_checkpoint

    return gptq_checkpoint(path, bits=4, group_size=128)


def awq(path: Path) -> TinyCheckpoint:
    from tests.quantization.test_awq import awq_checkpoint

    return awq_checkpoint(path, group_size=128)


def ct_w4a16(path: Path) -> TinyCheckpoint:
    from tests.quantization.test_compressed_tensors import ct_checkpoint, scheme

    return ct_checkpoint(path, scheme(group_size=128, symmetric=False), "pack-quantized")


def ct_w8a8(path: Path) -> TinyCheckpoint:
    from compressed_tensors.quantization import QuantizationArgs

    from tests.quantization.test_compressed_tensors import ct_checkpoint, scheme

    inputs = QuantizationArgs(num_bits=8, type="int", symmetric=True, dynamic=True, strategy="token")
    return ct_checkpoint(path, scheme(bits=8, strategy="channel", inputs=inputs), "int-quantized")


def ct_fp8(path: Path) -> TinyCheckpoint:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from tests.quantization.test_compressed_tensors import ct_checkpoint

    weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
    return ct_checkpoint(path, QuantizationScheme(targets=["Linear"], weights=weights), "float-quantized")


def fp8_blocks(path: Path) -> TinyCheckpoint:
    """128x128-block fp8 (DeepSeek's form); the reference is transformers' own load, which dequantizes on the CPU."""
    from tests.quantization.test_fp8 import BLOCKED, EVEN, blocked, save_fp8, tiny

    checkpoint = save_fp8(tiny(path / "dense", EVEN, seed=3), path / "fp8", BLOCKED, blocked)
    return TinyCheckpoint(checkpoint.path, AutoModelForCausalLM.from_pretrained(checkpoint.path, dtype=torch.float32))


def gguf_kquants(path: Path) -> TinyCheckpoint:
    """A tiny Q4_K / Q6_K Llama GGUF (Q4_K_M's types); the reference: transformers on gguf-py's dequantized weights."""
    from tests.quantization.test_gguf_kquants import write_kquant_llama

    file, reference = write_kquant_llama(path)
    return TinyCheckpoint(file, reference.eval())


# format -> its writer; the slow ones add formats, not code paths
FORMATS = {
    "gptq-4bit-g128": gptq,
    "compressed-tensors-w4a16": ct_w4a16,
    "fp8-128x128-blocks": fp8_blocks,
    "awq-4bit-g128": awq,
    "compressed-tensors-w8a8": ct_w8a8,
    "compressed-tensors-fp8": ct_fp8,
    "gguf-q4_k-q6_k": gguf_kquants,
}
SLOW = {"awq-4bit-g128", "compressed-tensors-w8a8", "compressed-tensors-fp8", "gguf-q4_k-q6_k"}


def greedy(path: Path, impl: str, inspect: Callable[[torch.nn.Module], None] | None = None) -> list[list[int]]:
    """Greedy tokens of GREEDY_PROMPTS from the whole engine with `model_impl=impl`; `inspect` sees its model."""
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=4, model_impl=impl)
    try:
        if inspect is not None:
            inspect(llm.llm_engine.engine_core.executor.worker.model_runner.model)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in GREEDY_PROMPTS], params, use_tqdm=False)
    finally:
        llm.shutdown()
        gc.collect()
    return [list(o.outputs[0].token_ids) for o in outputs]


def assert_linears_hold_the_checkpoints_tensors(model: torch.nn.Module) -> None:
    """Every projection of transformers' decoder is llmplug's layer with a quantized method; the head stays dense."""
    hf = model.model
    projections = [m for name, m in hf.named_modules() if name.rsplit(".", 1)[-1].endswith("_proj")]
    assert len(projections) == 7 * hf.config.num_hidden_layers
    for layer in projections:
        assert isinstance(layer, ReplicatedLinear) and isinstance(layer.quant_method, QuantizedLinearMethod), layer
        assert layer.weight is None or layer.weight.element_size() == 1  # packed, or fp8 / int8: no dense copy
    assert type(hf.lm_head) is torch.nn.Linear


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in FORMATS])
def test_quantized_checkpoint_through_the_backend_equals_native_and_transformers(tmp_path: Path, name: str) -> None:
    checkpoint = FORMATS[name](tmp_path)
    expected = hf_greedy(checkpoint.hf_model)
    del checkpoint.hf_model
    gc.collect()
    assert greedy(checkpoint.path, "transformers", assert_linears_hold_the_checkpoints_tensors) == expected
    assert greedy(checkpoint.path, "native") == expected


def test_a_quantized_mixture_of_experts_is_refused_naming_the_experts_and_a_good_load_works_after(
    tmp_path: Path,
) -> None:
    from transformers import Qwen3MoeConfig

    from llmplug.testing.tiny import save_tiny_checkpoint, tiny_config
    from tests.quantization.test_gptq import gptq_config

    moe = save_tiny_checkpoint(tiny_config(Qwen3MoeConfig, hidden_size=128, moe_intermediate_size=128,
                                           num_experts=4, num_experts_per_tok=2), tmp_path / "moe").path
    config_file = moe / "config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"quantization_config": gptq_config()}))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.experts: .*'gptq' checkpoint"):
        LLM(str(moe), dtype="float32", skip_tokenizer_init=True, model_impl="transformers")
    checkpoint = gptq(tmp_path / "gptq")
    assert greedy(checkpoint.path, "transformers") == hf_greedy(checkpoint.hf_model)
