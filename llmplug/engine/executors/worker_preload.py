"""Imported once by the workers' forkserver (worker_start.py): the thread policy of workers that share the cores,
set before torch loads, then torch, transformers and the worker stack, which every forked worker inherits."""

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads(num_processes_sharing=2)  # OMP_WAIT_POLICY=PASSIVE: the workers of an engine share the cores

import llmplug.engine.worker  # noqa: E402,F401  (the import is the point)
