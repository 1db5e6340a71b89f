"""GGUF Q4_0 / Q4_1 / Q8_0 blocks as exact int4 groups: decoded from the raw blocks, unpermuted like
the dense weights, packed into the layers, and used by the engine for small batches.

Truth: `gguf.quants.dequantize` of the same blocks, the dense weights the loader yields, and the
engine's own output with `quantization=none`.
"""

from __future__ import annotations

import gc
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.core.config import EngineConfig, ModelConfig
from llmplug.layers.decoder.native_stack import NativeDecoderStack
from llmplug.layers.forward_context import current_generated_rows
from llmplug.layers.kernels.int4_matmul import NativeInt4
from llmplug.layers.kernels.w4a8 import W4A8, W4A8_ENV
from llmplug.layers.quantization import DENSE, Int4Groups, Int4LinearMethod, PackedInt4, int4_kernel_supported
from llmplug.loaders.gguf import GGUFLoader, dequantize_tensor, int4_groups_of_tensor, iter_gguf_weights
from llmplug.plugins.models.llama import LlamaForCausalLM

from .gguf_writer_utils import make_tiny_model, tiny_llama_config, write_model_gguf

pytestmark = pytest.mark.skipif(
    not int4_kernel_supported("cpu", torch.float32), reason="torch has no CPU int4 weight-only kernel here"
)
Q = gguf.GGMLQuantizationType
EXACT_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]


def quantized_tensor(qtype: Q, rows: int = 64, cols: int = 256, seed: int = 0) -> SimpleNamespace:
    """What GGUFReader gives for one matrix written with the gguf package's own quantize."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    data = gguf.quants.quantize(values, qtype)  # [rows, bytes per row]
    return SimpleNamespace(tensor_type=qtype, shape=np.array([cols, rows]), data=data)  # GGUF lists dims reversed


@pytest.mark.parametrize("qtype", EXACT_TYPES, ids=lambda qtype: qtype.name)
def test_groups_decoded_from_blocks_equal_gguf_dequantize_exactly(qtype: Q) -> None:
    tensor = quantized_tensor(qtype)
    groups = int4_groups_of_tensor(tensor)
    assert groups.num_planes == (2 if qtype == Q.Q8_0 else 1) and groups.group_size == 32
    assert torch.equal(groups.dequantize(), dequantize_tensor(tensor))


@pytest.mark.parametrize("qtype", EXACT_TYPES, ids=lambda qtype: qtype.name)
def test_int4_matmul_equals_dense_matmul_with_the_dequantized_weights(qtype: Q) -> None:
    tensor = quantized_tensor(qtype, seed=1)
    packed = PackedInt4.pack(int4_groups_of_tensor(tensor), torch.float32, torch.device("cpu"))
    x = torch.randn(4, 256)
    expected = x.double() @ dequantize_tensor(tensor).double().T
    torch.testing.assert_close(packed.matmul(x).double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qtype", EXACT_TYPES, ids=lambda qtype: qtype.name)
def test_bf16_scales_move_weights_by_at_most_their_rounding(qtype: Q) -> None:
    tensor = quantized_tensor(qtype, seed=2)
    groups = int4_groups_of_tensor(tensor)
    rounded = Int4Groups(groups.q, groups.scale.bfloat16().float(), groups.zero.bfloat16().float(), 32)
    error = (rounded.dequantize() - dequantize_tensor(tensor)).abs()
    # bf16 keeps 8 significant bits: rounding moves each scale and zero by at most 2^-8 of itself
    bound = sum(
        (8 * groups.scale[p].abs() + groups.zero[p].abs()).repeat_interleave(32, dim=-1) * 2**-8
        for p in range(groups.num_planes)
    )
    assert (error <= bound + 1e-9).all()


def test_unsupported_type_has_no_exact_int4_form() -> None:
    with pytest.raises(ValueError, match="Q5_0"):
        int4_groups_of_tensor(quantized_tensor(Q.Q5_0))


# ---------------------------------------------------------------- through the loader into the layers


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[Q, Path]:
    """A tiny Llama (vocab 256, so the untied LM head packs too) in Q4_1, Q8_0 and F32."""
    model = make_tiny_model(tiny_llama_config(vocab_size=256))
    folder = tmp_path_factory.mktemp("int4")
    return {q: write_model_gguf(folder / f"{q.name}.gguf", model, q, tokenizer=False) for q in (Q.Q4_1, Q.Q8_0, Q.F32)}


def load(path: Path, quantization: str, dtype: str = "float32", invariant: bool = False) -> torch.nn.Module:
    model = ModelConfig(model=str(path), dtype=dtype, quantization=quantization, batch_invariant=invariant or "auto")
    config = EngineConfig(model=model)
    return GGUFLoader(config.load).load_model(config, device="cpu", model_class=LlamaForCausalLM)


def layer_methods(model: torch.nn.Module) -> dict[str, object]:
    return {name: module.quant_method for name, module in model.named_modules() if hasattr(module, "quant_method")}


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda qtype: qtype.name)
def test_auto_packs_every_layer_exactly_in_the_rows_of_its_dense_weight(tiny_files: dict[Q, Path], qtype: Q) -> None:
    model = load(tiny_files[qtype], "auto", "bfloat16")
    modules = dict(model.named_modules())
    methods = layer_methods(model)
    assert len(methods) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; lm_head
    for name, method in methods.items():
        assert isinstance(method, Int4LinearMethod) and method.exact, name
        weight = modules[name].weight
        eye = torch.eye(weight.shape[1], dtype=torch.bfloat16)
        # the packed copy, applied to the identity, is the layer's (unpermuted, fused) dense weight, up to the bf16
        # rounding of both (the scales', the weight's)
        torch.testing.assert_close(method.packed.matmul(eye).float(), weight.T.float(), rtol=0.02, atol=2e-3, msg=name)
    assert not any(hasattr(param, "int4_staging") for param in model.parameters())


def test_in_bf16_q4_1_layers_take_w4a8_unless_switched_off_and_q8_0_keeps_bf16_activations(
    tiny_files: dict[Q, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel of each int4 copy in bf16: W4A8 for one-plane Q4_1 blocks (int8 activations, docs/kernels.md),
    NativeInt4 for Q8_0's two planes, for float32 and under LLMPLUG_CPU_W4A8=0."""
    def kernels(qtype: Q, dtype: str = "bfloat16") -> set[type]:
        return {type(m.packed) for m in layer_methods(load(tiny_files[qtype], "auto", dtype, True)).values()}

    assert kernels(Q.Q4_1) == {W4A8} and kernels(Q.Q8_0) == {NativeInt4}
    assert kernels(Q.Q4_1, "float32") == {NativeInt4}
    monkeypatch.setenv(W4A8_ENV, "0")
    assert kernels(Q.Q4_1) == {NativeInt4}


def test_none_keeps_every_layer_dense_and_int4_quantizes_a_dense_file(tiny_files: dict[Q, Path]) -> None:
    def int4_layers(path: Path, quantization: str, dtype: str = "bfloat16", invariant: bool = False) -> list:
        methods = layer_methods(load(path, quantization, dtype, invariant)).values()
        return [m for m in methods if isinstance(m, Int4LinearMethod)]

    assert not int4_layers(tiny_files[Q.Q4_1], "none") and not int4_layers(tiny_files[Q.F32], "auto")
    # float32 outside the batch-invariant mode: torch's int4 kernel is far slower than the dense weight, so auto
    # keeps exact int4 files dense; in the mode llmplug's own kernel serves, fast in float32 too
    assert set(map(id, layer_methods(load(tiny_files[Q.Q4_1], "auto")).values())) == {id(DENSE)}
    assert all(isinstance(m.packed, NativeInt4) for m in int4_layers(tiny_files[Q.Q4_1], "auto", "float32", True))
    assert int4_layers(tiny_files[Q.Q4_1], "auto")  # the twin: in bf16 it packs them
    forced = layer_methods(load(tiny_files[Q.F32], "int4"))
    assert all(isinstance(m, Int4LinearMethod) and not m.exact for m in forced.values())


def test_int4_mode_keeps_q8_0_out_of_the_exact_planes(tiny_files: dict[Q, Path]) -> None:
    weights = dict(iter_gguf_weights(str(tiny_files[Q.Q8_0]), torch.float32, False, int4_types=frozenset({Q.Q4_1})))
    assert not any(hasattr(tensor, "int4_groups") for tensor in weights.values())
    methods = layer_methods(load(tiny_files[Q.Q8_0], "int4"))
    assert all(m.packed.num_planes == 1 and not m.exact for m in methods.values())


def test_engine_greedy_output_with_int4_equals_dense_in_fp32(tiny_files: dict[Q, Path]) -> None:
    """In float32 the Q4_1 file's int4 copies (quantization int4: its blocks exactly) are its dense weights."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": [200, 1]}]
    outputs = {}
    for quantization in ("int4", "none"):
        llm = LLM(str(tiny_files[Q.Q4_1]), quantization=quantization, dtype="float32", skip_tokenizer_init=True)
        outputs[quantization] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["int4"] == outputs["none"]


# ---------------------------------------------------------------- the embedded SmolLM2 (Q4_1, Q8_0 embedding)

# "What is the capital of France?" starts its bf16 answer on a near-tie ("The" vs "L'", 0.08 nats apart in float32)
# that any change of rounding flips; these phrasings' first five tokens lead by >= 0.87 nats, dense and int4. Past a
# near-tie of the dense answer (its top two within NEAR_TIE nats: bf16 logits tie exactly at times) the int4 answer
# may take the other branch, so the answers are compared up to the dense answer's first near-tie, at least
# MIN_SAME_TOKENS of them (2026-12-07: all 9 of the first answer's tokens, 5 of the second's, whose sixth is a tie).
CHATS = ["What is the capital city of France? Answer in one sentence.", "Name three primary colors."]
NEAR_TIE = 0.25
MIN_SAME_TOKENS = 5


@pytest.fixture(scope="module")
def smollm2_outputs() -> dict[str, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    outputs = {}
    for quantization in ("auto", "none"):
        llm = LLM(quantization=quantization)  # the platform's dtype: bfloat16 on this CPU
        prompts = [llm.chat_prompt([{"role": "user", "content": chat}]) for chat in CHATS]
        # one prompt at a time: the comparison is about int4 vs dense, not about batching
        results = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
        outputs[quantization] = [list(r.outputs[0].token_ids) for r in results]
        outputs[quantization + " text"] = [r.outputs[0].text for r in results]
        # each step's lead of the greedy token over the runner-up, in nats
        outputs[quantization + " leads"] = [
            [top[0] - top[1] for top in (sorted((lp.logprob for lp in step.values()), reverse=True)
                                         for step in r.outputs[0].logprobs)]
            for r in results
        ]
        # freed before the next engine loads (its reference cycles would keep the model until a collection)
        del llm
        gc.collect()
    return outputs


def test_smollm2_greedy_output_with_int4_equals_dense(smollm2_outputs: dict[str, list]) -> None:
    for auto, none, leads in zip(smollm2_outputs["auto"], smollm2_outputs["none"], smollm2_outputs["none leads"]):
        same = next((i for i, lead in enumerate(leads) if lead < NEAR_TIE), len(none))
        assert same >= MIN_SAME_TOKENS, f"the dense answer reaches a near-tie at token {same}: {leads}"
        assert auto[:same] == none[:same]


def test_smollm2_with_int4_knows_the_capital_of_france(smollm2_outputs: dict[str, list]) -> None:
    assert "Paris" in smollm2_outputs["auto text"][0]


# ---------------------------------------------------------------- the default: int4 decode, dense prompts, invariant

NEEDS_BF16_INT4 = pytest.mark.skipif(not int4_kernel_supported("cpu", torch.bfloat16), reason="no bf16 int4 kernel")
# three prompts, the second and third behind a 12-token shared prefix (prefix-cache hits with block size 4)
PREFIX = [7, 30, 41, 5, 99, 12, 150, 3, 77, 18, 201, 64]
PROMPTS = [[5, 17, 99, 3, 240, 11], PREFIX + [9, 120, 33], PREFIX + [61, 8, 140, 2, 19]]
TOKENS = 10


def detune_int4_copies(llm: LLM) -> None:
    """Scale every int4 copy's weights by 1.125 (its scales and zeros). The native kernel's weights are the file's
    exactly, so in a tiny model int4 and dense rows often round alike; detuned, a token computed with the other
    kernel than its position's shows in its log-probability."""
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    for method in layer_methods(model).values():
        if isinstance(method, Int4LinearMethod):
            for name in ("scales", "zeros", "scales_and_zeros"):  # the native kernel's, or torch's
                if hasattr(method.packed, name):
                    getattr(method.packed, name).mul_(1.125)


def run(path: Path, prompts: list[list[int]], one_at_a_time: bool = False, **engine) -> list[tuple[list, list]]:
    """Each prompt's greedy tokens and their log-probabilities (bf16, block size 4, the default quantization, the
    int4 copies detuned)."""
    kwargs = {"dtype": "bfloat16", "block_size": 4, "skip_tokenizer_init": True, "max_num_seqs": 8, **engine}
    llm = LLM(str(path), **kwargs)
    detune_int4_copies(llm)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    requests = [{"prompt_token_ids": p} for p in prompts]
    batches = [[r] for r in requests] if one_at_a_time else [requests]
    outputs = [o.outputs[0] for batch in batches for o in llm.generate(batch, params, use_tqdm=False)]
    llm.shutdown()
    return [(list(o.token_ids), [step[t].logprob for step, t in zip(o.logprobs, o.token_ids)]) for o in outputs]


@NEEDS_BF16_INT4
def test_by_default_generated_tokens_decode_in_int4_and_prompts_stay_dense(
    tiny_files: dict[Q, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default (quantization auto, batch-invariant mode on): each int4 layer computes the generated tokens with
    its int4 copy and the prompt densely. Its int4 kernel sees one row per decode step of each layer and the LM
    head, never a prompt row; the first token (from the prompt's last row) has the dense engine's
    log-probability bitwise, the later ones the (detuned) int4 copies'."""
    llm = LLM(str(tiny_files[Q.Q4_1]), dtype="bfloat16", skip_tokenizer_init=True)
    assert llm.llm_engine.config.model.batch_invariant is True
    methods = layer_methods(llm.llm_engine.engine_core.executor.worker.model_runner.model)
    assert all(isinstance(m, Int4LinearMethod) and m.rows == "generated" for m in methods.values())
    kernel = type(next(iter(methods.values())).packed)
    llm.shutdown()
    rows_seen: list[int] = []  # each int4 call from Python: its rows
    matmul = kernel.matmul
    monkeypatch.setattr(kernel, "matmul", lambda self, x: rows_seen.append(x.shape[0]) or matmul(self, x))
    stacked: list[int] = []  # each step of generated rows whose layers the C++ stack ran (4 int4 calls a layer)
    stack_run = NativeDecoderStack.run

    def counted(self, hidden, *args):
        out = stack_run(self, hidden, *args)
        generated = current_generated_rows()
        if out is not None and generated is not None and generated.count:  # else a prompt step: dense
            stacked.append(generated.count)
        return out

    monkeypatch.setattr(NativeDecoderStack, "run", counted)
    default = run(tiny_files[Q.Q4_1], PROMPTS, one_at_a_time=True)
    assert stacked and set(rows_seen + stacked) == {1}
    stack_calls = 4 * tiny_llama_config().num_hidden_layers
    # every layer and the LM head at every decode step
    assert len(rows_seen) + stack_calls * len(stacked) == len(PROMPTS) * (TOKENS - 1) * len(methods)
    monkeypatch.undo()
    dense = run(tiny_files[Q.Q4_1], PROMPTS, one_at_a_time=True, quantization="none")
    for (tokens, logprobs), (dense_tokens, dense_logprobs) in zip(default, dense):
        assert tokens[0] == dense_tokens[0] and logprobs[0] == dense_logprobs[0]
    assert all(d[1][1:] != n[1][1:] for d, n in zip(default, dense))  # the (detuned) int4 copies' values


@NEEDS_BF16_INT4
@pytest.mark.parametrize(
    "engine",
    [
        {"max_num_batched_tokens": 8},  # chunked prefills in the steps that decode the others: mixed steps
        {"max_num_batched_tokens": 13, "enable_prefix_caching": True},
        {"num_gpu_blocks_override": 12},  # too few blocks for all three: preempted and recomputed
    ],
    ids=["chunked", "prefix-hits", "preempted"],
)
def test_int4_decode_does_not_depend_on_the_batch_chunks_prefix_hits_or_preemption(
    tiny_files: dict[Q, Path], engine: dict
) -> None:
    """A token's kernel follows from its position (generated: int4; prompt: dense), never from its step: in
    batches, in chunked prefills beside decodes, with prefix hits and after a recompute, every request gets
    bitwise the tokens and log-probabilities it gets alone."""
    alone = run(tiny_files[Q.Q4_1], PROMPTS, one_at_a_time=True, enable_prefix_caching=False)
    assert run(tiny_files[Q.Q4_1], PROMPTS, **engine) == alone


@NEEDS_BF16_INT4
def test_a_later_prompt_never_reuses_the_kv_blocks_int4_decoded(tiny_files: dict[Q, Path]) -> None:
    """A second turn's prompt holds the first turn's answer, whose K/V the first request computed in int4: its
    blocks are named apart (kv_cache.py), so the second prompt computes them densely, as it does alone."""
    first = PROMPTS[0]
    (answer, _), = run(tiny_files[Q.Q4_1], [first], enable_prefix_caching=False)
    second = first + answer + [42, 43]
    expected = run(tiny_files[Q.Q4_1], [second], enable_prefix_caching=False)
    assert run(tiny_files[Q.Q4_1], [first, second], one_at_a_time=True, enable_prefix_caching=True)[1:] == expected
