"""Rank layout and process groups: the [outer, DP, PP, TP] layout against an independent computation,
and real gloo groups in spawned processes (the 4-rank, 2-node table and every collective)."""

from __future__ import annotations

import itertools

import pytest
import torch

from llmplug.communicators.cuda import CudaCommunicator
from llmplug.communicators.parallel_state import (
    DistributedEnv,
    destroy_distributed_environment,
    get_pp_group,
    get_tp_group,
    get_world_group,
    init_distributed_environment,
    initialize_model_parallel,
    rank_layout,
)
from llmplug.core.errors import ConfigError
from tests.communicators.ranks import run_ranks


def coordinates(rank: int, tp: int, pp: int, dp: int) -> tuple[int, int, int, int]:
    """(outer, dp, pp, tp) index of `rank` when TP varies fastest, then PP, then DP."""
    rest, t = divmod(rank, tp)
    rest, p = divmod(rest, pp)
    outer, d = divmod(rest, dp)
    return outer, d, p, t


def expected_groups(world: int, tp: int, pp: int, dp: int, axis: int) -> list[list[int]]:
    """Groups of ranks that agree on every coordinate but `axis` (1: DP, 2: PP, 3: TP), ordered along it."""
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for rank in range(world):
        coord = coordinates(rank, tp, pp, dp)
        key = coord[:axis] + coord[axis + 1 :]
        groups.setdefault(key, []).append((coord[axis], rank))
    return sorted([rank for _, rank in sorted(members)] for members in groups.values())


LAYOUTS = [
    (world, tp, pp, dp)
    for world in range(1, 9)
    for tp, pp, dp in itertools.product(range(1, 9), repeat=3)
    if world % (tp * pp * dp) == 0
]


@pytest.mark.parametrize("world,tp,pp,dp", LAYOUTS)
def test_rank_layout_matches_an_independent_computation(world, tp, pp, dp):
    layout = rank_layout(world, tp, pp, dp)
    assert sorted(layout.tp) == expected_groups(world, tp, pp, dp, axis=3)
    assert sorted(layout.pp) == expected_groups(world, tp, pp, dp, axis=2)
    assert sorted(layout.dp) == expected_groups(world, tp, pp, dp, axis=1)


def test_rank_layout_of_eight_ranks_tp2_pp2_dp2_spelled_out():
    layout = rank_layout(8, tp=2, pp=2, dp=2)
    assert layout.tp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.pp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.dp == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_rank_layout_refuses_a_world_that_does_not_divide():
    with pytest.raises(ConfigError, match="world size 6 is not a multiple of tensor_parallel_size 4"):
        rank_layout(6, tp=4, pp=1, dp=1)


def test_distributed_env_from_environ_names_the_missing_variables():
    with pytest.raises(ConfigError, match="RANK, MASTER_PORT"):
        DistributedEnv.from_environ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
    env = DistributedEnv.from_environ(
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    )
    assert env == DistributedEnv(world_size=4, rank=3, local_rank=1, init_method="env://")


def test_groups_before_initialisation_are_this_process_alone():
    tp = get_tp_group()
    assert (tp.world_size, tp.rank_in_group, tp.ranks) == (1, 0, [0])
    x = torch.ones(3)
    assert tp.all_reduce(x) is x and tp.all_gather(x) is x and tp.broadcast_object("a") == "a"
    with pytest.raises(RuntimeError, match="no other rank"):
        get_pp_group().send(x)


# ---- real process groups ---------------------------------------------------------------------------


def _as_list(tensor: torch.Tensor | None) -> list | None:
    return None if tensor is None else tensor.tolist()


def _two_nodes_report() -> dict:
    """In each of 4 ranks: join from the env vars, build TP=2 x PP=2, exercise every collective."""
    init_distributed_environment(DistributedEnv.from_environ())
    initialize_model_parallel(tp=2, pp=2, dp=1)
    tp, pp, world = get_tp_group(), get_pp_group(), get_world_group()
    rank = world.rank
    base = torch.arange(4, dtype=torch.float32) + 10 * rank  # this rank's tensor: [10r, 10r+1, 10r+2, 10r+3]
    report = {
        "rank": rank,
        "local_rank": tp.local_rank,
        "tp_rank": tp.rank_in_group,
        "pp_rank": pp.rank_in_group,
        "tp_ranks": tp.ranks,
        "pp_ranks": pp.ranks,
        "tp_all_reduce": tp.all_reduce(base.clone()).tolist(),
        "tp_all_gather": tp.all_gather(base.view(2, 2), dim=-1).tolist(),
        "tp_reduce_scatter": tp.reduce_scatter(base.clone(), dim=0).tolist(),
        "tp_gather": _as_list(tp.gather(base.view(1, 4), dst=1, dim=0)),
        "tp_broadcast": tp.broadcast(base.clone(), src=1).tolist(),
        "pp_broadcast_object": pp.broadcast_object({"from": rank}, src=1),
    }
    # the NCCL communicator's single-buffer collectives, run here over gloo, must agree with the generic ones
    single_buffer = CudaCommunicator(tp.communicator.device_group, tp.cpu_group, tp.ranks, torch.device("cpu"))
    report["single_buffer_all_gather"] = single_buffer.all_gather(base.view(2, 2), dim=-1).tolist()
    report["single_buffer_reduce_scatter"] = single_buffer.reduce_scatter(base.view(2, 2), dim=1).tolist()
    if pp.is_first_rank:
        pp.send(base)
        pp.send_object(("stage", rank))
    else:
        report["pp_recv"] = pp.recv((4,), torch.float32).tolist()
        report["pp_recv_object"] = pp.recv_object()
    world.barrier()
    destroy_distributed_environment()
    return report


@pytest.mark.slow
def test_four_ranks_on_two_nodes_give_the_documented_table_and_collectives():
    reports = run_ranks(_two_nodes_report, world_size=4, procs_per_node=2)
    # rank, local rank (node = rank // 2), rank in the TP group, rank in the PP group
    table = [(r["rank"], r["local_rank"], r["tp_rank"], r["pp_rank"]) for r in reports]
    assert table == [(0, 0, 0, 0), (1, 1, 1, 0), (2, 0, 0, 1), (3, 1, 1, 1)]
    assert [r["tp_ranks"] for r in reports] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["pp_ranks"] for r in reports] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    tensors = {rank: torch.arange(4, dtype=torch.float32) + 10 * rank for rank in range(4)}
    for r in reports:
        a, b = r["tp_ranks"]
        total = tensors[a] + tensors[b]
        assert r["tp_all_reduce"] == total.tolist()
        assert r["tp_all_gather"] == torch.cat([tensors[a].view(2, 2), tensors[b].view(2, 2)], dim=-1).tolist()
        assert r["tp_reduce_scatter"] == total[2 * r["tp_rank"] : 2 * r["tp_rank"] + 2].tolist()
        assert r["single_buffer_all_gather"] == r["tp_all_gather"]
        assert r["single_buffer_reduce_scatter"] == total.view(2, 2)[:, r["tp_rank"] : r["tp_rank"] + 1].tolist()
        assert r["tp_gather"] == (torch.stack([tensors[a], tensors[b]]).tolist() if r["tp_rank"] == 1 else None)
        assert r["tp_broadcast"] == tensors[b].tolist()
        assert r["pp_broadcast_object"] == {"from": r["pp_ranks"][1]}
        if r["pp_rank"] == 1:
            first_stage = r["pp_ranks"][0]
            assert r["pp_recv"] == tensors[first_stage].tolist()
            assert r["pp_recv_object"] == ("stage", first_stage)
