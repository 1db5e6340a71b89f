"""MessageQueue: a shared-memory ring buffer from one writer to N readers on one node.

The multiproc executor broadcasts each step's call (the scheduler output) to its workers through
one, and each worker answers through its own (one reader: the engine). Objects are pickled.

Layout of the shared memory block:

    [slot 0 | slot 1 | ... | slot S-1]  each slot: [header: length, flags][chunk bytes ...]
    [flags of slot 0 | ... ]            per slot: written (1 byte), then one "read" byte per reader

The writer fills slots in order, waiting until every reader has read a slot before reusing it; each
reader reads them in the same order. A payload larger than a slot (the fallback) is split over
consecutive slots, the header marking all but the last chunk "more", so a message of any size
flows through the same ring, in order, with the writer paced by the slowest reader.

Publication order: the writer writes the chunk, clears the read bytes, then sets "written"; a reader
reads the chunk only after it sees "written" with its read byte clear, and sets its read byte when
done. A lock round trip between these steps is the memory fence (as in vLLM's shm_broadcast).

Waiting polls with a growing sleep (a few microseconds at first, at most 0.2 ms during the first
second, then 5 ms) so a waiting process costs almost no CPU, and calls `check_alive` every 0.1 s:
it raises when the peer it waits for has died, so nobody waits forever on a dead process.
"""

from __future__ import annotations

import pickle
import struct
import threading
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, Callable, Sequence

__all__ = ["MessageQueue", "MessageQueueHandle", "wait_any"]

_HEADER = struct.Struct("<QQ")  # chunk length, flags
_MORE = 1  # flag: another chunk of this message follows in the next slot
_fence_lock = threading.Lock()


def _memory_fence() -> None:
    """Order this process's reads and writes of shared memory around the flag updates."""
    _fence_lock.acquire()
    _fence_lock.release()


@dataclass(frozen=True, slots=True)
class MessageQueueHandle:
    """What another process needs to attach to a queue (picklable)."""

    name: str
    num_readers: int
    num_slots: int
    slot_bytes: int


class _Backoff:
    """Sleeps between polls, longer the longer the wait; checks liveness and the deadline every 0.1 s."""

    def __init__(self, timeout: float | None, check_alive: Callable[[], None] | None, what: str) -> None:
        self.start = self.last_check = time.monotonic()
        self.timeout, self.check_alive, self.what = timeout, check_alive, what
        self.polls = 0

    def pause(self) -> None:
        self.polls += 1
        now = time.monotonic()
        if now - self.last_check >= 0.1:
            self.last_check = now
            if self.check_alive is not None:
                self.check_alive()
            if self.timeout is not None and now - self.start > self.timeout:
                raise TimeoutError(f"MessageQueue: {self.what} for more than {self.timeout} s")
        cap = 2e-4 if now - self.start < 1.0 else 5e-3
        time.sleep(min(cap, 1e-6 * 2 ** min(self.polls, 20)))


class MessageQueue:
    """One writer, `num_readers` readers, over a shared-memory ring of `num_slots` slots of `slot_bytes`."""

    def __init__(self, handle: MessageQueueHandle, reader: int | None, create: bool) -> None:
        if reader is not None and not 0 <= reader < handle.num_readers:
            raise ValueError(f"reader {reader} of a MessageQueue with {handle.num_readers} readers")
        self.handle, self.reader, self.owner = handle, reader, create
        self.chunk_bytes = handle.slot_bytes - _HEADER.size
        self.flags_offset = handle.num_slots * handle.slot_bytes
        self.flags_per_slot = 1 + handle.num_readers
        size = self.flags_offset + handle.num_slots * self.flags_per_slot
        if create:
            self.shm = shared_memory.SharedMemory(create=True, size=size)
            self.shm.buf[self.flags_offset : size] = bytes(size - self.flags_offset)
            self.handle = MessageQueueHandle(self.shm.name, handle.num_readers, handle.num_slots, handle.slot_bytes)
        else:
            self.shm = shared_memory.SharedMemory(name=handle.name)
        self.buf = self.shm.buf
        self.write_slot = self.read_slot = 0  # the next slot this process writes, and reads
        self.all_read = b"\x01" * handle.num_readers

    @classmethod
    def create(
        cls, num_readers: int, num_slots: int = 8, slot_bytes: int = 1 << 20, reader: int | None = None
    ) -> "MessageQueue":
        """A new queue (this process owns and finally unlinks it); `reader`: this process's reader index, if any."""
        if num_readers < 1 or num_slots < 2 or slot_bytes <= _HEADER.size:
            raise ValueError(
                f"MessageQueue needs num_readers >= 1, num_slots >= 2, slot_bytes > {_HEADER.size}; got "
                f"{num_readers}, {num_slots}, {slot_bytes}"
            )
        return cls(MessageQueueHandle("", num_readers, num_slots, slot_bytes), reader, create=True)

    @classmethod
    def attach(cls, handle: MessageQueueHandle, reader: int | None = None) -> "MessageQueue":
        """Open an existing queue: as reader `reader`, or (None) as its writer."""
        return cls(handle, reader, create=False)

    # ---- writing ----
    def enqueue(
        self, obj: Any, timeout: float | None = None, check_alive: Callable[[], None] | None = None
    ) -> None:
        """Pickle `obj` and publish it to every reader (over several slots when larger than one)."""
        data = memoryview(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        backoff = _Backoff(timeout, check_alive, "waiting for readers to free a slot")
        for start in range(0, max(len(data), 1), self.chunk_bytes):
            chunk = data[start : start + self.chunk_bytes]
            more = start + self.chunk_bytes < len(data)
            self._write_chunk(chunk, _MORE if more else 0, backoff)

    def _write_chunk(self, chunk: memoryview, flags: int, backoff: _Backoff) -> None:
        written = self._flags(self.write_slot)
        while self.buf[written] and bytes(self.buf[written + 1 : written + self.flags_per_slot]) != self.all_read:
            backoff.pause()
        _memory_fence()
        base = self.write_slot * self.handle.slot_bytes
        _HEADER.pack_into(self.buf, base, len(chunk), flags)
        self.buf[base + _HEADER.size : base + _HEADER.size + len(chunk)] = chunk
        _memory_fence()
        self.buf[written + 1 : written + self.flags_per_slot] = bytes(self.handle.num_readers)
        self.buf[written] = 1
        _memory_fence()
        self.write_slot = (self.write_slot + 1) % self.handle.num_slots

    # ---- reading ----
    def dequeue(self, timeout: float | None = None, check_alive: Callable[[], None] | None = None) -> Any:
        """The next message for this reader, waiting for it (TimeoutError after `timeout` seconds)."""
        if self.reader is None:
            raise RuntimeError("dequeue on the writer's side of a MessageQueue; attach with a reader index")
        backoff = _Backoff(timeout, check_alive, "waiting for a message")
        parts: list[bytes] = []
        while True:
            base, length, flags = self._await_chunk(backoff)
            start = base + _HEADER.size
            if not parts and not flags & _MORE:  # the common case: the message fits one slot
                try:
                    return pickle.loads(self.buf[start : start + length])
                finally:
                    self._release()
            parts.append(bytes(self.buf[start : start + length]))
            self._release()
            if not flags & _MORE:
                return pickle.loads(b"".join(parts))

    def ready(self) -> bool:
        """Whether a message (its first chunk) is waiting for this reader."""
        written = self._flags(self.read_slot)
        return bool(self.buf[written]) and not self.buf[written + 1 + self.reader]

    def _await_chunk(self, backoff: _Backoff) -> tuple[int, int, int]:
        while not self.ready():
            backoff.pause()
        _memory_fence()
        base = self.read_slot * self.handle.slot_bytes
        length, flags = _HEADER.unpack_from(self.buf, base)
        return base, length, flags

    def _release(self) -> None:
        _memory_fence()
        self.buf[self._flags(self.read_slot) + 1 + self.reader] = 1
        self.read_slot = (self.read_slot + 1) % self.handle.num_slots

    def _flags(self, slot: int) -> int:
        return self.flags_offset + slot * self.flags_per_slot

    # ---- lifetime ----
    def close(self) -> None:
        """Detach; the creating process also removes the shared memory block."""
        if self.buf is None:
            return
        self.buf.release()
        self.buf = None
        self.shm.close()
        if self.owner:
            self.shm.unlink()


def wait_any(
    queues: Sequence[MessageQueue], timeout: float | None = None, check_alive: Callable[[], None] | None = None
) -> int:
    """The index of one of `queues` (this process reads them all) that has a message waiting."""
    backoff = _Backoff(timeout, check_alive, "waiting for a message on any queue")
    while True:
        for i, queue in enumerate(queues):
            if queue.ready():
                return i
        backoff.pause()
