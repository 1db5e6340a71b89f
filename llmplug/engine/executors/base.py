"""The executor interface the engine core talks to."""

from __future__ import annotations

import abc
from typing import Any

from llmplug.core.config import EngineConfig
from llmplug.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput


class Executor(abc.ABC):
    """Runs the same method on every worker; the driver's result is the engine's."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._init_workers()

    @abc.abstractmethod
    def _init_workers(self) -> None:
        """Start the workers (processes, actors or an in-process object)."""

    @abc.abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        """Call `method` on every worker and return their results in rank order."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on all workers; the first rank's output is the step's result."""
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def determine_num_blocks(self) -> int:
        """The KV blocks every worker can hold."""
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache on every worker."""
        self.collective_rpc("initialize_cache", (num_blocks,))

    def shutdown(self) -> None:
        """Stop the workers and release their resources."""
