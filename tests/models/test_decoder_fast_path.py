"""The decoder's CPU fast path (llmplug/layers/decoder/fast_path.py) gives its modules' outputs bit for bit, on
the tiny Llama, Mistral, Qwen2 (biases) and Qwen3 (q/k norms, scaled rope) models: flattened prefill, a chunk
between decodes, batched decodes; a hooked layer runs its modules (the hook fires) while the others stay fast.
With dense or int4 layers, the C++ stack of all layers (decoder/native_stack.py) gives the straight-line run's bits,
and follows a replaced weight, norm weight, bias or cache. A qkv on the AMX kernel rotates its heads as it stores
them, with the same bits."""

from __future__ import annotations

import pytest
import torch

from llmplug.layers.decoder import fast_path
from llmplug.layers.decoder.fast_path import DecoderFastPath
from llmplug.layers.decoder.native_stack import NativeDecoderStack
from llmplug.layers.kernels.amx_linear import amx_linear_enabled
from llmplug.layers.kernels.int4_matmul import NativeInt4
from llmplug.layers.kernels.native import native_available
from llmplug.layers.packed_linear import AmxLinearMethod, PrepackedLinearMethod, RowPlannedDenseMethod
from llmplug.layers.quantization import Int4LinearMethod, quantize_int4
from llmplug.layers.row_invariance import RowPlan
from llmplug.testing.paged import PagedHarness

from .test_llama_parity import prompts
from .tiny_models import TinyModel, make_tiny

pytestmark = pytest.mark.skipif(not native_available(), reason="the fast path runs on llmplug's CPU kernels")


def run_steps(model: torch.nn.Module, vocab: int) -> list[torch.Tensor]:
    """Every step's logits: two prompts at once, then a third prompt in chunks between their decodes."""
    harness = PagedHarness(model, num_blocks=96)
    first, second, long = prompts(vocab, (7, 12, 17), seed=3)
    harness.add("a", first)
    harness.add("b", second)
    harness.add("long", long)
    steps = [harness.step([("a", len(first)), ("b", len(second))])]
    for chunk in (6, 6, 5, 1, 1):  # the last two: all three decode together
        for name in ("a", "b"):
            harness.seqs[name].tokens.append(int(steps[-1][name][-1].argmax()))
        if harness.seqs["long"].num_computed == len(harness.seqs["long"].tokens):  # its prompt is done
            harness.seqs["long"].tokens.append(int(steps[-1]["long"][-1].argmax()))
        steps.append(harness.step([("a", 1), ("long", chunk), ("b", 1)]))
    return [torch.cat(list(step.values())) for step in steps]


@pytest.fixture
def layer_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ids of the layer parts each straight-line run computed, in call order."""
    runs: list[int] = []
    run = fast_path._run

    def counted(plain, *args):
        runs.append(id(plain))
        return run(plain, *args)

    monkeypatch.setattr(fast_path, "_run", counted)
    return runs


@pytest.fixture
def no_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers take the straight-line run, never the C++ stack of all layers (tested below)."""
    monkeypatch.setattr(NativeDecoderStack, "run", lambda *args: None)


def module_path_steps(model: torch.nn.Module, vocab: int) -> list[torch.Tensor]:
    """run_steps with every layer through its modules."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecoderFastPath, "_step_metadata", lambda *args: None)
        return run_steps(model, vocab)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fast_path_gives_the_module_path_bits(
    tiny: TinyModel, dtype: str, layer_runs: list[int], no_stack: None
) -> None:
    model = tiny.load(dtype)
    vocab = tiny.hf_model.config.vocab_size
    fast_layers = model.model.run_layers
    assert all(plain is not None for plain in fast_layers.plain), "every layer of these models is plain"
    expected = module_path_steps(model, vocab)
    assert layer_runs == []
    got = run_steps(model, vocab)
    assert len(layer_runs) == len(got) * len(fast_layers.layers)
    for step, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item():.3e}"


def test_a_hooked_layer_runs_its_modules_and_the_others_stay_fast(
    tiny: TinyModel, layer_runs: list[int], no_stack: None
) -> None:
    model = tiny.load("bfloat16")
    vocab = tiny.hf_model.config.vocab_size
    expected = module_path_steps(model, vocab)
    fast_layers = model.model.run_layers
    hooked = fast_layers.layers[-1]
    seen: list[int] = []
    handle = hooked.mlp.down_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
    try:
        got = run_steps(model, vocab)
    finally:
        handle.remove()
    assert len(seen) == len(got), "the hook fires once per step"
    assert id(fast_layers.plain[-1]) not in layer_runs
    assert len(layer_runs) == len(got) * (len(fast_layers.layers) - 1)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    layer_runs.clear()
    run_steps(model, vocab)  # the hook removed: every layer is fast again
    assert id(fast_layers.plain[-1]) in layer_runs


def test_other_layer_shapes_run_their_modules(tiny: TinyModel) -> None:
    model = tiny.load("float32")
    layer = model.model.layers[0]
    layer.residual_multiplier = 0.5  # a scaled residual (Granite): not the plain shape
    assert DecoderFastPath([layer], [0]).plain == [None]
    layer.residual_multiplier = 1.0
    layer.mlp.act_fn = torch.nn.Identity()  # another activation
    assert DecoderFastPath([layer], [0]).plain == [None]
    other = model.model.layers[1]
    assert DecoderFastPath([other], [0]).plain != [None]
    other.__class__ = type("FamilyLayer", (type(other),), {})  # a subclass may compute otherwise
    assert DecoderFastPath([other], [0]).plain == [None]


def int4_layers(model: torch.nn.Module, scale: float = 1.0) -> None:
    """Every linear of the model's layers computes through llmplug's int4 kernel, for all rows (its weight, times
    `scale`, quantized)."""
    for plain in model.model.run_layers.plain:
        for linear in plain.linears:
            linear.quant_method = int4_method(linear.weight * scale)


def int4_method(weight: torch.Tensor) -> Int4LinearMethod:
    return Int4LinearMethod(NativeInt4.pack(quantize_int4(weight), weight.dtype), None, exact=True, rows="all")


@pytest.fixture
def stack_runs(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each C++ stack call ran the layers (False: it left them to the straight-line run)."""
    runs: list[bool] = []
    run = NativeDecoderStack.run

    def counted(self, *args):
        out = run(self, *args)
        runs.append(out is not None)
        return out

    monkeypatch.setattr(NativeDecoderStack, "run", counted)
    return runs


def straight_line_steps(model: torch.nn.Module, vocab: int) -> list[torch.Tensor]:
    """run_steps without the C++ stack."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(NativeDecoderStack, "run", lambda *args: None)
        return run_steps(model, vocab)


def planned_dense_layers(model: torch.nn.Module, plan: RowPlan) -> None:
    """Every linear of the layers computes densely by the row plan `plan` (padding, as oneDNN's one-row kernel needs
    on some CPUs; tiles, as AMX's blocking does): oneDNN packed in bf16, F.linear in float32."""
    for plain in model.model.run_layers.plain:
        for linear in plain.linears:
            method = linear.quant_method
            if not isinstance(method, PrepackedLinearMethod):
                method = linear.quant_method = RowPlannedDenseMethod(linear.weight, row_invariant=False)
            method.row_plan = plan


@pytest.mark.parametrize("weights", ["dense", "padded dense", "tiled dense", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_native_stack_gives_the_straight_line_bits(
    tiny: TinyModel, dtype: str, weights: str, layer_runs: list[int], stack_runs: list[bool]
) -> None:
    model = tiny.load(dtype)
    if weights == "int4":
        int4_layers(model)
    elif weights != "dense":
        planned_dense_layers(model, RowPlan(min_rows=5) if weights == "padded dense" else RowPlan(tile=4))
    vocab = tiny.hf_model.config.vocab_size
    fast_layers = model.model.run_layers
    if any(plain.attention.q_norm is not None for plain in fast_layers.plain):
        assert fast_layers.stack is None  # q/k norms (Qwen3): the straight-line run
        return
    expected = straight_line_steps(model, vocab)
    assert len(layer_runs) == len(expected) * len(fast_layers.layers)
    layer_runs.clear()
    got = run_steps(model, vocab)
    assert stack_runs == [True] * len(got) and layer_runs == []  # every step, prefills and chunks included
    for step, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item():.3e}"


def test_the_native_stack_follows_a_replaced_weight_and_leaves_a_hooked_layer_to_python(
    tiny: TinyModel, layer_runs: list[int], stack_runs: list[bool]
) -> None:
    model = tiny.load("bfloat16")
    int4_layers(model)
    fast_layers = model.model.run_layers
    if fast_layers.stack is None:
        pytest.skip("no stack for this model's layers (q/k norms)")
    vocab = tiny.hf_model.config.vocab_size
    before = run_steps(model, vocab)
    down = fast_layers.plain[-1].down
    down.quant_method = int4_method(down.weight * 1.5)  # as a weight update replaces the packed copy
    expected = straight_line_steps(model, vocab)
    stack_runs.clear()
    got = run_steps(model, vocab)
    assert all(stack_runs) and not all(torch.equal(a, b) for a, b in zip(got, before))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    seen: list[int] = []
    handle = down.register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
    try:
        stack_runs.clear()
        layer_runs.clear()
        hooked = run_steps(model, vocab)
    finally:
        handle.remove()
    assert stack_runs == [False] * len(hooked) and len(seen) == len(hooked)  # the hook fires: its layer's modules
    assert all(torch.equal(a, b) for a, b in zip(hooked, expected))


@pytest.mark.parametrize("change", ["norm weight", "dense weight", "bias"])
def test_the_native_stack_follows_each_value_it_was_built_from(
    tiny: TinyModel, stack_runs: list[bool], change: str
) -> None:
    """A replaced parameter the stack holds rebuilds it: the built stacks stop holding, the outputs change and are
    the straight-line run's (each run_steps also binds new caches, which rebuilds it too)."""
    model = tiny.load("float32")  # dense float32 linears: F.linear of their own weight
    fast_layers = model.model.run_layers
    if fast_layers.stack is None:
        pytest.skip("no stack for this model's layers (q/k norms)")
    vocab = tiny.hf_model.config.vocab_size
    before = run_steps(model, vocab)
    built = list(fast_layers.stack._stacks.values())
    hidden = torch.zeros(1, tiny.hf_model.config.hidden_size)
    assert built and all(stack.holds(hidden) for stack in built)
    plain = fast_layers.plain[-1]
    if change == "norm weight":
        plain.mlp_norm.weight = torch.nn.Parameter(plain.mlp_norm.weight * 1.5)
    elif change == "dense weight":
        plain.down.weight = torch.nn.Parameter(plain.down.weight * 1.5)
    else:
        plain.o.bias = torch.nn.Parameter(torch.full((plain.o.weight.shape[0],), 0.25))
    assert not any(stack.holds(hidden) for stack in built)
    expected = straight_line_steps(model, vocab)
    stack_runs.clear()
    got = run_steps(model, vocab)
    assert all(stack_runs) and not all(torch.equal(a, b) for a, b in zip(got, before))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def kernel_calls(run) -> dict[str, int]:
    """Calls of llmplug's CPU kernels (and others) while `run()` runs, by name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run()
    return {event.key: event.count for event in profile.key_averages()}


@pytest.mark.skipif(not amx_linear_enabled(), reason="no AMX-BF16 here")
def test_a_qkv_on_amx_rotates_its_heads_as_it_stores_them(tmp_path, stack_runs: list[bool]) -> None:
    """Heads of 32 dims (rotate-half, no q/k norms) with qkv on the AMX kernel: the product rotates the q and k heads
    as it stores them, one call instead of two, in the straight-line run and the C++ stack alike, with the module
    path's bits (the tiny Llama's biases included)."""
    tiny = make_tiny("llama", tmp_path, overrides={"num_attention_heads": 2, "num_key_value_heads": 1})
    model = tiny.load("bfloat16")
    plain = model.model.run_layers.plain
    for layer in plain:  # AMX is the batch-invariant mode's method; this load is not in that mode
        assert layer.attention.head_dim == 32
        layer.qkv.quant_method = AmxLinearMethod(layer.qkv.weight)
    vocab = tiny.hf_model.config.vocab_size
    expected = module_path_steps(model, vocab)
    for name, steps in (("straight line", lambda: straight_line_steps(model, vocab)),
                        ("stack", lambda: run_steps(model, vocab))):
        stack_runs.clear()
        got: list[torch.Tensor] = []
        calls = kernel_calls(lambda: got.extend(steps()))
        assert calls.get("llmplug_cpu::amx_linear_rotary") == len(expected) * len(plain), name
        assert "llmplug_cpu::rotary_embedding" not in calls, name
        assert any(stack_runs) == (name == "stack")
        for step, (a, b) in enumerate(zip(got, expected)):
            assert torch.equal(a, b), f"{name}, step {step}: max diff {(a - b).abs().max().item():.3e}"
