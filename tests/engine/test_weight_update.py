"""Weight updates and sleep mode of a running engine (RL), checked against HF transformers on the same weights.

Two tiny Llamas from different seeds: an engine started on A that is given B's weights must generate
exactly what transformers generates with B.
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
import torch

from llmplug import LLM, AsyncLLM, SamplingParams
from llmplug.core.errors import EngineStateError, ModelLoadError
from llmplug.engine.weight_update import weight_batches
from llmplug.layers.attention import attention_layers
from llmplug.layers.quantization import DENSE, Int4LinearMethod, int4_kernel_supported
from tests.engine.test_llm import generate_ids, hf_greedy, make_llm, prompts
from tests.models.tiny_models import make_tiny

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
BATCH = prompts(0, (3, 13, 6))


@pytest.fixture(scope="module")
def model_a(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama_a"), seed=0)


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama_b"), seed=1)


def hf_outputs(tiny, batch=BATCH) -> list[list[int]]:
    return [hf_greedy(tiny.hf_model, p, MAX_TOKENS) for p in batch]


def weights_of(tiny):
    """The HF checkpoint names and tensors of a transformers model, as a trainer would send them."""
    return tiny.hf_model.state_dict().items()


def model_of(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.engine_core.executor.worker.model_runner.model


def test_update_weights_makes_the_running_engine_generate_like_the_new_model(model_a, model_b):
    llm = make_llm(model_a)
    expected_a, expected_b = hf_outputs(model_a), hf_outputs(model_b)
    assert expected_a != expected_b  # the two models really differ
    assert generate_ids(llm, BATCH, GREEDY) == expected_a
    llm.update_weights(weights_of(model_b))
    assert generate_ids(llm, BATCH, GREEDY) == expected_b


def test_prefix_cached_before_an_update_is_never_hit_after_it(model_a, model_b):
    llm = make_llm(model_a)
    prompt = prompts(3, (14,))  # three full blocks of 4 tokens
    generate_ids(llm, prompt, GREEDY)
    [again] = llm.generate([{"prompt_token_ids": prompt[0]}], GREEDY, use_tqdm=False)
    assert again.num_cached_tokens == 12  # the cache works for the old weights
    llm.update_weights(weights_of(model_b))
    [after] = llm.generate([{"prompt_token_ids": prompt[0]}], GREEDY, use_tqdm=False)
    assert after.num_cached_tokens == 0
    assert list(after.outputs[0].token_ids) == hf_outputs(model_b, prompt)[0]


def test_a_partial_update_goes_through_the_fused_shard_of_the_parameter(model_a, model_b):
    llm = make_llm(model_a)
    qkv = model_of(llm).model.layers[0].self_attn.qkv_proj
    before = qkv.weight.detach().clone()
    new_k = model_b.hf_model.model.layers[0].self_attn.k_proj.weight
    llm.update_weights([("model.layers.0.self_attn.k_proj.weight", new_k)])
    q_size, kv_size = qkv.q_size, qkv.kv_size
    assert torch.equal(qkv.weight[q_size : q_size + kv_size], new_k)
    assert torch.equal(qkv.weight[:q_size], before[:q_size])
    assert torch.equal(qkv.weight[q_size + kv_size :], before[q_size + kv_size :])


def test_bad_names_shapes_and_pairs_are_refused_naming_what_was_wrong(model_a):
    llm = make_llm(model_a)
    with pytest.raises(ModelLoadError, match=r"update_weights.*model\.layers\.0\.self_attn\.q_proj\.weight.*shape"):
        llm.update_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3))])
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.no_such_proj\.weight"):
        llm.update_weights([("model.layers.0.mlp.no_such_proj.weight", torch.zeros(3))])
    with pytest.raises(TypeError, match=r"\(name: str, tensor: torch.Tensor\) pairs.*got \('str', 'list'\)"):
        llm.update_weights([("model.norm.weight", [1.0, 2.0])])
    with pytest.raises(TypeError, match=r"state_dict\(\)\.items\(\); got str"):
        llm.update_weights(model_of(llm).state_dict())  # a dict iterates over its names only


def test_weight_batches_close_at_the_byte_budget_and_keep_every_pair_in_order():
    pairs = [(f"w{i}", torch.zeros(i + 1, dtype=torch.float32)) for i in range(6)]  # 4, 8, ..., 24 bytes
    batches = list(weight_batches(pairs, max_bytes=20))
    assert [[name for name, _ in batch] for batch in batches] == [["w0", "w1", "w2"], ["w3", "w4"], ["w5"]]


def test_requests_and_sleep_exclude_each_other_with_clear_errors(model_a, model_b):
    llm = make_llm(model_a)
    request_id = llm.add_request({"prompt_token_ids": [1, 2, 3]}, GREEDY)
    with pytest.raises(EngineStateError, match="while requests are running.*abort"):
        llm.update_weights(weights_of(model_b))
    with pytest.raises(EngineStateError, match="cannot sleep while requests are running"):
        llm.sleep()
    llm.abort(request_id)
    with pytest.raises(ValueError, match="sleep level must be 1"):
        llm.sleep(level=3)
    llm.sleep()
    with pytest.raises(EngineStateError, match=r"asleep.*wake_up\(\)"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, use_tqdm=False)
    with pytest.raises(EngineStateError, match="weights are asleep"):
        llm.update_weights(weights_of(model_b))
    with pytest.raises(ValueError, match=r"unknown wake_up tags \['weight'\]"):
        llm.wake_up(["weight"])
    llm.wake_up()
    assert not llm.is_sleeping()
    assert generate_ids(llm, BATCH, GREEDY) == hf_outputs(model_a)


def test_sleep_frees_the_kv_cache_and_wake_up_gives_identical_outputs(model_a):
    llm = make_llm(model_a)
    before = generate_ids(llm, BATCH, GREEDY)
    layers = attention_layers(model_of(llm))
    shapes = [layer.kv_cache.shape for layer in layers]
    caches = [weakref.ref(layer.kv_cache) for layer in layers]
    llm.sleep(level=1)
    gc.collect()
    assert llm.is_sleeping()
    assert all(layer.kv_cache is None for layer in layers)
    assert all(cache() is None for cache in caches)  # nothing else kept the tensors alive
    llm.wake_up()
    assert [layer.kv_cache.shape for layer in layers] == shapes
    assert generate_ids(llm, BATCH, GREEDY) == before


def test_level_2_discards_the_weights_and_an_update_after_waking_them_restores_a_model(model_a, model_b):
    llm = make_llm(model_a)
    llm.sleep(level=2)
    assert all(param.untyped_storage().nbytes() == 0 for param in model_of(llm).parameters())
    llm.wake_up(tags=["weights"])
    llm.update_weights(weights_of(model_b))
    llm.wake_up(tags=["kv_cache"])
    assert generate_ids(llm, BATCH, GREEDY) == hf_outputs(model_b)


@pytest.mark.parametrize("sleep_level", [None, 2])
def test_bf16_packed_weights_follow_an_update(model_a, model_b, sleep_level):
    """bf16 layers compute with oneDNN-packed copies of their weights: an update must replace those too."""
    llm = make_llm(model_a, dtype="bfloat16")
    if sleep_level is not None:
        llm.sleep(level=sleep_level)
        methods = [m.quant_method for m in model_of(llm).modules() if hasattr(m, "quant_method")]
        assert all(method is DENSE for method in methods)  # the packed copies were freed with the weights
        llm.wake_up(tags=["weights"])
    llm.update_weights(weights_of(model_b))
    if sleep_level is not None:
        llm.wake_up(tags=["kv_cache"])
    fresh = make_llm(model_b, dtype="bfloat16")
    assert generate_ids(llm, BATCH, GREEDY) == generate_ids(fresh, BATCH, GREEDY)


def test_an_update_redoes_the_int4_copies_of_the_changed_layers_only(model_a, model_b):
    if not int4_kernel_supported("cpu", torch.float32):
        pytest.skip("torch's int4 weight-only kernel is not available here")
    llm = make_llm(model_a, quantization="int4")
    layers = model_of(llm).model.layers
    kept, redone = layers[1].mlp.down_proj.quant_method, layers[0].mlp.down_proj.quant_method
    last = "model.layers.1.mlp.down_proj.weight"
    llm.update_weights([(name, t) for name, t in weights_of(model_b) if name != last])
    assert layers[1].mlp.down_proj.quant_method is kept
    assert isinstance(layers[0].mlp.down_proj.quant_method, Int4LinearMethod)
    assert layers[0].mlp.down_proj.quant_method is not redone
    llm.update_weights([(name, t) for name, t in weights_of(model_b) if name == last])
    fresh = make_llm(model_b, quantization="int4")
    assert generate_ids(llm, BATCH, GREEDY) == generate_ids(fresh, BATCH, GREEDY)


def test_async_llm_updates_weights_and_sleeps_between_requests(model_a, model_b):
    engine = AsyncLLM(str(model_a.path), dtype="float32", skip_tokenizer_init=True, block_size=4)
    prompt = {"prompt_token_ids": BATCH[1]}

    async def tokens(request_id: str) -> list[int]:
        return [list(out.outputs[0].token_ids) async for out in engine.generate(prompt, GREEDY, request_id)][-1]

    async def run() -> None:
        assert await tokens("a") == hf_outputs(model_a)[1]
        await engine.update_weights(weights_of(model_b))
        assert await tokens("b") == hf_outputs(model_b)[1]
        await engine.sleep()
        assert await engine.is_sleeping()
        with pytest.raises(EngineStateError, match="asleep"):
            await tokens("refused")
        await engine.wake_up()
        assert await tokens("b-again") == hf_outputs(model_b)[1]

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
