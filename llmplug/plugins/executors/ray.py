"""The Ray executor: one Ray actor per rank, in a placement group.

The engine joins the Ray cluster at `parallel.ray_address`, or the one this process already uses,
or starts a local one (and stops it when its last engine shuts down). It reserves one bundle of
`parallel.worker_resources` per worker (default: one of the platform's devices, `{"GPU": 1}`, or
`{"CPU": 1}` on the CPU) and starts each actor in its bundle. Fractions share a device between
engines: `{"GPU": 0.5}` puts two engines on each GPU. Ray gives an actor only the GPUs of its
bundle, so a worker uses the first device it sees whatever its local rank.

A fractional `num_gpus` waits forever on a cluster that declares no GPU: the placement group is
therefore given `PLACEMENT_TIMEOUT_S` and then fails naming what the cluster has. On CPU-only
machines use CPU bundles or custom resources (`ray.init(resources={"slot": 4})`, `{"slot": 0.5}`).

Ranks follow the nodes: the actors on the engine's node first, then node by node, so the ranks of a
tensor-parallel group (consecutive) share a node when they fit; local ranks count within a node.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from llmplug.core.config import EngineConfig
from llmplug.core.errors import ConfigError, EngineDeadError
from llmplug.core.plugins import PluginRegistry
from llmplug.engine.executors.base import Executor, WorkerMethod, check_one_replica, free_local_port, run_worker_method

__all__ = ["RayExecutor", "RayWorkerActor", "worker_resources"]

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0
_ray_users = 0  # live RayExecutors of this process
_ray_started_here = False  # whether an executor started the local cluster (and so stops it)


class RayWorkerActor:
    """A Worker inside a Ray actor process (`ray.remote` wraps this class at start-up)."""

    def __init__(self, config: EngineConfig, registry: PluginRegistry) -> None:
        self.config = config
        self.registry = registry  # a copy of the engine's: the same allow-list and preferences
        self.worker: Any = None

    def placement(self) -> tuple[str, str]:
        """(node id, node IP address) of this actor."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        """A free TCP port on this node (rank 0's: the ranks meet there)."""
        return free_local_port()

    def start(self, rank: int, local_rank: int, world_size: int, init_method: str) -> None:
        """Build this rank's Worker: join the process groups, load the model."""
        from llmplug.communicators.parallel_state import DistributedEnv
        from llmplug.engine.worker import Worker

        env = DistributedEnv(world_size, rank, local_rank, init_method)
        self.worker = Worker(self.config, env, self.registry)
        self.worker.init_device()
        self.worker.load_model()

    def execute(self, method: WorkerMethod, args: tuple, kwargs: dict) -> Any:
        """Run a Worker method (or a function of the worker)."""
        return run_worker_method(self.worker, method, args, kwargs)

    def pid(self) -> int:
        """This actor's process id."""
        import os

        return os.getpid()


def worker_resources(config: EngineConfig, registry: PluginRegistry | None = None) -> dict[str, float]:
    """The Ray resources of one worker's bundle: the configured ones, else one of the platform's devices."""
    if config.parallel.worker_resources:
        return dict(config.parallel.worker_resources)
    from llmplug.platforms import resolve_platform

    return {resolve_platform(config.device.platform, registry).ray_device_key: 1.0}


def _actor_options(resources: dict[str, float]) -> dict[str, Any]:
    """ray.remote options that claim exactly `resources` (CPU and GPU under their own keywords)."""
    custom = {key: value for key, value in resources.items() if key not in ("CPU", "GPU")}
    return {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0), "resources": custom}


def _join_ray(address: str | None) -> None:
    """Connect to the cluster (or start a local one) unless this process already is connected."""
    global _ray_users, _ray_started_here
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False)
        _ray_started_here = address is None
    _ray_users += 1


def _leave_ray() -> None:
    """Stop the local cluster when the last executor that uses the one it started shuts down."""
    global _ray_users, _ray_started_here
    _ray_users -= 1
    if _ray_users == 0 and _ray_started_here and ray.is_initialized():
        ray.shutdown()
        _ray_started_here = False


class RayExecutor(Executor):
    """Workers as Ray actors, one bundle of the placement group each."""

    def _init_workers(self) -> None:
        self.world_size = check_one_replica(self.config.parallel, "ray")
        self.dead: str | None = None
        self.actors: list[Any] = []
        self.placement_group = None
        _join_ray(self.config.parallel.ray_address)
        self._joined = True
        try:
            self._start_actors(worker_resources(self.config, self.registry))
        except BaseException:
            self.shutdown()
            raise

    def _start_actors(self, resources: dict[str, float]) -> None:
        self.placement_group = placement_group([resources] * self.world_size, strategy="PACK")
        self._wait_for_placement(resources)
        actor_cls = ray.remote(RayWorkerActor)
        actors = [
            actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, i), **_actor_options(resources)
            ).remote(self.config, self.registry)
            for i in range(self.world_size)
        ]
        placements = ray.get([actor.placement.remote() for actor in actors])
        here = ray.get_runtime_context().get_node_id()
        order = sorted(range(len(actors)), key=lambda i: (placements[i][0] != here, placements[i][0], i))
        self.actors = [actors[i] for i in order]
        nodes = [placements[i][0] for i in order]
        local_ranks = [nodes[:rank].count(node) for rank, node in enumerate(nodes)]
        init_method = self.config.parallel.distributed_init_method
        if init_method is None:
            init_method = f"tcp://{placements[order[0]][1]}:{ray.get(self.actors[0].free_port.remote())}"
        self._get(
            [
                actor.start.remote(rank, local_ranks[rank], self.world_size, init_method)
                for rank, actor in enumerate(self.actors)
            ],
            "start-up",
        )

    def _wait_for_placement(self, resources: dict[str, float]) -> None:
        try:
            ray.get(self.placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            raise ConfigError(
                f"Ray could not reserve {self.world_size} bundle(s) of {resources} within {PLACEMENT_TIMEOUT_S:.0f} s; "
                f"the cluster has {ray.cluster_resources()} ({ray.available_resources()} free). Set "
                "parallel.worker_resources to resources the cluster declares (fractional GPUs need declared GPUs; "
                "on CPU use CPU or custom resources)."
            ) from None

    def collective_rpc(self, method: WorkerMethod, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        refs = [actor.execute.remote(method, tuple(args), dict(kwargs or {})) for actor in self.actors]
        return self._get(refs, method if isinstance(method, str) else repr(method))

    def _get(self, refs: list, what: str) -> list[Any]:
        """The actors' results; a worker's exception is re-raised as its own type, a dead actor kills the engine."""
        try:
            return ray.get(refs)
        except RayActorError as error:
            self.dead = f"a Ray worker actor died during {what}: {error}; shut the engine down and start a new one"
            raise EngineDeadError(self.dead) from error
        except RayTaskError as error:
            raise error.as_instanceof_cause() from None

    def shutdown(self) -> None:
        """Kill the actors, free the placement group, leave (or stop) the Ray cluster."""
        if not self._joined:
            return
        self._joined = False
        for actor in self.actors:
            ray.kill(actor)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
        self.actors, self.placement_group = [], None
        _leave_ray()
