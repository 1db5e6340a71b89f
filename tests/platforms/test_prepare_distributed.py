"""A platform makes its torch.distributed backend known before the worker joins the world: the TPU platform
imports torch_xla's "xla" backend (not installed here: a clear error), and a platform whose backend exists
only once `prepare_distributed` registers it gets a working world through the real Worker."""

from __future__ import annotations

import datetime
import importlib.util

import pytest
import torch
import torch.distributed as dist

from llmplug.communicators.parallel_state import DistributedEnv, get_tp_group
from llmplug.core.config import EngineConfig
from llmplug.core.errors import ConfigError
from llmplug.engine.executors.base import free_local_port
from llmplug.engine.worker import Worker
from llmplug.platforms.cpu import CpuPlatform
from llmplug.platforms.tpu import TpuPlatform

BACKEND = "llmplug_test_gloo"


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed here")
def test_tpu_needs_torch_xla_for_its_xla_backend_and_says_so() -> None:
    with pytest.raises(ConfigError, match=r"torch_xla.*'xla' distributed backend.*torch_xla\[tpu\]"):
        TpuPlatform.prepare_distributed()


def _gloo(store, rank: int, size: int, timeout: datetime.timedelta):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


class PluginBackendPlatform(CpuPlatform):
    """The CPU, with collectives through a backend that exists only after prepare_distributed registers it."""

    distributed_backend = BACKEND

    @classmethod
    def prepare_distributed(cls) -> None:
        if BACKEND not in dist.Backend.backend_list:
            dist.Backend.register_backend(BACKEND, _gloo, devices=["cpu"])


def test_worker_registers_the_platforms_backend_before_joining_the_world(monkeypatch: pytest.MonkeyPatch) -> None:
    assert BACKEND not in dist.Backend.backend_list
    worker = Worker(EngineConfig(model={"dtype": "float32"}), DistributedEnv(1, 0, 0, f"tcp://127.0.0.1:{free_local_port()}"))
    monkeypatch.setattr("llmplug.platforms.resolve_platform", lambda name, registry: PluginBackendPlatform)
    worker.init_device()
    try:
        assert dist.get_backend() == BACKEND
        tensor = torch.ones(3)
        get_tp_group().all_reduce(tensor)  # a collective over the registered backend
        assert tensor.tolist() == [1.0, 1.0, 1.0]
    finally:
        worker.shutdown()
