"""The external-launcher executor: the engine runs inside processes someone else started.

torchrun (or an RL framework's Ray actors) starts one process per rank and sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Each process builds a whole engine (`LLM(...,
distributed_executor_backend="external_launcher")`) whose one worker, in that process, joins the
world from those variables and the groups of the [outer, DP, PP, TP] layout. The ranks of one model
replica must get the same prompts in the same order: their schedulers then make the same decisions
(the scheduler is deterministic), so their workers stay in step; only each step's output travels,
from the last pipeline stage to the others.
"""

from __future__ import annotations

import os
from typing import Any

from llmplug.communicators.parallel_state import DistributedEnv, get_pp_group, get_world_group
from llmplug.core.errors import ConfigError
from llmplug.engine.executors.base import Executor, WorkerMethod, run_worker_method
from llmplug.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from llmplug.engine.worker import Worker

__all__ = ["ExternalLauncherExecutor"]


class ExternalLauncherExecutor(Executor):
    """One worker in this process, one rank of a world that an outside launcher started."""

    def _init_workers(self) -> None:
        if self.config.kv_transfer_config.kv_connector is not None:
            # each rank's scheduler would index only its own worker's blocks and see only its own failed loads:
            # their decisions could differ, and the ranks leave step
            raise ConfigError(
                "kv_transfer_config.kv_connector cannot be used with the external_launcher executor: every rank "
                "schedules alone and would see only its own worker's blocks; use multiproc or ray"
            )
        self.worker = Worker(self.config, DistributedEnv.from_environ(os.environ), self.registry)
        self.worker.init_device()
        self.worker.load_model()

    @property
    def output_rank(self) -> int:
        """This process's worker: every rank's engine uses its own worker's output."""
        return 0

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step; the last pipeline stage's output goes to every stage, so all schedulers agree."""
        output = self.worker.execute_model(scheduler_output)
        pp = get_pp_group()
        return pp.broadcast_object(output, src=pp.world_size - 1)

    def determine_num_blocks(self) -> int:
        """The fewest KV blocks any rank can hold: every rank's scheduler must plan with the same cache."""
        import torch
        import torch.distributed as dist

        blocks = torch.tensor([self.worker.determine_num_blocks()])
        dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=get_world_group().cpu_group)
        return int(blocks.item())

    def collective_rpc(self, method: WorkerMethod, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Calls this process's worker only (every other rank's engine makes the same call)."""
        return [run_worker_method(self.worker, method, args, kwargs)]

    def shutdown(self) -> None:
        """Leave the process groups."""
        self.worker.shutdown()
