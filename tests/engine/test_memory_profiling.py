"""KV-cache sizing on platforms that profile memory (GPUs): a dummy step at the engine's limits, its peak
allocation measured, the cache sized from what remains. No GPU here: the arithmetic is checked on its own,
and a real worker runs its real dummy step on the CPU against a platform whose memory queries are scripted."""

from __future__ import annotations

import pytest
import torch

from llmplug.core.config import EngineConfig
from llmplug.engine.memory_profiling import MemoryProfile, kv_cache_bytes
from llmplug.engine.worker import Worker
from llmplug.layers.attention import attention_layers
from llmplug.platforms.cpu import CpuPlatform
from tests.models.tiny_models import make_tiny

GiB, MiB = 2**30, 2**20


def test_kv_cache_gets_the_fraction_less_what_is_in_use_and_the_activation_peak() -> None:
    assert kv_cache_bytes(MemoryProfile(total=80 * GiB, in_use=16 * GiB, peak_activations=4 * GiB), 0.9) == 52 * GiB
    assert kv_cache_bytes(MemoryProfile(total=80 * GiB, in_use=16 * GiB, peak_activations=4 * GiB), 0.5) == 20 * GiB
    # weights and activations above the fraction leave nothing: zero, which the engine reports as an error
    assert kv_cache_bytes(MemoryProfile(total=24 * GiB, in_use=20 * GiB, peak_activations=3 * GiB), 0.9) == 0


class ScriptedGpu(CpuPlatform):
    """The CPU, with the memory answers of a 1 GiB device whose allocation peaks at 1 KiB per token seen by
    the model during the measured interval; records the order of the profiling calls."""

    profiles_memory = True
    events: list = []
    tokens_seen = 0

    @classmethod
    def total_memory(cls, device_id: int = 0) -> int:
        return GiB

    @classmethod
    def available_memory(cls, device_id: int = 0) -> int:
        return GiB - 300 * MiB  # weights, context and whatever else holds memory after the profile

    @classmethod
    def memory_allocated(cls, device_id: int = 0) -> int:
        return 200 * MiB

    @classmethod
    def reset_peak_memory_stats(cls, device_id: int = 0) -> None:
        cls.events.append("reset")
        cls.tokens_seen = 0

    @classmethod
    def peak_memory_allocated(cls, device_id: int = 0) -> int:
        cls.events.append("peak")
        return 200 * MiB + 1024 * cls.tokens_seen


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama_profile"))


def test_worker_sizes_the_cache_from_a_profiled_dummy_step(tiny_llama) -> None:
    config = EngineConfig(
        model={"model": str(tiny_llama.path), "dtype": "float32"},
        scheduler={"max_num_batched_tokens": 96, "max_num_seqs": 4},
    )
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    worker.platform = ScriptedGpu
    ScriptedGpu.events = []
    model = worker.model_runner.model
    seen = []

    def record(module, args):
        input_ids, positions = args[:2]
        caches = [layer.kv_cache for layer in attention_layers(model)]
        seen.append((input_ids.numel(), int(positions.max()), all(c is not None for c in caches)))
        ScriptedGpu.tokens_seen += input_ids.numel()
        ScriptedGpu.events.append("forward")

    handle = model.register_forward_pre_hook(record)
    num_blocks = worker.determine_num_blocks()
    handle.remove()

    assert seen == [(96, 23, True)]  # the whole budget, over 4 requests of 24 tokens, with a cache bound
    assert ScriptedGpu.events == ["reset", "forward", "peak"]
    expected = kv_cache_bytes(MemoryProfile(GiB, 300 * MiB, 96 * 1024), config.cache.memory_fraction)
    assert num_blocks == expected // worker.model_runner.kv_cache_spec().block_bytes
    assert all(layer.kv_cache is None for layer in attention_layers(model))  # the profile's cache is gone
    worker.initialize_cache(8)  # and the real one binds as usual
    assert all(layer.kv_cache is not None for layer in attention_layers(model))


class ScriptedCpuLike(ScriptedGpu):
    """The same device answers on a platform that does not profile."""

    profiles_memory = False


def test_platforms_that_do_not_profile_keep_the_budget_rule(tiny_llama) -> None:
    worker = Worker(EngineConfig(model={"model": str(tiny_llama.path), "dtype": "float32"}))
    worker.init_device()
    worker.load_model()
    worker.platform = ScriptedCpuLike
    ScriptedCpuLike.events = []
    handle = worker.model_runner.model.register_forward_pre_hook(lambda *_: pytest.fail("no dummy step expected"))
    num_blocks = worker.determine_num_blocks()
    handle.remove()
    budget = int(GiB * 0.9) - 300 * MiB  # memory_fraction of the device less what is in use (the weights)
    assert num_blocks == budget // worker.model_runner.kv_cache_spec().block_bytes
    assert ScriptedCpuLike.events == []
