"""Where an offload tier keeps block rows (block_io.py), keyed by block hash: host memory, or a directory.

A store only does what it is told: the scheduler role of the connector decides what is saved, loaded and evicted
(offload.py), so every worker's store holds the same hashes. `get` returning None is a failed load (the engine
recomputes); nothing a store returns is ever unchecked bytes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import shutil
import threading
from pathlib import Path

import torch

from llmplug.core.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["CPUBlockStore", "DiskBlockStore", "block_file_name"]

MAGIC = b"LLMPKV1\n"
_HEADER_BYTES = len(MAGIC) + 8 + 32  # magic, payload length, blake2b-256 of the payload
_SUFFIX = ".kv"


def block_file_name(block_hash: int) -> str:
    """The name of a block's file in its fingerprint's directory."""
    return f"{block_hash:032x}{_SUFFIX}"


class CPUBlockStore:
    """Block rows in host memory."""

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}

    def put(self, block_hash: int, row: torch.Tensor) -> None:
        """Keep a row under its hash."""
        self.rows[block_hash] = row

    def get(self, block_hash: int) -> torch.Tensor | None:
        """The row stored under the hash, if any."""
        return self.rows.get(block_hash)

    def delete(self, block_hash: int) -> None:
        """Forget a row."""
        self.rows.pop(block_hash, None)

    def take_failed(self) -> set[int]:
        """Hashes whose put did not store them since the last call (never, in memory)."""
        return set()

    def listing(self) -> list[tuple[int, float]]:
        """(hash, last use) of the rows held: none at start."""
        return []

    def close(self) -> None:
        """Drop every row."""
        self.rows.clear()


class DiskBlockStore:
    """Block rows as files `<hash>.kv` in one directory per fingerprint, written by a background thread.

    A file is written to a temporary name and renamed, so a reader never sees half a block; its header holds the
    payload's length and blake2b digest, checked on every read. A write that finds less free space than the file
    needs is skipped (logged, reported by `take_failed`), so a full disk costs a recompute, never a wrong answer.
    A read refreshes the file's mtime, which orders the tier's LRU across restarts. A `synchronous` store writes in
    `put` itself (a prefill engine's blocks are on disk when its request returns).
    """

    def __init__(self, directory: Path, synchronous: bool = False) -> None:
        self.directory = directory
        self.synchronous = synchronous
        self._pending: dict[int, torch.Tensor] = {}  # written or deleted by the thread soon; readable meanwhile
        self._failed: set[int] = set()
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, int, torch.Tensor | None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="llmplug-kv-disk-writer", daemon=True)
        self._thread.start()

    @staticmethod
    def open(root: str, fingerprint: str, description: str, synchronous: bool = False) -> DiskBlockStore:
        """The store of `fingerprint` under `root` (created); a ConfigError when it cannot be written."""
        directory = Path(root).expanduser() / fingerprint
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".probe.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
            (directory / "fingerprint.txt").write_text(description + "\n")
        except OSError as error:
            raise ConfigError(
                f"kv_transfer_config.kv_offloading_path={root!r}: cannot write block files in {directory}: {error}; "
                "give a writable directory"
            ) from None
        return DiskBlockStore(directory, synchronous)

    def _path(self, block_hash: int) -> Path:
        return self.directory / block_file_name(block_hash)

    def put(self, block_hash: int, row: torch.Tensor) -> None:
        """Write a row in the background (readable at once), or now when synchronous."""
        if self.synchronous:
            self._write(block_hash, row)
            return
        with self._lock:
            self._pending[block_hash] = row
        self._queue.put(("put", block_hash, row))

    def delete(self, block_hash: int) -> None:
        """Remove a row's file, after any write of it queued before."""
        with self._lock:
            self._pending.pop(block_hash, None)
        self._queue.put(("delete", block_hash, None))

    def get(self, block_hash: int) -> torch.Tensor | None:
        """The row under the hash: still pending, or read from its file and checked; None if missing or corrupt."""
        with self._lock:
            row = self._pending.get(block_hash)
        if row is not None:
            return row
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            logger.warning("KV block file %s cannot be read (%s): the block is recomputed", path, error)
            return None
        payload = _check(data)
        if payload is None:
            logger.warning("KV block file %s is corrupt (bad header, length or checksum): the block is recomputed",
                           path)
            return None
        _touch(path)
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    def take_failed(self) -> set[int]:
        """Hashes whose background write failed or was skipped since the last call."""
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    def listing(self) -> list[tuple[int, float]]:
        """(hash, mtime) of every block file in the directory."""
        found = []
        for path in self.directory.glob(f"*{_SUFFIX}"):
            try:
                found.append((int(path.stem, 16), path.stat().st_mtime))
            except (ValueError, OSError):  # not a block file, or gone meanwhile
                continue
        return found

    def close(self) -> None:
        """Finish the queued writes and stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            op, block_hash, row = item
            if op == "put":
                self._write(block_hash, row)
            else:
                self._path(block_hash).unlink(missing_ok=True)

    def _write(self, block_hash: int, row: torch.Tensor) -> None:
        path = self._path(block_hash)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        payload = row.numpy().tobytes()
        try:
            if shutil.disk_usage(self.directory).free < len(payload) + _HEADER_BYTES:
                raise OSError(f"no space left for {len(payload)} bytes")
            with open(tmp, "wb") as f:
                f.write(MAGIC + len(payload).to_bytes(8, "little") + _digest(payload))
                f.write(payload)
            os.replace(tmp, path)
        except OSError as error:
            tmp.unlink(missing_ok=True)
            logger.warning("KV block %032x not saved to %s: %s", block_hash, self.directory, error)
            with self._lock:
                self._failed.add(block_hash)
        with self._lock:
            if self._pending.get(block_hash) is row:
                del self._pending[block_hash]


def _check(data: bytes) -> bytes | None:
    """The payload of a block file, or None when its header, length or checksum is wrong."""
    if len(data) < _HEADER_BYTES or not data.startswith(MAGIC):
        return None
    length = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 8], "little")
    payload, digest = data[_HEADER_BYTES:], data[len(MAGIC) + 8 : _HEADER_BYTES]
    if len(payload) != length or _digest(payload) != digest:
        return None
    return payload


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:  # read-only or removed meanwhile: only the LRU order after a restart suffers
        pass
