"""The CPU's default KV cache: a quarter of the free memory, at most DEFAULT_KV_CACHE_BYTES, and never more blocks
than max_num_seqs requests of max_model_len tokens (plus an encoder-decoder request's cross blocks) can use;
explicit num_blocks / kv_cache_memory are kept."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.core.config import EngineConfig
from llmplug.engine.worker import Worker
from llmplug.layers.attention import attention_layers
from llmplug.platforms import cpu
from llmplug.platforms.cpu import CpuPlatform
from tests.models.tiny_models import make_tiny

GiB = 2**30
BLOCK_SIZE = 16
MAX_NUM_SEQS, MAX_MODEL_LEN = 3, 40
USEFUL_BLOCKS = MAX_NUM_SEQS * -(-MAX_MODEL_LEN // BLOCK_SIZE)  # 3 requests x 3 blocks
# the tiny Llama in float32: 2 layers x (K and V) x 2 KV heads x head_dim 16 x 16 tokens x 4 bytes
BLOCK_BYTES = 2 * 2 * 2 * 16 * BLOCK_SIZE * 4


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama_kv_sizing"))


@pytest.fixture
def free_memory(monkeypatch: pytest.MonkeyPatch):
    """Set what CpuPlatform.available_memory answers (8 GiB unless a test says otherwise)."""
    answer = {"bytes": 8 * GiB}
    monkeypatch.setattr(CpuPlatform, "available_memory", classmethod(lambda cls, device_id=0: answer["bytes"]))
    return answer


def cpu_worker(path: Path, cache: dict | None = None, max_num_seqs: int = MAX_NUM_SEQS,
               max_model_len: int | None = MAX_MODEL_LEN) -> Worker:
    """A loaded worker whose config went through the CPU platform's defaults, as an engine's does."""
    config = EngineConfig(
        model={"model": str(path), "dtype": "float32", "max_model_len": max_model_len},
        cache={"block_size": BLOCK_SIZE, **(cache or {})}, scheduler={"max_num_seqs": max_num_seqs},
    )
    CpuPlatform.check_and_update_config(config)
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    return worker


def test_the_default_gives_no_more_blocks_than_max_num_seqs_requests_of_max_model_len(
    tiny_llama, free_memory, caplog: pytest.LogCaptureFixture
) -> None:
    worker = cpu_worker(tiny_llama.path)
    assert worker.config.cache.kv_cache_memory == cpu.DEFAULT_KV_CACHE_BYTES  # < 8 GiB / 4: the default bound
    assert worker.model_runner.kv_cache_spec().block_bytes == BLOCK_BYTES
    assert cpu.DEFAULT_KV_CACHE_BYTES // BLOCK_BYTES > USEFUL_BLOCKS  # the budget alone would give far more
    with caplog.at_level(logging.INFO, logger="llmplug.engine.worker"):
        assert worker.determine_num_blocks() == USEFUL_BLOCKS
    assert f"max_num_seqs {MAX_NUM_SEQS} x max_model_len {MAX_MODEL_LEN} = {USEFUL_BLOCKS} blocks under" in caplog.text


def test_an_engine_allocates_only_those_blocks_and_generates_as_transformers_does(tiny_llama, free_memory) -> None:
    llm = LLM(str(tiny_llama.path), dtype="float32", skip_tokenizer_init=True, block_size=BLOCK_SIZE,
              max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    assert llm.llm_engine.engine_core.kv_cache_manager.num_blocks == USEFUL_BLOCKS
    allocated = sum(layer.kv_cache.numel() * layer.kv_cache.element_size() for layer in attention_layers(runner.model))
    assert allocated == USEFUL_BLOCKS * BLOCK_BYTES
    prompts = [[5, 17, 3, 99], [7, 7, 200, 1, 42, 8], [250, 3]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12))
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            expected = tiny_llama.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                                    min_new_tokens=12, do_sample=False, pad_token_id=0)
        assert output.outputs[0].token_ids == expected[0, len(prompt):].tolist()


def test_a_quarter_of_the_free_memory_still_binds_when_smaller(tiny_llama, free_memory, caplog) -> None:
    free_memory["bytes"] = 4 * 5 * BLOCK_BYTES + 3  # a quarter holds 5 blocks, fewer than the 9 requests could use
    with caplog.at_level(logging.INFO, logger="llmplug"):
        worker = cpu_worker(tiny_llama.path)
        assert worker.config.cache.kv_cache_memory == 5 * BLOCK_BYTES
        assert worker.determine_num_blocks() == 5
    assert "KV-cache budget: 0 MiB, a quarter of the 0 MiB free (at most 512 MiB)" in caplog.text
    assert f"= {USEFUL_BLOCKS} blocks (0 MiB) capped by the budget" in caplog.text


def test_the_default_cap_binds_on_a_machine_with_much_free_memory(tiny_llama, free_memory, monkeypatch,
                                                                   caplog) -> None:
    monkeypatch.setattr(cpu, "DEFAULT_KV_CACHE_BYTES", 7 * BLOCK_BYTES)
    with caplog.at_level(logging.INFO, logger="llmplug.platforms.cpu"):
        assert cpu_worker(tiny_llama.path).determine_num_blocks() == 7
    assert "the CPU default (a quarter of the 8192 MiB free is more)" in caplog.text


def test_an_explicit_num_blocks_is_kept_and_free_memory_is_not_asked(tiny_llama, monkeypatch) -> None:
    monkeypatch.setattr(CpuPlatform, "available_memory", classmethod(lambda cls, device_id=0: pytest.fail("asked")))
    worker = cpu_worker(tiny_llama.path, cache={"num_blocks": 5})
    assert (worker.config.cache.num_blocks, worker.config.cache.kv_cache_memory) == (5, None)
    assert worker.determine_num_blocks() == 5


def test_an_explicit_kv_cache_memory_is_kept(tiny_llama, monkeypatch) -> None:
    monkeypatch.setattr(CpuPlatform, "available_memory", classmethod(lambda cls, device_id=0: pytest.fail("asked")))
    worker = cpu_worker(tiny_llama.path, cache={"kv_cache_memory": 6 * BLOCK_BYTES + 100})
    assert worker.config.cache.kv_cache_memory == 6 * BLOCK_BYTES + 100
    assert worker.determine_num_blocks() == 6
    # one larger than the requests can use gives the engine's cap, as it always did
    llm = LLM(str(tiny_llama.path), dtype="float32", skip_tokenizer_init=True, block_size=BLOCK_SIZE,
              max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN, kv_cache_memory=GiB)
    assert llm.llm_engine.engine_core.kv_cache_manager.num_blocks == USEFUL_BLOCKS
    assert llm.llm_engine.config.cache.kv_cache_memory == GiB


def test_an_encoder_decoder_request_counts_its_cross_blocks(tmp_path: Path, free_memory, caplog) -> None:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(vocab_size=64, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=80,
                           max_source_positions=1500, max_target_positions=32, decoder_start_token_id=1, pad_token_id=0,
                           bos_token_id=0, eos_token_id=0,
                           suppress_tokens=None, begin_suppress_tokens=None)
    WhisperForConditionalGeneration(config).save_pretrained(tmp_path)
    worker = cpu_worker(tmp_path, max_num_seqs=2, max_model_len=None)
    with caplog.at_level(logging.INFO, logger="llmplug.engine.worker"):
        # 2 requests x (32 decoder positions: 2 blocks + 1500 encoder states: 94 cross blocks)
        assert worker.determine_num_blocks() == 2 * (2 + 94)
    assert "max_num_seqs 2 x (max_model_len 32 + 1500 encoder tokens) = 192 blocks" in caplog.text
