"""Which CPU cores each data-parallel replica runs on: the allowed cores split evenly, NUMA node by node.

A replica's threads pinned to cores of their own neither migrate nor wait on a thread of another replica that
the OS descheduled (docs/platforms.md, "CPU threading"). On a machine with several NUMA nodes each replica
stays on one node (its memory then stays local): replicas are dealt to the nodes in turn and each node's cores
are split among its replicas; with at least as many nodes as replicas, each replica takes whole nodes. This module reads /sys only; it imports no torch.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

__all__ = ["numa_nodes", "replica_cpus"]

logger = logging.getLogger(__name__)

NODE_ROOT = Path("/sys/devices/system/node")


def parse_cpu_list(text: str) -> set[int]:
    """The cores of a kernel cpulist such as "0-3,8,10-11"."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def numa_nodes(allowed: set[int], root: Path = NODE_ROOT) -> list[list[int]]:
    """The allowed cores of each NUMA node that has some, by node; one group of all of them without /sys."""
    nodes = []
    for node in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = parse_cpu_list((node / "cpulist").read_text()) & allowed
        except (OSError, ValueError):
            continue
        if cpus:
            nodes.append(sorted(cpus))
    return nodes or [sorted(allowed)]


def _split(cpus: list[int], parts: int) -> list[list[int]]:
    """`cpus` cut into `parts` contiguous runs of near-equal length (a core shared when there are fewer)."""
    if len(cpus) < parts:
        return [[cpus[i % len(cpus)]] for i in range(parts)]
    size, extra = divmod(len(cpus), parts)
    runs, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        runs.append(cpus[start:end])
        start = end
    return runs


def replica_cpus(num_replicas: int, allowed: set[int] | None = None, root: Path = NODE_ROOT) -> list[list[int]]:
    """The cores of each of `num_replicas` replicas (default: this process's affinity mask)."""
    if allowed is None:
        allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    nodes = numa_nodes(allowed, root)
    if len(allowed) < num_replicas:
        logger.warning("%d data-parallel replicas share %d cores: their threads will compete", num_replicas,
                       len(allowed))
    if len(nodes) == 1:
        return _split(sorted(allowed), num_replicas)
    if len(nodes) >= num_replicas:  # whole nodes per replica, dealt in turn
        return [sorted(c for node in nodes[i::num_replicas] for c in node) for i in range(num_replicas)]
    per_node = [list(range(i, num_replicas, len(nodes))) for i in range(len(nodes))]  # replicas dealt in turn
    placed: dict[int, list[int]] = {}
    for node_cpus, replicas in zip(nodes, per_node):
        for replica, run in zip(replicas, _split(node_cpus, len(replicas))):
            placed[replica] = run
    return [placed[i] for i in range(num_replicas)]
