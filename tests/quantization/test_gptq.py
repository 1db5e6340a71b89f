"""GPTQ checkpoints (llmplug.quantization.gptq) against transformers computing with the weights they decode to.

Neither AutoGPTQ nor GPTQModel installs on a CPU-only torch 2.13 (both build CUDA extensions), so the checkpoints
are packed here by `gptq_pack`, a transcription of AutoGPTQ's `QuantLinear.pack` (qweight: bits-wide fields of
consecutive inputs, lowest bits first, one int32 per 32 / bits inputs; qzeros: the same along outputs, storing
zero - 1 in the original format), and decoded by `gptq_dequantize`, a transcription of AutoGPTQ's / optimum's
`dequantize_weight` (field by field with shifts and masks): both independent of llmplug's unpacking.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from llmplug import LLM
from llmplug.core.errors import ModelLoadError
from llmplug.layers.quantization import int4_kernel_supported
from llmplug.quantization.gptq import GPTQConfig
from tests.loaders.parity import hf_greedy, hf_logits, load_model, our_greedy, our_logits

from .checkpoints import TinyCheckpoint, held_bytes, quantize_checkpoint, rtn_groups, tiny_llama

# float32 throughout: the kernel's (q - 8) s + (8 - z) s differs from (q - z) s by an ulp per weight, and two tiny
# layers of width 128-256 keep logits (~1 in size) within 1e-5 of each other; 1e-3 leaves room for the kernels'
# summation orders without hiding a wrong group, zero or permutation (those move logits by > 0.05)
ATOL = 1e-3


def gptq_pack(q: torch.Tensor, zero: torch.Tensor, bits: int, v2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's packing: q [N, K], zero [N, G] -> qweight [K / pack, N], qzeros [G, N / pack] (int32)."""
    pack = 32 // bits
    intweight = q.t().to(torch.int64)  # [K, N]
    qweight = torch.zeros(intweight.shape[0] // pack, intweight.shape[1], dtype=torch.int64)
    for row in range(qweight.shape[0]):
        for j in range(pack):
            qweight[row] |= intweight[row * pack + j] << (bits * j)
    zeros = zero.t().to(torch.int64) - (0 if v2 else 1)  # [G, N]
    qzeros = torch.zeros(zeros.shape[0], zeros.shape[1] // pack, dtype=torch.int64)
    for col in range(qzeros.shape[1]):
        for j in range(pack):
            qzeros[:, col] |= zeros[:, col * pack + j] << (bits * j)
    return _as_int32(qweight), _as_int32(qzeros)


def gptq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    bits: int, v2: bool) -> torch.Tensor:
    """optimum / AutoGPTQ's reference dequantization -> [N, K] float32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = 2**bits - 1
    zeros = (qzeros.unsqueeze(2) >> shifts.view(1, 1, -1)) & mask  # [G, N / pack, pack]
    zeros = zeros.reshape(zeros.shape[0], -1) + (0 if v2 else 1)  # [G, N]
    weight = (qweight.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask  # [K / pack, pack, N]
    weight = weight.reshape(-1, weight.shape[-1])  # [K, N]
    dense = (weight - zeros[g_idx.long()]).float() * scales[g_idx.long()].float()
    return dense.t().contiguous()


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> the same bits as int32."""
    return (words & 0xFFFFFFFF).to(torch.int64).where(words < 2**31, words - 2**32).to(torch.int32)


def gptq_quantizer(bits: int, group_size: int, sym: bool, desc_act: bool, v2: bool):
    """A checkpoint quantizer (see checkpoints.quantize_checkpoint) writing GPTQ tensors."""

    def quantize(name: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        n, k = weight.shape
        size = k if group_size == -1 else group_size
        # act-order sorts the inputs by the Hessian of the layer's input: fused siblings (q, k, v) share it
        seed = sum(name.rpartition(".")[0].encode()) + k
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = (torch.arange(k) // size).to(torch.int32)  # act-order: group j holds columns order[j*size...]
        q_ordered, scale, zero = rtn_groups(weight[:, order], bits, group_size, sym, None if v2 else (1, 2**bits - 1))
        q = torch.empty_like(q_ordered)
        q[:, order] = q_ordered
        qweight, qzeros = gptq_pack(q, zero, bits, v2)
        scales = scale.t().contiguous()  # [G, N] float16
        tensors = {f"{name}.qweight": qweight, f"{name}.qzeros": qzeros, f"{name}.scales": scales,
                   f"{name}.g_idx": g_idx}
        return tensors, gptq_dequantize(qweight, qzeros, scales, g_idx, bits, v2)

    return quantize


def gptq_config(bits: int = 4, group_size: int = 128, sym: bool = True, desc_act: bool = False, v2: bool = False
                ) -> dict[str, object]:
    """The quantization_config GPTQModel / optimum write."""
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym, "desc_act": desc_act,
            "checkpoint_format": "gptq_v2" if v2 else "gptq", "damp_percent": 0.01, "true_sequential": True}


def gptq_checkpoint(path: Path, bits: int = 4, group_size: int = 128, sym: bool = True, desc_act: bool = False,
                    v2: bool = False) -> TinyCheckpoint:
    """A tiny GPTQ Llama and its transformers reference."""
    checkpoint = tiny_llama(path)
    quantize_checkpoint(checkpoint, gptq_quantizer(bits, group_size, sym, desc_act, v2),
                        gptq_config(bits, group_size, sym, desc_act, v2))
    return checkpoint


needs_int4 = pytest.mark.skipif(not int4_kernel_supported("cpu", torch.float32), reason="no CPU int4 kernel here")

CASES = [
    pytest.param(dict(bits=4, group_size=128), id="4bit-g128-sym"),
    pytest.param(dict(bits=4, group_size=32, sym=False), id="4bit-g32-asym-v1"),
    pytest.param(dict(bits=4, group_size=-1, sym=False, v2=True), id="4bit-channel-asym-v2"),
    pytest.param(dict(bits=4, group_size=32, desc_act=True), id="4bit-g32-act-order"),
    pytest.param(dict(bits=8, group_size=128, sym=False, v2=True), id="8bit-g128-asym-v2"),
    pytest.param(dict(bits=8, group_size=32, desc_act=True), id="8bit-g32-act-order"),
]


@needs_int4
@pytest.mark.parametrize("settings", CASES)
def test_gptq_logits_and_greedy_tokens_match_transformers_on_the_decoded_weights(
    tmp_path: Path, settings: dict
) -> None:
    checkpoint = gptq_checkpoint(tmp_path, **settings)
    model = load_model(tmp_path, "safetensors")
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer.weight is None and "int4" in repr(layer.quant_method)  # packed, no dense copy
    torch.testing.assert_close(our_logits(model), hf_logits(checkpoint.hf_model), atol=ATOL, rtol=0)
    del model
    gc.collect()
    assert our_greedy(tmp_path, "auto") == hf_greedy(checkpoint.hf_model)


@needs_int4
def test_dequantize_reads_the_packed_weight_back_exactly_in_the_checkpoints_column_order(tmp_path: Path) -> None:
    checkpoint = gptq_checkpoint(tmp_path, bits=4, group_size=32, desc_act=True)
    model = load_model(tmp_path, "safetensors")
    layer = model.model.layers[1].mlp.down_proj
    expected = checkpoint.hf_model.model.layers[1].mlp.down_proj.weight
    torch.testing.assert_close(layer.quant_method.dequantize(layer), expected, atol=1e-6, rtol=0)


@needs_int4
def test_weights_stay_packed_within_1_3x_of_the_checkpoint_bytes(tmp_path: Path) -> None:
    gptq_checkpoint(tmp_path, bits=4, group_size=128)
    held, file = held_bytes(load_model(tmp_path, "safetensors")), (tmp_path / "model.safetensors").stat().st_size
    assert held <= 1.3 * file, f"{held} bytes held for a {file}-byte checkpoint"


@needs_int4
def test_unsupported_bit_widths_are_refused_by_name_and_a_good_checkpoint_loads_after(tmp_path: Path) -> None:
    import json

    for bits in (2, 3):
        with pytest.raises(ModelLoadError, match=f"bits={bits}"):
            GPTQConfig.from_config(gptq_config(bits=bits))
    with pytest.raises(ModelLoadError, match="is_marlin_format"):
        GPTQConfig.from_config(gptq_config() | {"is_marlin_format": True})
    gptq_checkpoint(tmp_path)
    config_file = tmp_path / "config.json"
    good = json.loads(config_file.read_text())
    config_file.write_text(json.dumps(good | {"quantization_config": gptq_config(bits=3)}))
    with pytest.raises(ModelLoadError, match="bits=3"):
        load_model(tmp_path, "safetensors")
    config_file.write_text(json.dumps(good))
    assert load_model(tmp_path, "safetensors").model.layers[0].mlp.down_proj.weight is None


def _rewrite(path: Path, name: str, tensor: torch.Tensor | None) -> None:
    """Replace (None: drop) checkpoint tensor `name`."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    save_file(tensors, file, metadata={"format": "pt"})


BAD = [
    pytest.param("qweight", lambda t: t[:-1], "qweight", id="qweight-wrong-shape"),
    pytest.param("qzeros", lambda t: None, "qzeros", id="qzeros-missing"),
    pytest.param("scales", lambda t: None, "scales", id="scales-missing"),
    pytest.param("qweight", lambda t: t.to(torch.int64), "qweight", id="qweight-wrong-dtype"),
]


@needs_int4
@pytest.mark.parametrize(("tensor", "damage", "named"), BAD)
def test_a_damaged_checkpoint_is_refused_naming_the_tensor_and_a_good_one_loads_after(
    tmp_path: Path, tensor: str, damage, named: str
) -> None:
    gptq_checkpoint(tmp_path / "good")
    bad = gptq_checkpoint(tmp_path / "bad").path
    name = f"model.layers.0.mlp.down_proj.{tensor}"
    from safetensors.torch import load_file

    _rewrite(bad, name, damage(load_file(bad / "model.safetensors")[name]))
    with pytest.raises(ModelLoadError, match=named):
        load_model(bad, "safetensors")
    assert load_model(tmp_path / "good", "safetensors").model.layers[0].mlp.down_proj.weight is None


@needs_int4
@pytest.mark.slow
@pytest.mark.parametrize("settings", [dict(sym=False), dict(desc_act=True)], ids=["asym", "act-order"])
def test_tensor_parallel_2_gives_the_same_greedy_tokens(tmp_path: Path, settings: dict) -> None:
    # act-order: a row-parallel rank's inputs hold parts of every group, so its scales are whole (and its groups
    # of unequal sizes: it computes with a dequantized weight, with a warning)
    checkpoint = gptq_checkpoint(tmp_path, bits=4, group_size=32, **settings)
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, block_size=4, tensor_parallel_size=2)
    from llmplug import SamplingParams
    from tests.loaders.parity import GREEDY_PROMPTS, MAX_TOKENS

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in GREEDY_PROMPTS], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(checkpoint.hf_model)


@needs_int4
def test_lora_adapters_apply_on_top_of_a_gptq_model_like_peft_merged_into_the_decoded_weights(tmp_path: Path) -> None:
    import numpy as np

    from llmplug.core.config import LoRAConfig
    from llmplug.lora.manager import LoRAManager
    from llmplug.testing import PagedHarness
    from tests.loaders.parity import PROMPT
    from tests.lora.adapters import save_adapter

    checkpoint = gptq_checkpoint(tmp_path / "gptq", bits=4, group_size=32, sym=False)
    checkpoint.hf_model.save_pretrained(tmp_path / "decoded")  # peft's base: the weights the checkpoint decodes to
    adapter = save_adapter(tmp_path / "decoded", "all8", tmp_path / "adapter", seed=1)
    model = load_model(checkpoint.path, "safetensors")
    manager = LoRAManager(model, LoRAConfig(enable_lora=True, max_loras=2), torch.float32, torch.device("cpu"))
    request = adapter.request(1)
    manager.add_adapter(request)
    harness = PagedHarness(model)
    harness.add("r", PROMPT)
    logits = harness.step([("r", len(PROMPT))], manager.mapping([request], np.array([len(PROMPT)])))["r"]
    expected = hf_logits(adapter.merged)
    assert (expected - hf_logits(checkpoint.hf_model)).abs().max() > 0.1  # the adapter changes the model
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


def _load_invariant(path: Path) -> torch.nn.Module:
    """Our model loaded in batch-invariant mode."""
    from llmplug.core.config import EngineConfig, LoadConfig, ModelConfig
    from llmplug.core.plugins import get_registry

    config = EngineConfig(model=ModelConfig(model=str(path), dtype="float32", batch_invariant=True),
                          load=LoadConfig(format="safetensors"))
    return get_registry().load("llmplug.loaders", "safetensors")(config.load).load_model(config)


@needs_int4
@pytest.mark.parametrize("missing", ["kernel", "row-invariance"])
def test_where_the_int4_kernel_cannot_serve_each_layer_warns_once_and_computes_with_its_dequantized_weight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, missing: str
) -> None:
    import llmplug.quantization.int_weights as int_weights
    from llmplug.layers.linear import LinearBase

    checkpoint = gptq_checkpoint(tmp_path, bits=4, group_size=32, desc_act=True)
    if missing == "kernel":
        monkeypatch.setattr(int_weights, "int4_kernel_supported", lambda *_: False)
        model = load_model(tmp_path, "safetensors")
    else:
        monkeypatch.setattr(int_weights, "int4_rows_invariant", lambda *_: False)
        model = _load_invariant(tmp_path)
    warned = [r.getMessage() for r in caplog.records if "dense dequantized weight" in r.getMessage()]
    methods = {m.prefix: m.quant_method for m in model.modules() if isinstance(m, LinearBase)}
    prefixes = [prefix for prefix, method in methods.items() if isinstance(method, int_weights.IntWeightsMethod)]
    assert sorted(w.split(" ")[0] for w in warned) == sorted(prefixes) and len(prefixes) == 8
    assert all("int4" not in repr(m.quant_method) for m in model.modules() if hasattr(m, "quant_method"))
    torch.testing.assert_close(our_logits(model), hf_logits(checkpoint.hf_model), atol=ATOL, rtol=0)


@needs_int4
@pytest.mark.parametrize("settings", [dict(bits=8, group_size=32, desc_act=True), dict(bits=4, group_size=-1)],
                         ids=["8bit-act-order", "4bit-channel"])
def test_gptq_passes_llmplugs_quantization_method_check(tmp_path: Path, settings: dict) -> None:
    from llmplug.testing.quantization import check_quantization_method

    checkpoint = gptq_checkpoint(tmp_path, **settings)
    report = check_quantization_method(tmp_path, checkpoint.hf_model, atol=ATOL)
    assert report.quant_method == "gptq" and len(report.layers) == 8
