"""The scheduler's waiting queues, one per policy: arrival order (fcfs) or priority order (priority)."""

from __future__ import annotations

import heapq
from collections import deque
from typing import Callable, Iterator

from llmplug.engine.request import Request

__all__ = ["FcfsQueue", "PriorityQueue", "SortKey"]

SortKey = tuple


class FcfsQueue:
    """Waiting requests in arrival order; preempted ones go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        """Queue a newly arrived request."""
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        """Queue a preempted request ahead of every other."""
        self._queue.appendleft(request)

    def peek(self) -> Request:
        """The next request to admit."""
        return self._queue[0]

    def pop(self) -> Request:
        """Remove and return the next request to admit."""
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        """Take out an aborted request."""
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Waiting requests by sort key (lower priority value first, then arrival)."""

    def __init__(self, key: Callable[[Request], SortKey]) -> None:
        self._key = key
        self._heap: list[tuple[SortKey, Request]] = []  # keys are unique, so Requests are never compared

    def push(self, request: Request) -> None:
        """Queue a request by its key."""
        heapq.heappush(self._heap, (self._key(request), request))

    # A preempted request's "front" is its own place in priority order.
    push_front = push

    def peek(self) -> Request:
        """The next request to admit."""
        return self._heap[0][1]

    def pop(self) -> Request:
        """Remove and return the next request to admit."""
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        """Take out an aborted request (O(n); aborts are rare)."""
        self._heap = [entry for entry in self._heap if entry[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (request for _, request in self._heap)
