"""Data parallelism on Ray (`data_parallel_backend="ray"`): replicas as Ray actors behind one LLM.

One local Ray cluster (loopback only, as tests/engine/executors/test_ray.py starts it) and one DP=2 LLM serve the
module (Ray's start-up and the actors' imports are what cost): its greedy answers equal one engine's, and a
replica whose actor is killed with `ray.kill` fails its own requests only and is started again as a new actor;
replicas that need more CPUs than the cluster has are refused at once.
"""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest

# Before ray is imported: every process of the cluster then takes the loopback address (see test_ray.py).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")

from llmplug import LLM, SamplingParams  # noqa: E402
from llmplug.core.errors import ConfigError  # noqa: E402
from tests.engine.test_data_parallel import KWARGS, token_prompts  # noqa: E402
from tests.models.tiny_models import make_tiny  # noqa: E402

PROMPTS = token_prompts(6, seed=11)
GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("dp_ray_llama"))


@pytest.fixture(scope="module")
def ray_dp_llm(tiny_llama):
    ray.init(num_cpus=2, include_dashboard=False)
    llm = LLM(str(tiny_llama.path), data_parallel_size=2, data_parallel_backend="ray", **KWARGS)
    yield llm
    llm.shutdown()
    ray.shutdown()


def test_ray_replicas_answer_as_one_engine(ray_dp_llm, tiny_llama):
    one = LLM(str(tiny_llama.path), **KWARGS)
    try:
        expected = [list(o.outputs[0].token_ids) for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        one.shutdown()
    outputs = ray_dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    states = ray_dp_llm.llm_engine.replica_states()
    assert all(s.stats["prefix_cache_queries"] > 0 for s in states)  # both replicas served
    # each replica runs in an actor process of the cluster (Ray names the process after the actor's class)
    assert all("RayReplicaActor" in " ".join(psutil.Process(s.pid).cmdline()) for s in states)


def kill_actor_when_running(llm: LLM, index: int) -> threading.Thread:
    """`ray.kill` replica `index`'s actor once it runs a request (a thread: LLM.generate blocks meanwhile)."""
    def kill():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if llm.llm_engine.replica_states()[index].stats.get("num_running", 0) > 0:
                ray.kill(llm.llm_engine.replicas[index].handle.actor)
                return
            time.sleep(0.005)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def test_a_killed_ray_replica_fails_only_its_requests_and_is_restarted(ray_dp_llm):
    killer = kill_actor_when_running(ray_dp_llm, 1)
    outputs = ray_dp_llm.generate(token_prompts(4, seed=12),
                                  SamplingParams(max_tokens=150, temperature=0, ignore_eos=True), use_tqdm=False)
    killer.join()
    failed = [o.outputs[0] for o in outputs if o.outputs[0].error is not None]
    finished = [o.outputs[0] for o in outputs if o.outputs[0].error is None]
    assert failed and finished
    assert all(c.finish_reason == "abort" and "replica 1" in c.error and "ray.kill" in c.error for c in failed)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 150 for c in finished)
    deadline = time.monotonic() + 60
    while (state := ray_dp_llm.llm_engine.replica_states()[1]).status != "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state.status == "running" and state.restarts == 1 and "ray.kill" in state.last_error
    queries_before = state.stats["prefix_cache_queries"]
    outputs = ray_dp_llm.generate(token_prompts(4, seed=13), SamplingParams(max_tokens=3), use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert ray_dp_llm.llm_engine.replica_states()[1].stats["prefix_cache_queries"] > queries_before  # the new actor


def test_replicas_that_cannot_fit_the_cluster_are_refused(ray_dp_llm, tiny_llama):
    with pytest.raises(ConfigError, match=r"2 data-parallel Ray replicas of 2 CPU\(s\) each need 4 CPUs; the Ray "
                                          r"cluster has 2"):
        LLM(str(tiny_llama.path), data_parallel_size=2, data_parallel_backend="ray", **KWARGS,
            **{"device.num_threads": 2})
    assert all(state.status == "running" for state in ray_dp_llm.llm_engine.replica_states())  # left alone
