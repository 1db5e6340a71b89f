"""The Ray executor (llmplug/plugins/executors/ray.py; tests/plugins/ holds example packages, so its
tests live here) on a real local Ray cluster that listens on 127.0.0.1 only."""

from __future__ import annotations

import os
import re
import subprocess
import time

import psutil
import pytest

# Before ray is imported: Ray then gives every process it starts the loopback address instead of
# the machine's (read once, at import; inherited by the cluster's processes).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")

from llmplug.core.errors import ConfigError  # noqa: E402
from tests.engine.executors.parity import (  # noqa: E402
    assert_matches,
    generate,
    make_llm,
    make_parallel_tiny,
    reference,
)

# llama: the default bundle of the CPU platform ({"CPU": 1}); qwen2: half a custom "slot" per worker
RESOURCES = {"llama": None, "qwen2": {"llmplug_slot": 0.5}}


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, resources={"llmplug_slot": 2}, include_dashboard=False)
    yield
    ray.shutdown()


LOOPBACK = re.compile(r"^(127\.\d+\.\d+\.\d+|\[::1\]|\[::ffff:127\.\d+\.\d+\.\d+\]):\d+$")


def listening_sockets(pids: set[int]) -> list[tuple[str, str]]:
    """(local address, process) of the TCP sockets that processes `pids` listen on (from `ss -ltnp`)."""
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    return [
        (line.split()[3], line.split()[-1])
        for line in lines
        if any(int(pid) in pids for pid in re.findall(r"pid=(\d+)", line))
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_ray_tp2_greedy_equals_one_rank_and_listens_on_loopback_only(ray_cluster, name, tmp_path):
    tiny = make_parallel_tiny(name, tmp_path)
    expected = reference(tiny)
    llm = make_llm(tiny, tensor_parallel_size=2, distributed_executor_backend="ray",
                   **{"parallel.worker_resources": RESOURCES[name]})
    try:
        assert_matches(generate(llm), expected)
        ours = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}
        sockets = listening_sockets(ours)
        assert len(sockets) > 3  # GCS, raylet, object manager, the workers' gloo pairs ...
        assert [(address, who) for address, who in sockets if not LOOPBACK.match(address)] == []
    finally:
        llm.shutdown()


def test_unsatisfiable_worker_resources_fail_with_what_the_cluster_has(ray_cluster, tmp_path, monkeypatch):
    from llmplug.plugins.executors import ray as ray_executor

    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 1.0)
    tiny = make_parallel_tiny("llama", tmp_path)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"could not reserve 2 bundle\(s\) of \{'GPU': 0.5\}.*llmplug_slot"):
        make_llm(tiny, tensor_parallel_size=2, distributed_executor_backend="ray",
                 **{"parallel.worker_resources": {"GPU": 0.5}})
    assert time.monotonic() - started < 30
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())
