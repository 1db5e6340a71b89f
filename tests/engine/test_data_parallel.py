"""Data parallelism: replicas in processes of their own behind one LLM, the load balancer and core placement.

One DP=2 LLM serves the whole module (starting replica processes is what costs): its greedy answers equal
DP=1's, in the order of the prompts; a conversation's turns go back to the replica that holds its prefix; a
replica killed mid-generation, or one that hangs (SIGSTOP) past the iteration timeout, fails its own requests only
and is started again.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.core.errors import InvalidRequestError
from llmplug.engine.dp_balancer import LoadBalancer, prefix_keys
from llmplug.engine.dp_placement import replica_cpus
from llmplug.engine.data_parallel import merge_stats
from llmplug.engine.step_histogram import StepHistogramSnapshot
from tests.models.tiny_models import make_tiny

BLOCK = 4
KWARGS = {"dtype": "float32", "skip_tokenizer_init": True, "block_size": BLOCK, "max_model_len": 256}


# --- placement, balancing and stats: no processes -------------------------------------------------


def fake_nodes(root, *cpulists: str):
    """A /sys/devices/system/node look-alike with one node per cpulist."""
    for i, cpus in enumerate(cpulists):
        (root / f"node{i}").mkdir(parents=True)
        (root / f"node{i}" / "cpulist").write_text(cpus + "\n")
    return root


def test_cores_are_split_evenly_and_replicas_stay_on_one_numa_node(tmp_path):
    one_node = fake_nodes(tmp_path / "one", "0-7")
    assert replica_cpus(3, set(range(8)), one_node) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    two_nodes = fake_nodes(tmp_path / "two", "0-3", "4-7")
    # replicas are dealt to the nodes in turn; each node's cores split among its replicas
    assert replica_cpus(4, set(range(8)), two_nodes) == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert replica_cpus(2, set(range(8)), two_nodes) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replica_cpus(1, {1, 2, 5}, two_nodes) == [[1, 2, 5]]  # more nodes than replicas: whole nodes
    assert replica_cpus(3, {0, 1}, one_node) == [[0], [1], [0]]  # fewer cores than replicas: shared


def test_balancer_follows_the_longest_prefix_unless_its_replica_is_much_busier():
    balancer = LoadBalancer(2, max_imbalance=2)
    first = prefix_keys(list(range(12)), BLOCK)
    assert len(first) == 3 and prefix_keys(list(range(15)), BLOCK) == first  # whole blocks only
    balancer.record(first, 1)
    longer = prefix_keys(list(range(20)), BLOCK)  # the same conversation, one turn later
    assert balancer.choose(longer, [0, 0], [True, True]) == 1
    assert balancer.choose(longer, [0, 2], [True, True]) == 1  # busier, within the allowed imbalance
    assert balancer.choose(longer, [0, 3], [True, True]) == 0  # much busier: the least busy one
    assert balancer.choose(longer, [5, 0], [True, False]) == 0  # its replica is not serving
    assert (balancer.affinity_lookups, balancer.affinity_hits) == (3, 2)
    balancer.forget(1)
    assert balancer.choose(longer, [1, 0], [True, True]) == 1  # no holder any more: least busy
    with pytest.raises(ValueError, match="no replica"):
        balancer.choose(longer, [0, 0], [False, False])


def test_a_prefix_every_replica_holds_pulls_no_request():
    balancer = LoadBalancer(2)
    system = list(range(8))  # two blocks of a shared system prompt, served by both replicas
    balancer.record(prefix_keys(system, BLOCK), 0)
    balancer.record(prefix_keys(system, BLOCK), 1)
    balancer.record(prefix_keys(system + [50] * 8, BLOCK), 0)  # a conversation on replica 0
    assert balancer.choose(prefix_keys(system + [60] * 8, BLOCK), [3, 1], [True, True]) == 1  # a new one: by load
    assert balancer.choose(prefix_keys(system + [50] * 12, BLOCK), [3, 1], [True, True]) == 0  # its next turn


def test_round_robin_and_least_loaded_ignore_prefixes():
    keys = prefix_keys(list(range(8)), BLOCK)
    robin = LoadBalancer(3, routing="round_robin")
    robin.record(keys, 2)
    assert [robin.choose(keys, [0, 9, 9], [True] * 3) for _ in range(4)] == [0, 1, 2, 0]
    least = LoadBalancer(3, routing="least_loaded")
    least.record(keys, 2)
    assert least.choose(keys, [3, 1, 2], [True] * 3) == 1


def test_replica_stats_merge_as_one_engine():
    hist = lambda *counts: StepHistogramSnapshot((1, 8), counts, sum(counts), sum(counts))  # noqa: E731
    merged = merge_stats([
        {"num_running": 2, "kv_cache_usage": 0.5, "prefix_cache_hit_rate": 1.0, "prefix_cache_queries": 10,
         "prefix_cache_hits": 10, "iteration_tokens": hist(1, 2, 0), "running_lora_adapters": ["a"]},
        {"num_running": 1, "kv_cache_usage": 0.1, "prefix_cache_hit_rate": 0.0, "prefix_cache_queries": 30,
         "prefix_cache_hits": 0, "iteration_tokens": hist(0, 1, 1), "running_lora_adapters": ["b", "a"]},
    ])
    assert merged["num_running"] == 3 and merged["kv_cache_usage"] == pytest.approx(0.3)
    assert merged["prefix_cache_hit_rate"] == pytest.approx(10 / 40)
    assert merged["iteration_tokens"].counts == (1, 3, 1) and merged["running_lora_adapters"] == ["a", "b"]


# --- one DP=2 LLM for the module ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("dp_llama"))


HANG_TIMEOUT_S = 4.0  # parallel.engine_iteration_timeout_s of the module's DP=2 LLM


@pytest.fixture(scope="module")
def dp_llm(tiny_llama):
    llm = LLM(str(tiny_llama.path), data_parallel_size=2, **KWARGS,
              **{"parallel.engine_iteration_timeout_s": HANG_TIMEOUT_S})
    yield llm
    llm.shutdown()


def token_prompts(n: int, seed: int, length: int = 10) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(1, 250, (length + i % 5,), generator=g).tolist()} for i in range(n)]


def replica_stat(llm: LLM, key: str) -> list[int]:
    return [state.stats.get(key, 0) for state in llm.llm_engine.replica_states()]


PROMPTS = token_prompts(10, seed=1)
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def one_engine_tokens(tiny_llama) -> list[list[int]]:
    """What one engine (DP=1) answers to PROMPTS."""
    one = LLM(str(tiny_llama.path), **KWARGS)
    try:
        return [list(o.outputs[0].token_ids) for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        one.shutdown()


def test_greedy_answers_equal_one_engine_in_the_order_of_the_prompts(dp_llm, one_engine_tokens):
    queries_before = replica_stat(dp_llm, "prefix_cache_queries")
    outputs = dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    queries_after = replica_stat(dp_llm, "prefix_cache_queries")
    assert [o.prompt_token_ids for o in outputs] == [p["prompt_token_ids"] for p in PROMPTS]
    assert [list(o.outputs[0].token_ids) for o in outputs] == one_engine_tokens
    assert all(after > before for before, after in zip(queries_before, queries_after))  # both replicas served


@pytest.mark.slow
def test_each_replica_may_be_tensor_parallel(tiny_llama, one_engine_tokens):
    llm = LLM(str(tiny_llama.path), data_parallel_size=2, tensor_parallel_size=2, **KWARGS)
    try:
        assert llm.config.parallel.executor == "multiproc"
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == one_engine_tokens
        assert all(state.pid is not None for state in llm.llm_engine.replica_states())
    finally:
        llm.shutdown()


def test_a_bad_prompt_is_refused_before_it_reaches_a_replica(dp_llm):
    with pytest.raises(InvalidRequestError, match="vocab"):
        dp_llm.generate([{"prompt_token_ids": [1, 10**6]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not dp_llm.llm_engine.has_unfinished_requests()


def test_each_conversation_returns_to_the_replica_that_holds_its_prefix(dp_llm):
    conversations = [p["prompt_token_ids"] for p in token_prompts(4, seed=2, length=12)]
    params = SamplingParams(max_tokens=4, temperature=0)
    for turn in range(2):
        hits_before = sum(replica_stat(dp_llm, "prefix_cache_hits"))
        order = list(range(4)) if turn == 0 else [3, 1, 2, 0]  # a new order: load alone would mix them up
        outputs = dp_llm.generate([{"prompt_token_ids": conversations[i]} for i in order], params, use_tqdm=False)
        for i, out in zip(order, outputs):
            conversations[i] = conversations[i] + list(out.outputs[0].token_ids) + [7, 8, 9, 10]
    # every second turn found at least its first turn's whole blocks (12 tokens) cached on its replica
    assert sum(replica_stat(dp_llm, "prefix_cache_hits")) - hits_before >= 4 * 12
    assert dp_llm.llm_engine.balancer.affinity_hits >= 4


def test_engine_calls_reach_every_replica(dp_llm, tiny_llama, one_engine_tokens):
    assert dp_llm.is_sleeping() is False
    weights = {name: torch.zeros_like(t) for name, t in tiny_llama.hf_model.state_dict().items()}
    dp_llm.update_weights(weights.items())  # zero weights: every replica answers alike, and not as before
    zeroed = [list(o.outputs[0].token_ids) for o in dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert zeroed != one_engine_tokens and len({tuple(t) for t in zeroed}) == 1
    dp_llm.update_weights(tiny_llama.hf_model.state_dict().items())
    dp_llm.reset_prefix_cache()
    assert [list(o.outputs[0].token_ids) for o in dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == \
        one_engine_tokens


def kill_when_running(llm: LLM, index: int, signum: int = signal.SIGKILL) -> threading.Thread:
    """Send `signum` to replica `index` once it runs a request (a thread: LLM.generate blocks meanwhile)."""
    def kill():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            state = llm.llm_engine.replica_states()[index]
            if state.stats.get("num_running", 0) > 0:
                os.kill(state.pid, signum)
                return
            time.sleep(0.005)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def wait_running(llm: LLM, index: int):
    """Replica `index`'s state once it serves again (or after 60 s)."""
    deadline = time.monotonic() + 60
    while (state := llm.llm_engine.replica_states()[index]).status != "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    return state


def test_a_killed_replica_fails_only_its_requests_and_is_restarted(dp_llm):
    killer = kill_when_running(dp_llm, 1)
    outputs = dp_llm.generate(token_prompts(6, seed=3), SamplingParams(max_tokens=150, temperature=0, ignore_eos=True),
                              use_tqdm=False)
    killer.join()
    failed = [o for o in outputs if o.outputs[0].error is not None]
    finished = [o for o in outputs if o.outputs[0].error is None]
    assert failed and finished
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in failed)
    assert all("replica 1" in o.outputs[0].error and "SIGKILL" in o.outputs[0].error for o in failed)
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 150 for o in finished)
    state = wait_running(dp_llm, 1)
    assert state.status == "running" and state.restarts == 1 and "SIGKILL" in state.last_error
    queries_before = replica_stat(dp_llm, "prefix_cache_queries")[1]
    outputs = dp_llm.generate(token_prompts(4, seed=4), SamplingParams(max_tokens=3), use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert replica_stat(dp_llm, "prefix_cache_queries")[1] > queries_before  # the new process serves


def test_a_hung_replica_is_declared_dead_its_requests_fail_and_it_is_restarted(dp_llm):
    stopper = kill_when_running(dp_llm, 0, signal.SIGSTOP)  # alive, but it makes no progress any more
    started = time.monotonic()
    outputs = dp_llm.generate(token_prompts(6, seed=5), SamplingParams(max_tokens=150, temperature=0, ignore_eos=True),
                              use_tqdm=False)
    stopper.join()
    failed = [o.outputs[0] for o in outputs if o.outputs[0].error is not None]
    finished = [o.outputs[0] for o in outputs if o.outputs[0].error is None]
    assert failed and finished and time.monotonic() - started >= HANG_TIMEOUT_S
    assert all(c.finish_reason == "abort" and "replica 0" in c.error and "no progress" in c.error
               and "engine_iteration_timeout_s" in c.error for c in failed)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 150 for c in finished)
    state = wait_running(dp_llm, 0)
    assert state.status == "running" and state.restarts == 1 and "hung" in state.last_error
    outputs = dp_llm.generate(token_prompts(4, seed=6), SamplingParams(max_tokens=3), use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
