"""Prove a quantization method (an `llmplug.quantization` plugin) through the whole engine, as llmplug's tests do.

`save_quantized_checkpoint(tiny, path, quantization_config, quantize)` turns a tiny transformers checkpoint
(`save_tiny_checkpoint`) into one of the method's format: `quantize(module, weight)` gives each linear module's
tensors as the format stores them and the dense weight they stand for; the returned TinyCheckpoint's model is
transformers' model holding those dequantized weights, the reference.

`check_quantization_method(path, reference)` loads the checkpoint with `llmplug.LLM` (the method found by
config.json's quant_method through its entry point, as any user's engine finds it) and asserts:

- some linear layers were built with the method (weight None, a `QuantizedLinearMethod`), or some MoE layers'
  experts (a `QuantizedExpertsMethod`), else nothing is proved;
- each such layer's `apply(x)` equals x @ `dequantize(layer)`^T + b (its own dequantized reference, float64)
  within `layer_rtol` of the reference's largest entry; so does each local expert's projection (gate_up_proj,
  down_proj), reported as `<experts prefix>.<expert>.<projection>`;
- rows are invariant: `apply` on rows 0..M-1 gives, row by row, bitwise what it gives each row alone, for every M
  up to `max_rows`; a method whose `row_invariant` is False is reported so (None), not checked;
- greedy generation gives transformers' tokens on the reference weights, and every log-probability the engine
  reports (prompt and generated positions) is within `atol` of transformers'.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from llmplug.testing.parity import (
    BASE_ENGINE_KWARGS,
    TOP_LOGPROBS,
    ParityCase,
    _assert_same_tokens,
    _completion,
    _hf_reference,
    _max_logprob_diff,
    _one_thread,
)
from llmplug.testing.tiny import TinyCheckpoint

__all__ = ["LayerCheck", "QuantizationReport", "check_quantization_method", "save_quantized_checkpoint"]

# (module name, dense weight [out, in]) -> (the format's tensors by leaf name, the dense weight they stand for)
Quantize = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


@dataclass(frozen=True, slots=True)
class LayerCheck:
    """One quantized layer: its prefix, its method's class and apply's worst error against its own dequantize."""

    prefix: str
    method: str
    relative_error: float  # max |apply - x W^T - b| / max |x W^T + b|, W = dequantize(layer)


@dataclass(frozen=True, slots=True)
class QuantizationReport:
    """A passed check of a quantized checkpoint through the engine."""

    quant_method: str  # config.json's quantization_config.quant_method
    distribution: str  # the distribution whose `llmplug.quantization` entry point the engine used
    layers: tuple[LayerCheck, ...]
    row_invariant: bool | None  # True: checked bitwise for 1..max_rows rows; None: the method declares it does not hold
    max_logprob_diff: float


def _linear_modules(model: torch.nn.Module) -> list[str]:
    """Names of the torch.nn.Linear modules of `model` except the LM head (kept dense by most formats)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.rpartition(".")[2] != "lm_head"]


def save_quantized_checkpoint(
    tiny: TinyCheckpoint,
    path: str | Path,
    quantization_config: Mapping[str, Any],
    quantize: Quantize,
    modules: list[str] | None = None,
) -> TinyCheckpoint:
    """`tiny`'s checkpoint in a quantized format at `path`: each of `modules` (default: every nn.Linear but the LM
    head) stored as `quantize` gives it, `quantization_config` in config.json. Returns the saved folder and the
    reference: a copy of `tiny`'s model whose quantized modules hold the dequantized weights."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    reference = copy.deepcopy(tiny.hf_model)
    tied = getattr(reference.config, "tie_word_embeddings", False)
    tensors = {name: t.detach().contiguous() for name, t in reference.state_dict().items()
               if not (tied and name == "lm_head.weight")}
    with torch.no_grad():
        for name in modules if modules is not None else _linear_modules(reference):
            module = reference.get_submodule(name)
            stored, dense = quantize(name, module.weight.detach().clone())
            if dense.shape != module.weight.shape:
                raise ValueError(f"quantize({name!r}) gave a dense weight of {tuple(dense.shape)}, "
                                 f"not the module's {tuple(module.weight.shape)}")
            module.weight.copy_(dense)
            del tensors[f"{name}.weight"]
            tensors.update({f"{name}.{leaf}": t.contiguous() for leaf, t in stored.items()})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    for extra in tiny.path.iterdir():  # generation_config.json and the like
        if extra.suffix != ".safetensors" and extra.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(extra, path / extra.name)
    config = json.loads((tiny.path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": dict(quantization_config)}, indent=2))
    return TinyCheckpoint(path, reference.eval())


def check_quantization_method(
    checkpoint: str | Path,
    reference: torch.nn.Module,
    *,
    prompt_lengths: tuple[int, ...] = (3, 11, 1, 7),
    max_new_tokens: int = 8,
    atol: float = 1e-4,
    layer_rtol: float = 1e-5,
    max_rows: int = 16,
    engine_kwargs: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> QuantizationReport:
    """Load the quantized `checkpoint` through the engine and assert what the module doc says; `reference` is
    transformers' model on the dequantized weights (what `save_quantized_checkpoint` returns). Float32 and one
    thread by default, like the parity tests; `engine_kwargs` adds or overrides engine settings (the engine must run
    its worker in this process: tensor_parallel_size 1)."""
    from llmplug import LLM
    from llmplug.core.params import SamplingParams
    from llmplug.quantization import GROUP

    found = _quant_method_of(Path(checkpoint))
    if found is None:
        raise ValueError(f"{checkpoint}: config.json has no quantization_config; this checks quantized checkpoints")
    quant_method = found[0]
    case = ParityCase(name=f"{quant_method}:{Path(checkpoint).name}", make_config=lambda: reference.config,
                      prompt_lengths=prompt_lengths, max_new_tokens=max_new_tokens, atol=atol, seed=seed)
    expected = _hf_reference(reference, case)
    llm = LLM(str(checkpoint), **{**BASE_ENGINE_KWARGS, **(engine_kwargs or {})})
    try:
        info = llm.llm_engine.registry.resolve(GROUP, quant_method)  # the entry point the engine loaded
        layers, invariant = _check_layers(_worker_model(llm), max_rows, layer_rtol, seed)
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True,
                                logprobs=TOP_LOGPROBS, prompt_logprobs=TOP_LOGPROBS)
        outputs = llm.generate([{"prompt_token_ids": p} for p in expected.prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    worst = 0.0
    for i, (prompt, tokens, output) in enumerate(zip(expected.prompts, expected.tokens, outputs)):
        got = _completion(output)
        _assert_same_tokens(got.tokens, tokens, f"{case.name} prompt {i} ({len(prompt)} tokens)")
        worst = max(worst, _max_logprob_diff(got, expected.log_probs[i], len(prompt)))
    if not worst <= atol:
        raise AssertionError(f"{case.name}: log-probabilities differ from transformers on the dequantized weights by "
                             f"up to {worst:.3g} > {atol}")
    return QuantizationReport(quant_method, info.distribution, layers, invariant, worst)


def _quant_method_of(checkpoint: Path) -> tuple[str, dict[str, Any]] | None:
    """(quant_method, quantization_config) of the checkpoint's config.json; None when it has none."""
    from types import SimpleNamespace

    from llmplug.quantization import checkpoint_quant_method

    config = json.loads((checkpoint / "config.json").read_text())
    return checkpoint_quant_method(SimpleNamespace(quantization_config=config.get("quantization_config")))


def _worker_model(llm: Any) -> torch.nn.Module:
    """The model the engine's in-process worker runs."""
    worker = getattr(llm.llm_engine.engine_core.executor, "worker", None)
    if worker is None:
        raise ValueError("check_quantization_method needs the engine's worker in this process "
                         "(tensor_parallel_size=1, pipeline_parallel_size=1, the default executor)")
    return worker.model_runner.model


def _check_layers(
    model: torch.nn.Module, max_rows: int, rtol: float, seed: int
) -> tuple[tuple[LayerCheck, ...], bool | None]:
    """Each quantized layer against its own dequantized weight, and its rows' invariance (see the module doc)."""
    from llmplug.layers.linear import LinearBase
    from llmplug.quantization import QuantizedLinearMethod

    # a method may keep a tensor named `weight` (fp8 checkpoints do): the layer's method says it is quantized
    quantized = [
        m for m in model.modules() if isinstance(m, LinearBase) and isinstance(m.quant_method, QuantizedLinearMethod)
    ] + _expert_projections(model)
    if not quantized:
        raise AssertionError("no linear layer or experts were built with the checkpoint's quantization method: the "
                             "engine ran the model dense, so nothing about the method is proved")
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    generator = torch.Generator().manual_seed(seed)
    checks, invariant = [], True
    with torch.inference_mode(), _one_thread():
        for layer in quantized:
            method = layer.quant_method
            x = torch.randn(max_rows, layer.input_size, generator=generator).to(dtype)  # [rows, in]
            checks.append(LayerCheck(layer.prefix, type(method).__name__, _relative_error(layer, x, rtol)))
            if not method.row_invariant:
                invariant = None
            elif invariant:
                _assert_rows_invariant(layer, x)
    return tuple(checks), invariant


@dataclass(frozen=True, slots=True)
class _ExpertProjection:
    """One local expert's projection of a quantized FusedExperts, shaped like a linear layer for the checks."""

    experts: Any  # llmplug.layers.moe.FusedExperts
    expert: int
    projection: str  # "gate_up_proj" or "down_proj"
    output_size: int
    input_size: int
    bias: None = None

    @property
    def prefix(self) -> str:
        return f"{self.experts.prefix}.{self.expert}.{self.projection}"

    @property
    def quant_method(self) -> _ExpertProjection:
        return self

    @property
    def row_invariant(self) -> bool:
        return self.experts.quant_method.row_invariant

    def apply(self, layer: Any, x: torch.Tensor, bias: None) -> torch.Tensor:
        return self.experts.quant_method.apply(self.experts, self.expert, self.projection, x)

    def dequantize(self, layer: Any) -> torch.Tensor:
        return self.experts.quant_method.dequantize(self.experts, self.expert, self.projection)


def _expert_projections(model: torch.nn.Module) -> list[_ExpertProjection]:
    """Every local expert's projections of the model's quantized experts."""
    from llmplug.layers.moe import FusedExperts
    from llmplug.quantization import QuantizedExpertsMethod

    found = []
    for experts in model.modules():
        if isinstance(experts, FusedExperts) and isinstance(experts.quant_method, QuantizedExpertsMethod):
            i, h = experts.intermediate_size, experts.hidden_size
            for e in range(experts.num_local_experts):
                found += [_ExpertProjection(experts, e, "gate_up_proj", 2 * i, h),
                          _ExpertProjection(experts, e, "down_proj", h, i)]
    return found


def _relative_error(layer: Any, x: torch.Tensor, rtol: float) -> float:
    """apply(x) against x W^T + b in float64, W = dequantize(layer); AssertionError beyond `rtol`."""
    method = layer.quant_method
    weight = method.dequantize(layer)
    if tuple(weight.shape) != (layer.output_size, layer.input_size):
        raise AssertionError(f"{layer.prefix}: {type(method).__name__}.dequantize gave {tuple(weight.shape)}, "
                             f"not [out, in] = {(layer.output_size, layer.input_size)}")
    y = method.apply(layer, x, layer.bias)
    expected = x.double() @ weight.double().T  # [rows, out]
    if layer.bias is not None:
        expected = expected + layer.bias.double()
    error = float((y.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30))
    if not error <= rtol:
        raise AssertionError(f"{layer.prefix}: {type(method).__name__}.apply differs from x @ dequantize(layer)^T "
                             f"by {error:.3g} of its largest entry > {rtol}")
    return error


def _assert_rows_invariant(layer: Any, x: torch.Tensor) -> None:
    """Rows of apply(x[:M]) bitwise equal to apply of each row alone, for M = 1..len(x)."""
    method = layer.quant_method
    alone = torch.cat([method.apply(layer, x[i : i + 1], layer.bias) for i in range(len(x))])
    for rows in range(1, len(x) + 1):
        together = method.apply(layer, x[:rows], layer.bias)
        if not torch.equal(together, alone[:rows]):
            row = int((together != alone[:rows]).any(-1).nonzero()[0])
            raise AssertionError(f"{layer.prefix}: {type(method).__name__} declares row_invariant, but row {row} of "
                                 f"a {rows}-row call differs bitwise from that row computed alone")
