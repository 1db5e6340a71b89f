"""FP8 checkpoints (llmplug/quantization/fp8.py) against references that do not use llmplug's code.

Checkpoints are tiny transformers Llamas whose linear weights are quantized here the way vLLM's test utility
`per_block_cast_to_fp8` does it (128x128 blocks, scale = block amax / 448, padded at the edges) or per tensor
(vLLM's static fp8: one `weight_scale`, one `input_scale`). The references: transformers' own load of the folder
(its FineGrainedFP8 integration dequantizes on the CPU), and a transformers model holding the weights DeepSeek's
`weight_dequant` definition gives (a loop over blocks, written here); compressed-tensors' own quantizer and
dequantizer for its float schemes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from llmplug.core.errors import ModelLoadError
from llmplug.layers.kernels.native import KERNELS_ENV
from llmplug.layers.linear import LinearBase, ReplicatedLinear
from llmplug.layers.quantization import LinearOptions
from llmplug.quantization.context import building_with
from llmplug.quantization.fp8 import Fp8Config, Fp8LinearMethod, _decode_tile, compressed_tensors_fp8_method
from llmplug.testing.tiny import TinyCheckpoint, save_tiny_checkpoint, tiny_config
from tests.loaders.parity import GREEDY_PROMPTS, greedy, hf_greedy, hf_logits, load_model, our_logits

FP8_MAX = 448.0
BLOCKED = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
PER_TENSOR = {"quant_method": "fp8", "activation_scheme": "static"}
# hidden 256: every projection has several 128-blocks; intermediate 320: gate/up rows and down_proj columns end in a
# 64-wide block; 4 heads of 64 with 2 KV heads: k and v are 128 rows each, fused after q's 256
ODD = dict(hidden_size=256, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2)
EVEN = dict(ODD, intermediate_size=384)  # every dimension whole blocks: what transformers' dequantizer takes


# ---------------------------------------------------------------- references written here


def per_block_cast_to_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's tests' blockwise quantizer: pad to whole 128x128 blocks, scale each by 448 / its amax."""
    n, k = w.shape
    padded = torch.zeros(-(-n // 128) * 128, -(-k // 128) * 128)
    padded[:n, :k] = w
    view = padded.view(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    q = (view * (FP8_MAX / amax)).to(torch.float8_e4m3fn)
    return q.view_as(padded)[:n, :k].contiguous(), (amax / FP8_MAX).view(view.shape[0], view.shape[2])


def weight_dequant(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """DeepSeek V3's definition: each 128x128 block of q times its scale (a loop over blocks, in float32)."""
    out = torch.empty(q.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = q[rows, cols].float() * s[i, j]
    return out


def blocked(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    q, s = per_block_cast_to_fp8(w)
    return {"weight": q, "weight_scale_inv": s}, weight_dequant(q, s)


def per_tensor(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    scale = w.abs().amax() / FP8_MAX
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale.reshape(()), "input_scale": torch.tensor(0.02)}, q.float() * scale


def tiny(path: Path, sizes: dict, seed: int = 0):
    return save_tiny_checkpoint(tiny_config(LlamaConfig, **sizes), path, seed=seed)


# ---------------------------------------------------------------- the kernel's pieces


def test_every_fp8_code_decodes_exactly():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # e4m3fn's NaNs, which loading refuses
    q = codes.view(torch.float8_e4m3fn).reshape(2, -1)
    decoded = _decode_tile(q).float() * 256
    assert torch.equal(decoded.view(torch.int32), q.float().view(torch.int32))  # bitwise, signed zeros included


def _layer(method, n: int, k: int) -> LinearBase:
    class OneConfig(Fp8Config):
        def linear_method(self, layer, prefix):
            return method

    with building_with(OneConfig(True, False, ())):
        return ReplicatedLinear(k, n, bias=False, prefix="layer")


def _load(layer: LinearBase, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(layer.named_parameters())
    for name, tensor in tensors.items():
        params[name].weight_loader(params[name], tensor)
    layer.process_weights_after_loading(LinearOptions(row_invariant=True))


@pytest.mark.parametrize("kernels", ["auto", "0"], ids=["fp8_matmul", "tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_layer_dequantizes_like_deepseek_and_rows_do_not_depend_on_their_number(dtype, kernels, monkeypatch):
    """On llmplug's CPU kernel (where it builds) and on the tile path (LLMPLUG_CPU_KERNELS=0)."""
    monkeypatch.setenv(KERNELS_ENV, kernels)
    n, k = 320, 384  # a last block of 64 rows
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05
    stored, reference = blocked("w", w)
    layer = _layer(Fp8LinearMethod(Fp8Config(True, False, ()).scheme), n, k)
    _load(layer, stored)
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.quant_method.dequantize(layer), reference)
    layer.process_weights_after_loading(LinearOptions(row_invariant=True))  # again (a reload's pass): no change
    assert torch.equal(layer.quant_method.dequantize(layer), reference)
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = layer(x)
    expected = x.double() @ reference.to(dtype).double().T  # the weight rounded once to dtype, like transformers'
    assert (y.double() - expected).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2) * expected.abs().max()
    for m in range(1, 34):
        assert torch.equal(layer(x[:m]), y[:m]), f"rows of a {m}-row call differ from the same rows among 33"
    assert layer.quant_method.row_invariant  # the declaration the engine's batch-invariance check reads


# ---------------------------------------------------------------- whole checkpoints through the engine

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def save_fp8(dense: TinyCheckpoint, path: Path, config: dict, quantize, skip: tuple[str, ...] = ()) -> TinyCheckpoint:
    """`dense`'s folder with each linear (but `skip`) stored as `quantize` gives it; the reference: transformers'
    model holding the decoded weights."""
    path.mkdir()
    tensors = load_file(dense.path / "model.safetensors")
    params = dict(dense.hf_model.named_parameters())
    for layer in range(dense.hf_model.config.num_hidden_layers):
        for linear in LINEARS:
            module = f"model.layers.{layer}.{linear}"
            if module in skip:
                continue
            stored, decoded = quantize(module, tensors.pop(f"{module}.weight").float())
            tensors |= {f"{module}.{leaf}": t.contiguous() for leaf, t in stored.items()}
            with torch.no_grad():
                params[f"{module}.weight"].copy_(decoded)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config_json = json.loads((dense.path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config_json | {"quantization_config": config}))
    for extra in dense.path.iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            (path / extra.name).write_bytes(extra.read_bytes())
    return TinyCheckpoint(path, dense.hf_model.eval())


def fp8_layers(model: torch.nn.Module) -> list[LinearBase]:
    return [m for m in model.modules() if isinstance(m, LinearBase) and isinstance(m.quant_method, Fp8LinearMethod)]


@pytest.fixture(scope="module")
def odd_blocked(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return save_fp8(tiny(root / "dense", ODD), root / "fp8", BLOCKED, blocked)


def test_blocked_checkpoint_logits_and_greedy_equal_the_dequantized_transformers_model(odd_blocked):
    model = load_model(odd_blocked.path, "safetensors")
    layers = fp8_layers(model)
    assert len(layers) == 2 * 4 and all(layer.weight.dtype == torch.float8_e4m3fn for layer in layers)
    ours, theirs = our_logits(model), hf_logits(odd_blocked.hf_model)
    # float32 on the same float32 weights: only the summation order differs (logits ~1, K <= 320)
    assert (ours - theirs).abs().max() < 1e-4
    assert greedy(odd_blocked.path, "float32") == hf_greedy(odd_blocked.hf_model)


def test_blocked_checkpoint_passes_llmplugs_quantization_method_check(odd_blocked):
    from llmplug.testing.quantization import check_quantization_method

    report = check_quantization_method(odd_blocked.path, odd_blocked.hf_model, atol=1e-4)
    assert report.quant_method == "fp8" and len(report.layers) == 2 * 4 and report.row_invariant


def test_blocked_checkpoint_in_bfloat16(odd_blocked):
    ours_greedy = greedy(odd_blocked.path, "bfloat16")
    reference = odd_blocked.hf_model.to(torch.bfloat16)  # the dequantized weights rounded once to bf16, as ours
    try:
        ours = our_logits(load_model(odd_blocked.path, "safetensors", dtype="bfloat16")).float()
        theirs = hf_logits(reference)
        # transformers' logits along our greedy tokens (teacher forced): [prompt + new tokens, vocab]
        forced = [hf_logits(reference, prompt + tokens) for prompt, tokens in zip(GREEDY_PROMPTS, ours_greedy)]
    finally:
        odd_blocked.hf_model.float()
    # bf16 activations (8 bits of mantissa) rounded in different places by two implementations: a few bf16 ulps
    assert (ours - theirs).abs().max() < 0.05 * theirs.abs().max()
    # Greedy tokens: this random model has bf16 near-ties (at the 3rd token of the first prompt transformers' bf16
    # and llmplug's dense bf16 engine on these very weights already part), where float32 sums in another order may
    # choose the other token; so each of our tokens is transformers' choice or within bf16 noise of it
    for prompt, tokens, logits in zip(GREEDY_PROMPTS, ours_greedy, forced):
        rows = logits[len(prompt) - 1 : -1]  # the logits each new token was chosen from
        chosen = rows.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        gaps = rows.max(dim=1).values - chosen
        assert (gaps <= 0.04 * rows.abs().max()).all(), gaps  # measured: up to 3 bf16 ulps (0.09 of logits ~6)
        assert (gaps == 0).float().mean() >= 0.75, gaps  # near-ties are rare: most tokens are transformers' own


def test_transformers_own_load_of_the_folder_is_the_reference(tmp_path):
    checkpoint = save_fp8(tiny(tmp_path / "dense", EVEN, seed=3), tmp_path / "fp8", BLOCKED, blocked)
    theirs = AutoModelForCausalLM.from_pretrained(checkpoint.path, dtype=torch.float32).eval()  # dequantizes on CPU
    mine = dict(checkpoint.hf_model.named_parameters())
    for name, param in theirs.named_parameters():  # their dequantizer and DeepSeek's definition agree bitwise
        assert torch.equal(param.float(), mine[name].float()), name
    assert (our_logits(load_model(checkpoint.path, "safetensors")) - hf_logits(theirs)).abs().max() < 1e-4
    assert greedy(checkpoint.path, "float32") == hf_greedy(theirs)


def test_every_quantized_layer_computes_x_times_its_dequantized_weight_with_rows_independent_of_their_number(
    odd_blocked,
):
    model = load_model(odd_blocked.path, "safetensors", dtype="bfloat16")
    generator = torch.Generator().manual_seed(5)
    for layer in fp8_layers(model):
        weight = layer.quant_method.dequantize(layer)  # float32 [out, in]
        x = torch.randn(33, layer.input_size, generator=generator).to(torch.bfloat16)
        y = layer(x)
        expected = x.double() @ weight.to(torch.bfloat16).double().T
        assert (y.double() - expected).abs().max() <= 1e-2 * expected.abs().max(), layer.prefix
        for m in range(1, 34):
            assert torch.equal(layer(x[:m]), y[:m]), f"{layer.prefix}: a {m}-row call changes its rows' bits"


def test_per_tensor_static_checkpoint_with_an_ignored_layer_kept_dense(tmp_path):
    kept = "model.layers.1.mlp.down_proj"
    config = PER_TENSOR | {"ignored_layers": [kept]}
    checkpoint = save_fp8(tiny(tmp_path / "dense", ODD, seed=4), tmp_path / "fp8", config, per_tensor, skip=(kept,))
    model = load_model(checkpoint.path, "safetensors")
    prefixes = {layer.prefix for layer in fp8_layers(model)}
    assert len(prefixes) == 7 and kept not in prefixes
    assert model.get_submodule(kept).weight.dtype == torch.float32
    assert (our_logits(model) - hf_logits(checkpoint.hf_model)).abs().max() < 1e-4
    assert greedy(checkpoint.path, "float32") == hf_greedy(checkpoint.hf_model)


def test_quantized_weights_take_the_checkpoints_bytes(odd_blocked):
    stored = load_file(odd_blocked.path / "model.safetensors")
    checkpoint_bytes = sum(t.numel() * t.element_size() for n, t in stored.items()
                           if t.dtype == torch.float8_e4m3fn or n.endswith(".weight_scale_inv"))
    layers = fp8_layers(load_model(odd_blocked.path, "safetensors", dtype="bfloat16"))
    loaded = sum(p.numel() * p.element_size() for m in layers for p in m.parameters(recurse=False))
    held = {id(t) for m in layers for t in vars(m).values() if isinstance(t, torch.Tensor)}
    assert not held - {id(p) for m in layers for p in m.parameters(recurse=False)}  # no second copy of anything
    assert checkpoint_bytes <= loaded <= 1.3 * checkpoint_bytes


# ---------------------------------------------------------------- bad checkpoints


def _broken(source: Path, path: Path, tensors=None, config=None) -> Path:
    path.mkdir()
    for extra in source.iterdir():
        if extra.name not in ("model.safetensors", "config.json"):
            (path / extra.name).write_bytes(extra.read_bytes())
    stored = load_file(source / "model.safetensors")
    save_file(tensors(stored) if tensors else stored, path / "model.safetensors")
    saved = json.loads((source / "config.json").read_text())
    if config:
        saved["quantization_config"] = saved["quantization_config"] | config
    (path / "config.json").write_text(json.dumps(saved))
    return path


def _without(name):
    return lambda stored: {k: v for k, v in stored.items() if k != name}


def _replaced(name, make):
    return lambda stored: stored | {name: make(stored[name])}


SCALE = "model.layers.0.self_attn.k_proj.weight_scale_inv"
WEIGHT = "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize("change, config, named", [
    (_without(SCALE), None, "weight_scale_inv"),
    (_replaced(SCALE, lambda s: torch.ones(3, 2)), None, SCALE),
    (_replaced(SCALE, lambda s: s.double()), None, SCALE),
    (_replaced(WEIGHT, lambda w: w.to(torch.bfloat16)), None, WEIGHT),
    (None, {"activation_scheme": "per_channel"}, "activation_scheme"),
    (None, {"weight_block_size": [64, 64]}, "weight_block_size"),
])
def test_bad_checkpoint_is_refused_by_name_then_a_good_one_loads(odd_blocked, tmp_path, change, config, named):
    from llmplug import LLM
    from llmplug.core.errors import ConfigError

    bad = _broken(odd_blocked.path, tmp_path / "bad", change, config)
    with pytest.raises((ModelLoadError, ConfigError)) as refused:
        LLM(str(bad), dtype="float32", skip_tokenizer_init=True, block_size=4).shutdown()
    assert named in str(refused.value)
    llm = LLM(str(odd_blocked.path), dtype="float32", skip_tokenizer_init=True, block_size=4)
    try:
        from llmplug.core.params import SamplingParams

        out = llm.generate([{"prompt_token_ids": [3, 17, 42]}], SamplingParams(temperature=0.0, max_tokens=2),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


# ---------------------------------------------------------------- compressed-tensors' float schemes


@pytest.mark.parametrize("strategy, static_input", [("tensor", True), ("channel", False), ("block", False)])
def test_compressed_tensors_fp8_layer_equals_the_packages_own_decompression(strategy, static_input):
    """A layer checkpoint written by compressed-tensors' own compressor (weight, weight_scale, maybe input_scale),
    built through `compressed_tensors_fp8_method` directly (the CompressedTensorsConfig that dispatches to it lives in
    another module), against the package's own decompression of the same tensors."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import (
        QuantizationArgs, QuantizationConfig, QuantizationScheme, apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    n, k = 320, 384  # a last block of 64 rows
    weights = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False,
                               block_structure=[128, 128] if strategy == "block" else None)
    inputs = QuantizationArgs(num_bits=8, type="float", strategy="tensor" if static_input else "token",
                              symmetric=True, dynamic=not static_input)
    config = QuantizationConfig(format="float-quantized", config_groups={
        "group_0": QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)})
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(6)) * 0.05)
    apply_quantization_config(model, config)
    linear, w = model[0], model[0].weight.detach()
    if strategy == "block":
        view = torch.nn.functional.pad(w, (0, 0, 0, 64)).view(3, 128, 3, 128)
        low, high = view.amin((1, 3)), view.amax((1, 3))
    elif strategy == "channel":
        low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        low, high = w.min().reshape(1), w.max().reshape(1)
    scale, zero = calculate_qparams(low, high, weights)
    with torch.no_grad():
        linear.weight_scale.copy_(scale)
        linear.weight_zero_point.copy_(zero)
        if static_input:
            linear.input_scale.fill_(0.01)
    compressor = ct.compressors.ModelCompressor(quantization_config=config)
    compressor.compress_model(model)
    stored = {name.removeprefix("0."): t.clone() for name, t in model.state_dict().items()}
    assert stored["weight"].dtype == torch.float8_e4m3fn
    compressor.decompress_model(model)
    theirs = model[0].weight.detach().float()  # the package's own dequantization

    config_dump = config.model_dump()["config_groups"]["group_0"]
    method = compressed_tensors_fp8_method(config_dump["weights"], config_dump["input_activations"])
    layer = _layer(method, n, k)
    _load(layer, stored)
    assert torch.equal(method.dequantize(layer), theirs)
    assert hasattr(layer, "input_scale") == static_input  # read (not applied: weight-only)
    if static_input:
        assert float(layer.input_scale) == pytest.approx(0.01)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(7))
    expected = x.double() @ theirs.double().T
    assert (layer(x).double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("weights, inputs, named", [
    ({"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}, None, "strategy"),
    ({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [64, 64]}, None, "block_structure"),
    ({"num_bits": 4, "type": "float", "strategy": "tensor"}, None, "num_bits"),
    ({"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": False}, None, "symmetric"),
    ({"num_bits": 8, "type": "float", "strategy": "tensor"},
     {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": False}, "static input activations"),
])
def test_compressed_tensors_settings_not_implemented_are_refused_by_name(weights, inputs, named):
    with pytest.raises(ModelLoadError, match=named):
        compressed_tensors_fp8_method(weights, inputs)


# ---------------------------------------------------------------- tensor parallelism


@pytest.mark.slow
def test_tensor_parallel_fp8_gives_transformers_greedy_tokens(tmp_path):
    """TP=2 on whole blocks: q/k/v and gate/up split by rows (k and v: 64 rows a rank, inside a 128-row scale block,
    which the per-row scales allow), o/down by 128-column blocks (256 and 512 inputs over 2 ranks)."""
    checkpoint = save_fp8(tiny(tmp_path / "dense", dict(ODD, intermediate_size=512), seed=8), tmp_path / "fp8",
                          BLOCKED, blocked)
    assert greedy(checkpoint.path, tensor_parallel_size=2) == hf_greedy(checkpoint.hf_model)
