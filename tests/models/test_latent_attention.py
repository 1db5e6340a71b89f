"""Multi-head latent attention in the engine: the KV cache holds one latent per token, sized as such, and a
prefix-cache hit over latent blocks generates what transformers generates. DeepSeek V3 checkpoints with
their multi-token-prediction layer load (the layer dropped, as transformers drops it)."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from llmplug import LLM
from llmplug.core.params import SamplingParams
from llmplug.layers.attention import attention_layers
from llmplug.testing import ParityRunner
from llmplug.testing.parity import BASE_ENGINE_KWARGS

from .cases import CASES

CASE = next(c for c in CASES if c.name == "DeepseekV3ForCausalLM")


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ParityRunner:
    return ParityRunner(tmp_path_factory.mktemp("mla"))


def test_latent_cache_and_a_prefix_hit_match_transformers(runner: ParityRunner) -> None:
    reference, config = runner.reference(CASE), CASE.make_config()
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    llm = LLM(str(runner.checkpoint(CASE).path), **BASE_ENGINE_KWARGS)
    try:
        worker = llm.llm_engine.engine_core.executor.worker
        caches = [layer.kv_cache for layer in attention_layers(worker.model_runner.model)]
        block_size = BASE_ENGINE_KWARGS["block_size"]
        # [1 plane, 1 "head", num_blocks, block_size, kv_lora_rank + rope]: no values, no expanded heads
        assert all(c.shape[:2] == (1, 1) and c.shape[3:] == (block_size, latent) for c in caches)
        spec = worker.model_runner.kv_cache_spec()
        assert spec.block_bytes == config.num_hidden_layers * block_size * latent * 4  # float32
        longest = max(range(len(reference.prompts)), key=lambda i: len(reference.prompts[i]))
        params = SamplingParams(temperature=0.0, max_tokens=CASE.max_new_tokens, ignore_eos=True)
        prompt = {"prompt_token_ids": reference.prompts[longest]}
        for _ in range(2):  # the second run finds the first one's full blocks in the prefix cache
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            assert list(out.outputs[0].token_ids) == reference.tokens[longest]
        stats = llm.llm_engine.engine_core.kv_cache_manager.prefix_cache_stats
        assert stats.hits >= len(reference.prompts[longest]) // block_size * block_size - block_size
    finally:
        llm.shutdown()


def test_a_checkpoint_with_a_multi_token_prediction_layer_loads_without_it(
    runner: ParityRunner, tmp_path_factory: pytest.TempPathFactory
) -> None:
    reference, layers = runner.reference(CASE), CASE.make_config().num_hidden_layers
    path = tmp_path_factory.mktemp("mtp") / "checkpoint"
    shutil.copytree(runner.checkpoint(CASE).path, path)
    last = f"model.layers.{layers - 1}."
    weights = load_file(path / "model.safetensors")
    mtp = {f"model.layers.{layers}." + k[len(last) :]: t.clone() for k, t in weights.items() if k.startswith(last)}
    save_file(mtp | {f"model.layers.{layers}.eh_proj.weight": weights["lm_head.weight"][:4].clone()}, path / "mtp.safetensors")
    llm = LLM(str(path), **BASE_ENGINE_KWARGS)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=CASE.max_new_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in reference.prompts[:2]], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == reference.tokens[:2]
    finally:
        llm.shutdown()
