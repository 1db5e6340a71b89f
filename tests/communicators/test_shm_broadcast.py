"""MessageQueue: one writer and N readers over shared memory, messages larger than a slot included."""

from __future__ import annotations

import hashlib
import multiprocessing
import threading
import time

import pytest

from llmplug.communicators.shm_broadcast import MessageQueue, wait_any
from tests.communicators.ranks import join_or_kill

SLOT_BYTES = 64 * 1024
NUM_MESSAGES = 10_000


def message(i: int) -> tuple[int, bytes]:
    """Message `i`: its index and a payload whose size cycles from a few bytes to 3 slots (every 97th)."""
    size = 3 * SLOT_BYTES + i if i % 97 == 0 else (i * 7919) % 2048
    return i, hashlib.sha256(str(i).encode()).digest() * (size // 32 + 1)


def _reader(handle, reader: int, results) -> None:
    queue = MessageQueue.attach(handle, reader=reader)
    results.put("ready")
    in_order, digest, num_bytes = True, hashlib.sha256(), 0
    for expected in range(NUM_MESSAGES):
        index, payload = queue.dequeue(timeout=60)
        in_order &= index == expected and payload == message(expected)[1]
        digest.update(payload)
        num_bytes += len(payload)
    results.put((reader, in_order, digest.hexdigest(), num_bytes))
    queue.close()


def test_one_writer_three_readers_receive_10000_mixed_messages_in_order():
    context = multiprocessing.get_context("spawn")
    queue = MessageQueue.create(num_readers=3, num_slots=8, slot_bytes=SLOT_BYTES)
    results = context.Queue()
    readers = [context.Process(target=_reader, args=(queue.handle, r, results), daemon=True) for r in range(3)]
    for proc in readers:
        proc.start()
    try:
        assert [results.get(timeout=60) for _ in readers] == ["ready"] * 3  # time the transfer, not the start-up
        expected = hashlib.sha256()
        start = time.perf_counter()
        for i in range(NUM_MESSAGES):
            msg = message(i)
            expected.update(msg[1])
            queue.enqueue(msg, timeout=60)
        got = sorted(results.get(timeout=60) for _ in readers)
        elapsed = time.perf_counter() - start
    finally:
        join_or_kill(readers)
        queue.close()
    num_bytes = got[0][3]
    received = [(reader, ok, digest) for reader, ok, digest, _ in got]
    assert received == [(r, True, expected.hexdigest()) for r in range(3)]
    assert sum(len(message(i)[1]) > SLOT_BYTES for i in range(NUM_MESSAGES)) > 100  # the fallback was used
    print(f"\nMessageQueue 1 writer -> 3 readers: {NUM_MESSAGES / elapsed:,.0f} messages/s, "
          f"{num_bytes / elapsed / 2**20:,.1f} MiB/s per reader ({num_bytes / 2**20:.1f} MiB in {elapsed:.2f} s)")


def test_a_message_of_many_slots_passes_through_a_small_ring():
    queue = MessageQueue.create(num_readers=1, num_slots=2, slot_bytes=1024, reader=0)
    payload = bytes(range(256)) * 100  # 25 slots' worth
    writer = threading.Thread(target=lambda: [queue.enqueue(p, timeout=10) for p in (payload, "after")])
    writer.start()
    try:
        assert queue.dequeue(timeout=10) == payload
        assert queue.dequeue(timeout=10) == "after"
    finally:
        writer.join()
        queue.close()


def test_waiting_ends_with_the_peer_check_or_the_timeout():
    queue = MessageQueue.create(num_readers=1, num_slots=2, slot_bytes=256, reader=0)

    def peer_gone() -> None:
        raise RuntimeError("writer died")

    try:
        with pytest.raises(RuntimeError, match="writer died"):
            queue.dequeue(check_alive=peer_gone)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="waiting for a message"):
            queue.dequeue(timeout=0.3)
        assert time.monotonic() - started < 2
    finally:
        queue.close()


def test_wait_any_names_the_queue_that_has_a_message():
    queues = [MessageQueue.create(num_readers=1, num_slots=2, slot_bytes=256, reader=0) for _ in range(3)]
    try:
        queues[2].enqueue("x")
        assert wait_any(queues, timeout=1) == 2
        assert queues[2].dequeue() == "x"
        with pytest.raises(TimeoutError):
            wait_any(queues, timeout=0.2)
    finally:
        for queue in queues:
            queue.close()
