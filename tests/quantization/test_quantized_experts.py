"""Quantized mixture-of-experts checkpoints: the routed experts stay in the checkpoint's packed form.

Tiny Qwen3-MoE checkpoints (4 experts, top 2) whose linear layers and every expert's gate/up/down projections are
written by each format's own tool: FP8 with 128x128 block scales by vLLM's test quantizer (`per_block_cast_to_fp8`,
tests/quantization/test_fp8.py), compressed-tensors pack-quantized W4A16 by the package's own compressor. The
reference is transformers loading the same folder on the CPU (its fine-grained FP8 integration and its
compressed-tensors decompression both dequantize the experts), checked here against DeepSeek's `weight_dequant` and
compressed-tensors' own decompressor. A format whose experts no method holds stays refused by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

from llmplug import LLM, SamplingParams
from llmplug.core.errors import ModelLoadError
from llmplug.layers.kernels.native import KERNELS_ENV
from llmplug.layers.moe import experts as experts_module
from llmplug.layers.moe.config import MoEConfig, RouterConfig
from llmplug.layers.moe.experts import FusedExperts
from llmplug.layers.packed_linear import row_variant_weights
from llmplug.layers.quantization import LinearOptions, int4_kernel_supported
from llmplug.layers.weight_utils import ExpertShard
from llmplug.quantization import QuantizedExpertsMethod
from llmplug.quantization.awq import AWQConfig
from llmplug.quantization.compressed_tensors import CompressedTensorsConfig
from llmplug.quantization.context import building_with
from llmplug.quantization.fp8 import Fp8Config
from llmplug.quantization.gptq import GPTQConfig
from llmplug.testing.tiny import save_tiny_checkpoint, tiny_config
from tests.loaders.parity import greedy, hf_greedy, hf_logits, load_model, our_logits
from tests.quantization.test_fp8 import FP8_MAX, per_block_cast_to_fp8, weight_dequant

FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
EXPERTS = "model.layers.0.mlp.experts"
# hidden 128 and expert intermediate 128: whole 128x128 blocks, what transformers' fp8 dequantizer takes
FP8_SIZES = dict(hidden_size=128, moe_intermediate_size=128, head_dim=32, num_experts=4, num_experts_per_tok=2)
CT_SIZES = dict(hidden_size=64, moe_intermediate_size=64, head_dim=16, num_experts=4, num_experts_per_tok=2)


def generates(path: Path) -> None:
    """The engine loads `path` and generates (the good load after a refused one)."""
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, block_size=4)
    try:
        out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


def assert_packed_and_greedy_equal(model: torch.nn.Module, path: Path, theirs: torch.nn.Module) -> None:
    """The loaded `model` holds at most 1.3x the checkpoint's expert bytes, and the engine's greedy tokens on `path`
    equal transformers' `theirs`."""
    checkpoint, held = experts_bytes(path), held_experts_bytes(model)
    assert held <= 1.3 * checkpoint, (held, checkpoint)
    assert greedy(path) == hf_greedy(theirs)


def quantized_folder(dense: Path, path: Path, quantize, quantization_config: dict) -> Path:
    """`dense`'s folder with every projection (attention and each expert's) replaced by `quantize`'s tensors."""
    shutil.copytree(dense, path)
    tensors = {}
    for name, tensor in load_file(dense / "model.safetensors").items():
        if name.endswith("_proj.weight"):
            module = name.removesuffix(".weight")
            tensors |= {f"{module}.{leaf}": t.contiguous() for leaf, t in quantize(tensor.float()).items()}
        else:
            tensors[name] = tensor
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": quantization_config}))
    return path


def experts_bytes(path: Path) -> int:
    stored = load_file(path / "model.safetensors")
    return sum(t.numel() * t.element_size() for name, t in stored.items() if ".experts." in name)


def held_experts_bytes(model: torch.nn.Module) -> int:
    """Bytes of every FusedExperts' parameters and of what its method holds (packed planes, scales)."""
    total = 0
    for module in model.modules():
        if isinstance(module, FusedExperts):
            total += sum(p.numel() * p.element_size() for p in module.parameters())
            for projections in getattr(module.quant_method, "projections", None) or ():
                for projection in projections.values():
                    packed = getattr(projection.compute, "packed", None)
                    tensors = [packed.weight, packed.scales_and_zeros] if packed else [projection.compute.weight]
                    total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def bad_copy(source: Path, path: Path, change) -> Path:
    shutil.copytree(source, path)
    save_file(change(load_file(source / "model.safetensors")), path / "model.safetensors", metadata={"format": "pt"})
    return path


def decoded_into(model: torch.nn.Module, decode, path: Path, leaf: str) -> torch.nn.Module:
    """The dense transformers `model` holding `decode(stored, module)` (the format's own dequantizer) for every
    projection of the folder (a module storing `leaf`)."""
    stored, params = load_file(path / "model.safetensors"), dict(model.named_parameters())
    with torch.no_grad():
        for name in [n.removesuffix(f".{leaf}") for n in stored if n.endswith(f".{leaf}")]:
            weight = decode(stored, name)
            owner, expert, proj = name.rsplit(".", 2)
            if not owner.endswith(".experts"):
                params[f"{name}.weight"].copy_(weight)
            elif proj == "down_proj":
                params[f"{owner}.down_proj"][int(expert)].copy_(weight)
            else:
                rows = weight.shape[0]
                params[f"{owner}.gate_up_proj"][int(expert)][(proj == "up_proj") * rows:][:rows].copy_(weight)
    return model.eval()


# ---------------------------------------------------------------- FP8, 128x128 blocks


def fp8_blocks(w: torch.Tensor) -> dict[str, torch.Tensor]:
    q, s = per_block_cast_to_fp8(w)
    return {"weight": q, "weight_scale_inv": s}


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory):
    """(folder, transformers' own load of it)."""
    root = tmp_path_factory.mktemp("fp8_moe")
    dense = save_tiny_checkpoint(tiny_config(Qwen3MoeConfig, **FP8_SIZES), root / "dense", seed=1).path
    path = quantized_folder(dense, root / "fp8", fp8_blocks, FP8)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_fp8_experts_stay_fp8_and_dequantize_exactly_as_transformers_and_deepseek(fp8_moe):
    path, theirs = fp8_moe
    model = load_model(path, "safetensors")
    experts = model.get_submodule(EXPERTS)
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
    stored = load_file(path / "model.safetensors")
    their_experts = theirs.get_submodule(EXPERTS)
    for e in range(4):
        gate, up, down = (weight_dequant(stored[f"{EXPERTS}.{e}.{p}.weight"],
                                         stored[f"{EXPERTS}.{e}.{p}.weight_scale_inv"])
                          for p in ("gate_proj", "up_proj", "down_proj"))
        assert torch.equal(experts.quant_method.dequantize(experts, e, "gate_up_proj"), torch.cat([gate, up]))
        assert torch.equal(experts.quant_method.dequantize(experts, e, "down_proj"), down)
        assert torch.equal(their_experts.gate_up_proj[e].float(), torch.cat([gate, up]))  # the reference agrees
        assert torch.equal(their_experts.down_proj[e].float(), down)


def test_fp8_moe_logits_and_greedy_tokens_equal_transformers_loading_the_folder(fp8_moe):
    path, theirs = fp8_moe
    # float32 on the same float32 weights: only the summation order differs
    assert (our_logits(load_model(path, "safetensors")) - hf_logits(theirs)).abs().max() < 1e-4
    assert greedy(path) == hf_greedy(theirs)


KERNELS = pytest.mark.parametrize("kernels", ["auto", "0"], ids=["fp8_matmul", "tiles"])


@KERNELS
def test_fp8_experts_in_bfloat16_compute_x_times_the_weight_rounded_once_with_rows_independent_of_their_number(
    fp8_moe, kernels, monkeypatch,
):
    """On llmplug's CPU kernel (where it builds) and on the tile path (LLMPLUG_CPU_KERNELS=0)."""
    monkeypatch.setenv(KERNELS_ENV, kernels)
    experts = load_model(fp8_moe[0], "safetensors", dtype="bfloat16").get_submodule(EXPERTS)
    experts.process_weights_after_loading(LinearOptions(row_invariant=True))  # batch-invariant mode's row plans
    generator = torch.Generator().manual_seed(3)
    for e, projection in ((0, "gate_up_proj"), (3, "down_proj")):
        weight = experts.quant_method.dequantize(experts, e, projection)
        x = torch.randn(17, weight.shape[1], generator=generator).to(torch.bfloat16)
        y = experts.quant_method.apply(experts, e, projection, x)
        expected = x.double() @ weight.to(torch.bfloat16).double().T
        assert (y.double() - expected).abs().max() <= 1e-2 * expected.abs().max()
        for m in range(1, 17):
            assert torch.equal(experts.quant_method.apply(experts, e, projection, x[:m]), y[:m]), m
    assert experts.quant_method.row_invariant


def test_fp8_moe_passes_llmplugs_quantization_method_check_with_its_experts(fp8_moe):
    from llmplug.testing.quantization import check_quantization_method

    report = check_quantization_method(fp8_moe[0], fp8_moe[1], atol=1e-4)
    experts = [check.prefix for check in report.layers if ".experts." in check.prefix]
    assert len(experts) == 2 * 4 * 2 and f"{EXPERTS}.3.down_proj" in experts  # layers x experts x projections
    assert report.quant_method == "fp8" and report.row_invariant


def test_fp8_experts_hold_the_checkpoints_bytes(fp8_moe):
    checkpoint = experts_bytes(fp8_moe[0])
    held = held_experts_bytes(load_model(fp8_moe[0], "safetensors", dtype="bfloat16"))
    assert checkpoint <= held <= 1.3 * checkpoint, (held, checkpoint)


@pytest.mark.parametrize("change, named", [
    (lambda t: {k: v for k, v in t.items() if k != f"{EXPERTS}.2.up_proj.weight_scale_inv"},
     f"{EXPERTS}.gate_up_proj_weight_scale_inv"),
    (lambda t: t | {f"{EXPERTS}.1.down_proj.weight_scale_inv": torch.ones(2, 1)},
     f"{EXPERTS}.1.down_proj.weight_scale_inv"),
    (lambda t: t | {f"{EXPERTS}.3.gate_proj.weight": t[f"{EXPERTS}.3.gate_proj.weight"].to(torch.bfloat16)},
     f"{EXPERTS}.3.gate_proj.weight"),
    (lambda t: t | {f"{EXPERTS}.0.down_proj.weight": t[f"{EXPERTS}.0.down_proj.weight"][:, :64].contiguous()},
     f"{EXPERTS}.0.down_proj.weight"),
], ids=["missing-scale", "scale-shape", "weight-dtype", "weight-shape"])
def test_a_bad_expert_tensor_is_refused_by_name_then_the_good_folder_loads(fp8_moe, tmp_path, change, named):
    bad = bad_copy(fp8_moe[0], tmp_path / "bad", change)
    with pytest.raises(ModelLoadError, match=named.replace(".", r"\.")):
        LLM(str(bad), dtype="float32", skip_tokenizer_init=True, block_size=4).shutdown()
    generates(fp8_moe[0])


def fp8_per_tensor(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """vLLM's static fp8 (tests/quantization/test_fp8.py): one weight_scale, one input_scale per projection."""
    scale = w.abs().amax() / FP8_MAX
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale.reshape(()), "input_scale": torch.tensor(0.02)}


def test_per_tensor_fp8_experts_with_static_input_scales_match_transformers_on_the_decoded_weights(tmp_path):
    dense = save_tiny_checkpoint(tiny_config(Qwen3MoeConfig, **CT_SIZES), tmp_path / "dense", seed=7)
    path = quantized_folder(dense.path, tmp_path / "fp8", fp8_per_tensor, {"quant_method": "fp8",
                                                                            "activation_scheme": "static"})
    decode = lambda stored, name: stored[f"{name}.weight"].float() * stored[f"{name}.weight_scale"]  # noqa: E731
    theirs = decoded_into(dense.hf_model, decode, path, "weight_scale")
    model = load_model(path, "safetensors")
    experts = model.get_submodule(EXPERTS)
    assert experts.down_proj.dtype == torch.float8_e4m3fn and "per-tensor" in repr(experts.quant_method)
    assert float(experts.gate_up_proj_input_scale[1]) == pytest.approx(0.02)  # read and checked, not applied
    assert (our_logits(model) - hf_logits(theirs)).abs().max() < 1e-4
    checkpoint, held = experts_bytes(path), held_experts_bytes(model)  # scales per row: 4 bytes per 64 here
    assert held <= 1.3 * checkpoint, (held, checkpoint)
    del model
    assert greedy(path) == hf_greedy(theirs)


# ---------------------------------------------------------------- tensor parallelism, one rank at a time


def rank_experts(config, method_config, tp: tuple[int, int], monkeypatch) -> FusedExperts:
    """FusedExperts as rank tp[0] of tp[1] builds it (the TP group faked: each rank's part is computed here)."""
    with monkeypatch.context() as patch, building_with(method_config):
        patch.setattr(experts_module, "get_tp_group", lambda: SimpleNamespace(rank_in_group=tp[0], world_size=tp[1]))
        return FusedExperts(config, 128, prefix="mlp.experts")


def load_experts(experts: FusedExperts, tensors: dict[str, torch.Tensor], options: LinearOptions) -> None:
    params = dict(experts.named_parameters())
    parts = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
    for name, tensor in tensors.items():
        e, proj, leaf = name.split(".")
        param, part = parts[proj]
        target = params[param if leaf == "weight" else f"{param}_{leaf}"]
        target.weight_loader(target, tensor, ExpertShard(int(e), part))
    experts.process_weights_after_loading(options)


def two_ranks_sum_to_the_experts(method_config, quantize, decode, monkeypatch) -> None:
    """Each TP=2 rank's partial output, summed, equals the experts computed in float64 on the decoded weights."""
    config = MoEConfig(RouterConfig(4, 2), intermediate_size=256)
    generator = torch.Generator().manual_seed(4)
    tensors, dense = {}, {}
    for e in range(4):
        for proj, shape in (("gate_proj", (256, 128)), ("up_proj", (256, 128)), ("down_proj", (128, 256))):
            stored = quantize(torch.randn(*shape, generator=generator) * 0.1)
            tensors |= {f"{e}.{proj}.{leaf}": t for leaf, t in stored.items()}
            dense[e, proj] = decode(stored).double()
    x = torch.randn(6, 128, generator=generator)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    weights = torch.rand(6, 2, generator=generator)
    expected = torch.zeros(6, 128, dtype=torch.float64)
    for t in range(6):
        for k in range(2):
            e = int(ids[t, k])
            row = x[t].double()
            hidden = torch.nn.functional.silu(row @ dense[e, "gate_proj"].T) * (row @ dense[e, "up_proj"].T)
            expected[t] += weights[t, k].double() * (hidden @ dense[e, "down_proj"].T)
    total = torch.zeros(6, 128)
    for rank in range(2):  # 128 intermediate features a rank: whole 128-column blocks, groups and packs
        experts = rank_experts(config, method_config, (rank, 2), monkeypatch)
        load_experts(experts, tensors, LinearOptions())
        total += experts(x, weights, ids)
    assert (total.double() - expected).abs().max() < 1e-4 * expected.abs().max()


@KERNELS
def test_tensor_parallel_fp8_experts_split_on_whole_blocks_and_sum_to_the_dequantized_experts(kernels, monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, kernels)
    decode = lambda stored: weight_dequant(stored["weight"], stored["weight_scale_inv"])  # noqa: E731
    two_ranks_sum_to_the_experts(Fp8Config(True, False, ()), fp8_blocks, decode, monkeypatch)
    with pytest.raises(ModelLoadError, match=r"mlp\.experts: tensor parallelism .* cuts down_proj's 128-column"):
        rank_experts(MoEConfig(RouterConfig(4, 2), intermediate_size=128), Fp8Config(True, False, ()), (0, 2),
                     monkeypatch)


# ---------------------------------------------------------------- compressed-tensors pack-quantized W4A16

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

needs_int4 = pytest.mark.skipif(not int4_kernel_supported("cpu", torch.float32), reason="no CPU int4 kernel here")


def ct_scheme(symmetric: bool, group_size: int) -> QuantizationScheme:
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=weights)


def ct_compress(scheme: QuantizationScheme):
    """compressed-tensors' min/max qparams and its pack-quantized compressor."""
    compressor, args = BaseCompressor.get_value_from_registry("pack-quantized"), scheme.weights

    def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
        n, k = w.shape
        groups = w.reshape(n, k // args.group_size, args.group_size)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        return compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme)

    return quantize


def ct_config(scheme: QuantizationScheme) -> dict:
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                ignore=["lm_head", "re:.*mlp.gate$"], quantization_status="compressed")
    return config.model_dump(mode="json")


def ct_decompress(scheme: QuantizationScheme, stored: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """compressed-tensors' own decompression of one projection's tensors."""
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    tensors = {leaf: stored[f"{module}.{leaf}"] for leaf in ("weight_packed", "weight_scale", "weight_zero_point",
                                                             "weight_shape") if f"{module}.{leaf}" in stored}
    return compressor.decompress(tensors, scheme)["weight"].float()


@pytest.fixture(scope="module", params=[(True, 32), (False, 64)], ids=["w4a16-g32-sym", "w4a16-g64-asym"])
def ct_moe(request, tmp_path_factory):
    """(folder, scheme, reference): transformers' own load of the folder (symmetric); for zero points, whose MoE
    experts transformers 5.25 cannot decompress ("Asymmetric quant requires zero-point values"), the dense
    transformers model holding compressed-tensors' own decompression of every projection."""
    from transformers import CompressedTensorsConfig as HfConfig

    root = tmp_path_factory.mktemp("ct_moe")
    dense = save_tiny_checkpoint(tiny_config(Qwen3MoeConfig, **CT_SIZES), root / "dense", seed=2)
    scheme = ct_scheme(*request.param)
    path = quantized_folder(dense.path, root / "ct", ct_compress(scheme), ct_config(scheme))
    if not scheme.weights.symmetric:
        decode = lambda stored, name: ct_decompress(scheme, stored, name)  # noqa: E731
        return path, scheme, decoded_into(dense.hf_model, decode, path, "weight_packed")
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                  quantization_config=HfConfig(run_compressed=False))
    return path, scheme, theirs.eval()


@needs_int4
def test_ct_w4a16_experts_are_int4_planes_and_decode_as_compressed_tensors_does(ct_moe):
    path, scheme, theirs = ct_moe
    experts = load_model(path, "safetensors").get_submodule(EXPERTS)
    assert not list(experts.parameters())  # the checkpoint's tensors freed: the int4 planes are what it holds
    assert all("int4" in repr(p.compute) for e in experts.quant_method.projections for p in e.values())
    stored = load_file(path / "model.safetensors")
    their_experts = theirs.get_submodule(EXPERTS)
    for e in range(4):
        gate, up, down = (ct_decompress(scheme, stored, f"{EXPERTS}.{e}.{p}") for p in ("gate_proj", "up_proj",
                                                                                        "down_proj"))
        assert torch.equal(their_experts.gate_up_proj[e].float(), torch.cat([gate, up]))  # the reference agrees
        assert torch.equal(their_experts.down_proj[e].float(), down)
        # read back through the kernel: one product per weight, so the decoded weight up to float32 rounding
        torch.testing.assert_close(experts.quant_method.dequantize(experts, e, "gate_up_proj"), torch.cat([gate, up]),
                                   atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(experts.quant_method.dequantize(experts, e, "down_proj"), down, atol=1e-6,
                                   rtol=1e-5)


@needs_int4
def test_ct_w4a16_moe_logits_and_greedy_tokens_equal_transformers_loading_the_folder(ct_moe):
    path, _, theirs = ct_moe
    model = load_model(path, "safetensors")
    # the int4 kernel sums in another order (and rounds its scales and zeros once): ulps per weight, as for the
    # linear layers (test_compressed_tensors.py), against > 0.05 for a wrong group, zero or packing
    torch.testing.assert_close(our_logits(model), hf_logits(theirs), atol=1e-3, rtol=0)
    assert_packed_and_greedy_equal(model, path, theirs)


@needs_int4
def test_ct_experts_split_on_whole_groups_sum_to_the_decoded_experts_and_a_bad_shape_is_refused_by_name(
    ct_moe, tmp_path, monkeypatch,
):
    path, scheme, _ = ct_moe
    config = CompressedTensorsConfig.from_config(ct_config(scheme))
    group = scheme.weights.group_size
    with pytest.raises(ModelLoadError, match=rf"mlp\.experts: .* packs of 8 and groups of {group}"):
        rank_experts(MoEConfig(RouterConfig(4, 2), intermediate_size=group * 3), config, (0, 2), monkeypatch)
    decode = lambda stored: ct_decompress(scheme, {f"w.{k}": v for k, v in stored.items()}, "w")  # noqa: E731
    two_ranks_sum_to_the_experts(config, ct_compress(scheme), decode, monkeypatch)
    name = f"{EXPERTS}.1.up_proj.weight_packed"
    bad = bad_copy(path, tmp_path / "bad", lambda t: t | {name: t[name][:, :-1].contiguous()})
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        LLM(str(bad), dtype="float32", skip_tokenizer_init=True, block_size=4).shutdown()
    generates(path)


def ct_fp8_scheme(strategy: str) -> QuantizationScheme:
    weights = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
    inputs = QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)


def ct_fp8_compress(scheme: QuantizationScheme):
    """compressed-tensors' min/max qparams (per channel or tensor) and its float-quantized compressor."""
    compressor, args = BaseCompressor.get_value_from_registry("float-quantized"), scheme.weights

    def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
        if args.strategy == "channel":
            low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)  # [N, 1]
        else:
            low, high = w.min().reshape(1), w.max().reshape(1)
        scale, zero = calculate_qparams(low, high, args)
        return compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme)

    return quantize


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_ct_fp8_experts_equal_the_packages_decompression_in_a_dense_transformers_model(tmp_path, strategy):
    scheme = ct_fp8_scheme(strategy)
    dense = save_tiny_checkpoint(tiny_config(Qwen3MoeConfig, **CT_SIZES), tmp_path / "dense", seed=8)
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="float-quantized",
                                ignore=["lm_head", "re:.*mlp.gate$"], quantization_status="compressed")
    path = quantized_folder(dense.path, tmp_path / "ct", ct_fp8_compress(scheme), config.model_dump(mode="json"))
    compressor = BaseCompressor.get_value_from_registry("float-quantized")

    def decode(stored: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        tensors = {leaf: stored[f"{name}.{leaf}"] for leaf in ("weight", "weight_scale")}
        return compressor.decompress(tensors, scheme)["weight"].float()

    theirs = decoded_into(dense.hf_model, decode, path, "weight_scale")
    model = load_model(path, "safetensors")
    experts = model.get_submodule(EXPERTS)
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
    for e in range(4):  # each expert decodes as compressed-tensors decodes it
        assert torch.equal(experts.quant_method.dequantize(experts, e, "down_proj"),
                           theirs.get_submodule(EXPERTS).down_proj[e].detach())
    assert (our_logits(model) - hf_logits(theirs)).abs().max() < 1e-4
    del model
    assert greedy(path) == hf_greedy(theirs)


# ---------------------------------------------------------------- GPTQ (Qwen-MoE GPTQ layout)

from tests.quantization.test_gptq import gptq_config, gptq_dequantize, gptq_quantizer  # noqa: E402

GPTQ_CASES = [dict(bits=4, group_size=32, sym=False, v2=False, desc_act=False),
              dict(bits=8, group_size=64, sym=True, v2=True, desc_act=False),
              dict(bits=4, group_size=32, sym=True, v2=False, desc_act=True)]


def gptq_leaves(settings: dict):
    """AutoGPTQ's packing (a transcription, tests/quantization/test_gptq.py); act-order: one input order for every
    projection of an input size (gate and up share theirs)."""
    quantize = gptq_quantizer(settings["bits"], settings["group_size"], settings["sym"], settings["desc_act"],
                              settings["v2"])
    return lambda w: {name.rpartition(".")[2]: t for name, t in quantize("m", w)[0].items()}


def gptq_decode(settings: dict):
    """optimum's / AutoGPTQ's dequantization (a transcription) of one projection's stored tensors."""
    def decode(stored: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        return gptq_dequantize(*(stored[f"{name}.{leaf}"] for leaf in ("qweight", "qzeros", "scales", "g_idx")),
                               settings["bits"], settings["v2"])

    return decode


@pytest.fixture(scope="module", params=GPTQ_CASES, ids=["4bit-g32-asym-v1", "8bit-g64-sym-v2", "4bit-g32-act-order"])
def gptq_moe(request, tmp_path_factory):
    """(folder, settings, the dense transformers model holding the weights the GPTQ tensors decode to)."""
    root = tmp_path_factory.mktemp("gptq_moe")
    dense = save_tiny_checkpoint(tiny_config(Qwen3MoeConfig, **CT_SIZES), root / "dense", seed=5)
    settings = request.param
    config = gptq_config(settings["bits"], settings["group_size"], settings["sym"], settings["desc_act"],
                         settings["v2"])
    path = quantized_folder(dense.path, root / "gptq", gptq_leaves(settings), config)
    return path, settings, decoded_into(dense.hf_model, gptq_decode(settings), path, "qweight")


@needs_int4
def test_gptq_moe_experts_are_int4_planes_and_match_transformers_on_the_decoded_weights(gptq_moe):
    path, settings, theirs = gptq_moe
    model = load_model(path, "safetensors")
    experts = model.get_submodule(EXPERTS)
    assert not list(experts.parameters()) and "GPTQ" in repr(experts.quant_method)
    permuted = [p.perm is not None for e in experts.quant_method.projections for p in e.values()]
    assert all(permuted) if settings["desc_act"] else not any(permuted)  # act-order: x's columns permuted per call
    their_experts = theirs.get_submodule(EXPERTS)
    for e in range(4):
        torch.testing.assert_close(experts.quant_method.dequantize(experts, e, "gate_up_proj"),
                                   their_experts.gate_up_proj[e].detach(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(experts.quant_method.dequantize(experts, e, "down_proj"),
                                   their_experts.down_proj[e].detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(our_logits(model), hf_logits(theirs), atol=1e-3, rtol=0)
    assert_packed_and_greedy_equal(model, path, theirs)


@needs_int4
def test_gptq_experts_split_on_whole_groups_and_a_g_idx_out_of_range_is_refused_by_name(gptq_moe, tmp_path,
                                                                                         monkeypatch):
    path, settings, _ = gptq_moe
    config = GPTQConfig.from_config(gptq_config(settings["bits"], settings["group_size"], settings["sym"],
                                                settings["desc_act"], settings["v2"]))
    decode = lambda stored: gptq_decode(settings)({f"w.{k}": v for k, v in stored.items()}, "w")  # noqa: E731
    two_ranks_sum_to_the_experts(config, gptq_leaves(settings), decode, monkeypatch)
    name = f"{EXPERTS}.2.down_proj.g_idx"
    outside = lambda t: t | {name: t[name] + 8}  # noqa: E731
    bad = bad_copy(path, tmp_path / "bad", outside)
    with pytest.raises(ModelLoadError, match=r"mlp\.experts\.down_proj_g_idx of expert 2 holds groups outside"):
        LLM(str(bad), dtype="float32", skip_tokenizer_init=True, block_size=4).shutdown()
    generates(path)


# ---------------------------------------------------------------- AWQ (GEMM)


@needs_int4
def test_awq_moe_experts_match_transformers_on_autoawqs_decoded_weights_and_split_on_whole_groups(tmp_path, monkeypatch):
    from tests.quantization.test_awq import _autoawq, awq_config, awq_quantizer

    dequantize_gemm, quantize = _autoawq()[1], awq_quantizer(64)  # AutoAWQ's from_linear packs, group 64
    leaves = lambda w: {name.rpartition(".")[2]: t for name, t in quantize("m", w)[0].items()}  # noqa: E731
    dense = save_tiny_checkpoint(tiny_config(Qwen3MoeConfig, **CT_SIZES), tmp_path / "dense", seed=9)
    path = quantized_folder(dense.path, tmp_path / "awq", leaves, awq_config(64))

    def decode(stored: dict[str, torch.Tensor], name: str) -> torch.Tensor:  # AutoAWQ's own dequantizer
        qweight, qzeros, scales = (stored[f"{name}.{leaf}"] for leaf in ("qweight", "qzeros", "scales"))
        return dequantize_gemm(qweight, qzeros, scales.float(), 4, 64).t()

    theirs = decoded_into(dense.hf_model, decode, path, "qweight")
    model = load_model(path, "safetensors")
    experts = model.get_submodule(EXPERTS)
    assert not list(experts.parameters()) and "AWQ" in repr(experts.quant_method)
    torch.testing.assert_close(our_logits(model), hf_logits(theirs), atol=1e-3, rtol=0)
    assert_packed_and_greedy_equal(model, path, theirs)
    decode_one = lambda stored: decode({f"w.{k}": v for k, v in stored.items()}, "w")  # noqa: E731
    two_ranks_sum_to_the_experts(AWQConfig.from_config(awq_config(64)), leaves, decode_one, monkeypatch)


# ---------------------------------------------------------------- the protocol: a third party's experts method


class _DeclaredExperts(QuantizedExpertsMethod):
    """int8 experts whose rows (it declares) depend on their number."""

    row_invariant = False

    def create_weights(self, experts: FusedExperts) -> None:
        i, h = experts.intermediate_size, experts.hidden_size
        for projection, shape in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            experts.create_parameter(f"{projection}_qweight", projection, shape, torch.int8, 0, 1)

    def apply(self, experts: FusedExperts, expert: int, projection: str, x: torch.Tensor) -> torch.Tensor:
        return x @ self.dequantize(experts, expert, projection).t()

    def dequantize(self, experts: FusedExperts, expert: int, projection: str) -> torch.Tensor:
        return getattr(experts, f"{projection}_qweight")[expert].float()


class _DeclaredConfig(Fp8Config):
    def experts_method(self, experts: FusedExperts, prefix: str) -> QuantizedExpertsMethod:
        return _DeclaredExperts()


def test_a_third_party_experts_method_loads_each_expert_and_a_declared_row_dependence_is_named() -> None:
    with building_with(_DeclaredConfig(True, False, ())):
        experts = FusedExperts(MoEConfig(RouterConfig(4, 2), intermediate_size=8), 16, prefix="mlp.experts")
    generator = torch.Generator().manual_seed(6)
    weights = {(e, proj): torch.randint(-8, 8, shape, generator=generator, dtype=torch.int8)
               for e in range(4) for proj, shape in (("gate_proj", (8, 16)), ("up_proj", (8, 16)),
                                                     ("down_proj", (16, 8)))}
    load_experts(experts, {f"{e}.{proj}.qweight": w for (e, proj), w in weights.items()}, LinearOptions())
    assert torch.equal(experts.gate_up_proj_qweight[2], torch.cat([weights[2, "gate_proj"], weights[2, "up_proj"]]))
    assert torch.equal(experts.down_proj_qweight[3], weights[3, "down_proj"])
    assert row_variant_weights(torch.nn.ModuleDict({"mlp": experts})) == [
        "mlp.experts (_DeclaredExperts, whose rows depend on their number)"]


# ---------------------------------------------------------------- formats whose experts no method holds


@pytest.mark.parametrize("quantization_config, named", [
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
     "compressed-tensors int-quantized with quantized input activations checkpoints of mixture-of-experts"),
])
def test_a_moe_checkpoint_whose_experts_no_method_holds_is_refused_by_name_then_the_dense_one_loads(
    tmp_path, quantization_config, named,
):
    config = tiny_config(Qwen2MoeConfig, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32)
    dense = save_tiny_checkpoint(config, tmp_path / "dense").path
    quantized = Path(shutil.copytree(dense, tmp_path / "quantized"))
    saved = json.loads((quantized / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**saved, "quantization_config": quantization_config}))
    with pytest.raises(ModelLoadError, match=rf"model\.layers\.0\.mlp\.experts: {named}"):
        LLM(str(quantized), dtype="float32", skip_tokenizer_init=True)
    generates(dense)
