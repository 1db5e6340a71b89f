"""The uniproc executor: one worker, in the engine's own process."""

from __future__ import annotations

from typing import Any

from llmplug.engine.executors.base import Executor
from llmplug.engine.worker import Worker


class UniprocExecutor(Executor):
    """Runs a single Worker in this process (no IPC in the hot path)."""

    def _init_workers(self) -> None:
        self.worker = Worker(self.config)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def execute_model(self, scheduler_output):  # noqa: D102 - skip the list round trip in the hot path
        return self.worker.execute_model(scheduler_output)
