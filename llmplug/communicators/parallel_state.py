"""Process groups of tensor, pipeline and data parallelism, as layers and workers see them.

Every rank is one process. The world's ranks form a 4-D grid [outer, DP, PP, TP], TP innermost
(`rank_layout`): rank = ((outer * DP + dp) * PP + pp) * TP + tp. So the ranks of a TP group are
consecutive (on one node when TP fits in it), a PP group steps by TP, a DP group by PP * TP.

Lifecycle, in every worker: `init_distributed_environment` (the world group, from the executor's
arguments or the usual RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT variables), then
`initialize_model_parallel(tp, pp, dp)`, then the model is built: the parallel layers read their rank
and group size from `get_tp_group()`. `destroy_distributed_environment` undoes both.

Before that (the uniproc executor, tests that build layers directly) every getter returns a group of
this one process whose collectives return their input, so layers never special-case one rank.
"""

from __future__ import annotations

import os
import pickle
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Sequence
from urllib.parse import urlsplit

import torch

from llmplug.core.errors import ConfigError

__all__ = [
    "DistributedEnv",
    "GroupCoordinator",
    "RankLayout",
    "destroy_distributed_environment",
    "get_dp_group",
    "get_pp_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "get_world_group",
    "init_distributed_environment",
    "init_model_parallel_group",
    "init_world_group",
    "expert_parallel_enabled",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "rank_layout",
]


# ---- the rank layout (pure) -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankLayout:
    """The groups of every kind: each a list of groups, each group its global ranks in group order."""

    tp: list[list[int]]
    pp: list[list[int]]
    dp: list[list[int]]


def rank_layout(world_size: int, tp: int, pp: int, dp: int) -> RankLayout:
    """The TP, PP and DP groups of `world_size` ranks laid out as [outer, DP, PP, TP]."""
    if min(world_size, tp, pp, dp) < 1 or world_size % (tp * pp * dp):
        raise ConfigError(
            f"world size {world_size} is not a multiple of tensor_parallel_size {tp} x pipeline_parallel_size {pp} "
            f"x data_parallel_size {dp}; start tp * pp * dp ranks (or a multiple of it)"
        )
    grid = torch.arange(world_size).reshape(-1, dp, pp, tp)  # [outer, DP, PP, TP]
    # move the group's axis last; the groups are then the rows, ordered by the other coordinates
    return RankLayout(
        tp=grid.reshape(-1, tp).tolist(),
        pp=grid.permute(0, 1, 3, 2).reshape(-1, pp).tolist(),
        dp=grid.permute(0, 2, 3, 1).reshape(-1, dp).tolist(),
    )


# ---- the group coordinator ------------------------------------------------------------------------------


class GroupCoordinator:
    """One process group seen from one of its ranks: tensors go through its device communicator,
    objects and barriers through its gloo CPU group.

    `rank` is the global rank, `ranks` the group's global ranks in order, `rank_in_group` this
    rank's index in them. A group of one rank (the default before initialisation) has no
    communicator and every collective returns its input.
    """

    def __init__(
        self,
        name: str,
        ranks: Sequence[int],
        rank: int,
        local_rank: int,
        communicator: Any | None = None,
        cpu_group: Any | None = None,
    ) -> None:
        self.name = name
        self.ranks, self.rank, self.local_rank = list(ranks), rank, local_rank
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(rank)
        if self.world_size > 1 and (communicator is None or cpu_group is None):
            raise ValueError(f"group {name!r} of {self.world_size} ranks needs a communicator and a CPU group")
        self.communicator, self.cpu_group = communicator, cpu_group

    @classmethod
    def single(cls, name: str) -> "GroupCoordinator":
        """The group of this one process (rank 0 of 1)."""
        return cls(name, [0], 0, 0)

    # ---- neighbours (pipeline stages) ----
    @property
    def first_rank(self) -> int:
        """Global rank of the group's first member."""
        return self.ranks[0]

    @property
    def last_rank(self) -> int:
        """Global rank of the group's last member."""
        return self.ranks[-1]

    @property
    def is_first_rank(self) -> bool:
        """Whether this rank is the group's first (the first pipeline stage)."""
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        """Whether this rank is the group's last (the last pipeline stage)."""
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next member (wrapping around)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous member (wrapping around)."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    # ---- tensor collectives: the device communicator ----
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum across the group (may reuse the input's storage)."""
        return tensor if self.world_size == 1 else self.communicator.all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's tensor along `dim`."""
        return tensor if self.world_size == 1 else self.communicator.all_gather(tensor, dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Sum across the group and keep this rank's slice along `dim`."""
        return tensor if self.world_size == 1 else self.communicator.reduce_scatter(tensor, dim)

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenate along `dim` on group rank `dst`; None on the others."""
        return tensor if self.world_size == 1 else self.communicator.gather(tensor, dst, dim)

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Send to group rank `dst` (default: the next rank)."""
        self._check_not_single("send")
        self.communicator.send(tensor, self._in_group(dst, +1))

    def recv(self, size: Any, dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        """Receive a tensor of `size` and `dtype` from group rank `src` (default: the previous rank)."""
        self._check_not_single("recv")
        return self.communicator.recv(size, dtype, self._in_group(src, -1))

    # ---- the CPU group: broadcasts, objects, barriers ----
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy group rank `src`'s tensor to every rank: a CPU tensor over the CPU group, else the device's."""
        if self.world_size == 1:
            return tensor
        if tensor.device.type == "cpu":
            import torch.distributed as dist

            dist.broadcast(tensor, src=self.ranks[src], group=self.cpu_group)
            return tensor
        return self.communicator.broadcast(tensor, src)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Group rank `src`'s picklable object, on every rank (the others pass anything)."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank_in_group == src else None]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]

    def send_object(self, obj: Any, dst: int | None = None) -> None:
        """Send a picklable object to group rank `dst` (default: the next rank) over the CPU group."""
        self._check_not_single("send_object")
        import torch.distributed as dist

        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        peer = self.ranks[self._in_group(dst, +1)]
        dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst=peer, group=self.cpu_group)
        dist.send(payload, dst=peer, group=self.cpu_group)

    def recv_object(self, src: int | None = None) -> Any:
        """Receive an object that group rank `src` (default: the previous rank) sent with `send_object`."""
        self._check_not_single("recv_object")
        import torch.distributed as dist

        peer = self.ranks[self._in_group(src, -1)]
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=peer, group=self.cpu_group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(payload, src=peer, group=self.cpu_group)
        return pickle.loads(payload.numpy().tobytes())

    def barrier(self) -> None:
        """Wait for every rank, on the CPU group (never a device barrier)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.cpu_group)

    # ---- helpers ----
    def _in_group(self, index: int | None, step: int) -> int:
        """`index`, or the neighbour `step` away from this rank."""
        return (self.rank_in_group + step) % self.world_size if index is None else index

    def _check_not_single(self, what: str) -> None:
        if self.world_size == 1:
            raise RuntimeError(f"{what} in group {self.name!r} of one rank: there is no other rank")

    def destroy(self) -> None:
        """Forget the process groups (torch.distributed destroys them all in `destroy_distributed_environment`)."""
        self.communicator = self.cpu_group = None

    def __repr__(self) -> str:
        return f"GroupCoordinator({self.name!r}, ranks={self.ranks}, rank={self.rank}, in group={self.rank_in_group})"


# ---- process-wide groups ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DistributedEnv:
    """Where this process sits in the world and how it finds the others."""

    world_size: int
    rank: int
    local_rank: int
    init_method: str  # "tcp://host:port", or "env://" (MASTER_ADDR / MASTER_PORT)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "DistributedEnv":
        """From the variables torchrun sets: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT."""
        missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in environ]
        if missing:
            raise ConfigError(
                f"the external launcher needs the rank variables {', '.join(missing)}, which are not set: start the "
                "processes with torchrun, or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT"
            )
        try:
            values = {name: int(environ[name]) for name in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
            local_rank = int(environ.get("LOCAL_RANK", "0"))
        except ValueError as error:
            raise ConfigError(f"rank variables must be integers: {error}") from None
        return cls(values["WORLD_SIZE"], values["RANK"], local_rank, "env://")


@dataclass(slots=True)
class _World:
    """What groups are built from: the device, the backends and the communicator class."""

    env: DistributedEnv
    device: torch.device
    backend: str
    communicator_cls: type


_WORLD_ENV: _World | None = None
_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None
_DP: GroupCoordinator | None = None
_EXPERT_PARALLEL = False


def init_distributed_environment(
    env: DistributedEnv,
    *,
    backend: str = "gloo",
    device: torch.device | None = None,
    communicator_cls: type | None = None,
    timeout: timedelta = timedelta(minutes=10),
) -> GroupCoordinator:
    """Join the world's process group (torch.distributed) and return the world group.

    `backend` is the device groups' backend (the platform's `distributed_backend`); CPU groups are gloo.
    `communicator_cls` (default: TorchDistributedCommunicator) carries each group's tensor collectives.
    """
    import torch.distributed as dist

    global _WORLD_ENV
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; destroy it first")
    if not 0 <= env.rank < env.world_size:
        raise ConfigError(f"rank {env.rank} is outside the world of {env.world_size} ranks")
    store = _tcp_store(env, timeout)
    rendezvous = {"store": store} if store is not None else {"init_method": env.init_method}
    dist.init_process_group(backend=backend, world_size=env.world_size, rank=env.rank, timeout=timeout, **rendezvous)
    if communicator_cls is None:
        from llmplug.communicators.base import TorchDistributedCommunicator as communicator_cls
    _WORLD_ENV = _World(env, device or torch.device("cpu"), backend, communicator_cls)
    return init_world_group()


def _tcp_store(env: DistributedEnv, timeout: timedelta) -> Any | None:
    """For a tcp://HOST:PORT init method, the rendezvous store, rank 0 serving it on HOST only
    (torch's own listens on every interface); None for other init methods."""
    import torch.distributed as dist

    url = urlsplit(env.init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        return None
    listen_fd = None
    if env.rank == 0:
        family = socket.AF_INET6 if ":" in url.hostname else socket.AF_INET
        listen_fd = socket.create_server((url.hostname, url.port), family=family).detach()  # the store owns it now
    return dist.TCPStore(
        url.hostname, url.port, env.world_size, env.rank == 0, timeout=timeout, master_listen_fd=listen_fd
    )


def init_world_group() -> GroupCoordinator:
    """The group of every rank (built on the default process group)."""
    global _WORLD
    _WORLD = init_model_parallel_group([list(range(_world().env.world_size))], "world")
    return _WORLD


def init_model_parallel_group(group_ranks: Sequence[Sequence[int]], name: str) -> GroupCoordinator:
    """Create every group of `group_ranks` (all ranks must call this with the same list) and return this rank's."""
    import torch.distributed as dist

    world = _world()
    mine: GroupCoordinator | None = None
    for ranks in group_ranks:
        ranks = list(ranks)
        # torch.distributed requires every rank to create every group, in the same order
        device_group = dist.new_group(ranks, backend=world.backend)
        cpu_group = device_group if world.backend == "gloo" else dist.new_group(ranks, backend="gloo")
        if world.env.rank in ranks:
            communicator = world.communicator_cls(device_group, cpu_group, ranks, world.device)
            mine = GroupCoordinator(name, ranks, world.env.rank, world.env.local_rank, communicator, cpu_group)
    if mine is None:
        raise ValueError(f"rank {world.env.rank} is in no {name} group of {[list(r) for r in group_ranks]}")
    return mine


def initialize_model_parallel(tp: int = 1, pp: int = 1, dp: int = 1, expert_parallel: bool = False) -> RankLayout:
    """Build the TP, PP and DP groups of the [outer, DP, PP, TP] layout of the world; returns the layout.

    `expert_parallel`: mixture-of-experts layers built afterwards spread whole experts over the TP group
    (`expert_parallel_enabled`) instead of slicing every expert.
    """
    global _TP, _PP, _DP, _EXPERT_PARALLEL
    _EXPERT_PARALLEL = expert_parallel
    layout = rank_layout(get_world_group().world_size, tp, pp, dp)
    _TP = init_model_parallel_group(layout.tp, "tp")
    _PP = init_model_parallel_group(layout.pp, "pp")
    _DP = init_model_parallel_group(layout.dp, "dp")
    return layout


def expert_parallel_enabled() -> bool:
    """Whether mixture-of-experts layers place whole experts on the TP ranks (ParallelConfig.enable_expert_parallel)."""
    return _EXPERT_PARALLEL


def model_parallel_is_initialized() -> bool:
    """Whether `initialize_model_parallel` ran in this process (and was not destroyed)."""
    return _TP is not None


def destroy_distributed_environment() -> None:
    """Drop the groups and leave torch.distributed (safe to call when nothing was initialised)."""
    import torch.distributed as dist

    global _WORLD_ENV, _WORLD, _TP, _PP, _DP, _EXPERT_PARALLEL
    for group in (_TP, _PP, _DP, _WORLD):
        if group is not None:
            group.destroy()
    _WORLD_ENV = _WORLD = _TP = _PP = _DP = None
    _EXPERT_PARALLEL = False
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _world() -> _World:
    if _WORLD_ENV is None:
        raise RuntimeError("init_distributed_environment() has not run in this process")
    return _WORLD_ENV


_SINGLE = {name: GroupCoordinator.single(name) for name in ("world", "tp", "pp", "dp")}


def get_world_group() -> GroupCoordinator:
    """Every rank of the world (this process alone before initialisation)."""
    return _WORLD or _SINGLE["world"]


def get_tp_group() -> GroupCoordinator:
    """The tensor-parallel group of this process."""
    return _TP or _SINGLE["tp"]


def get_pp_group() -> GroupCoordinator:
    """The pipeline-parallel group of this process (its stages, in order)."""
    return _PP or _SINGLE["pp"]


def get_dp_group() -> GroupCoordinator:
    """The data-parallel group of this process (the same model rank in each replica)."""
    return _DP or _SINGLE["dp"]


def get_tensor_model_parallel_rank() -> int:
    """This process's rank in the tensor-parallel group."""
    return get_tp_group().rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    """Number of ranks in the tensor-parallel group."""
    return get_tp_group().world_size
