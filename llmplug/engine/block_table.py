"""The worker's block tables: each running request's KV block ids, kept across steps (a persistent batch).

The scheduler sends each step only what a request's table lacks (`ScheduledRequest.num_kept_blocks` and
`new_block_ids`: usually nothing at decode, one block when a request crosses into a new one, the whole table
when the request is new or resumed), so neither the message nor the input preparation grows with the context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from llmplug.engine.scheduler_output import SchedulerOutput


class BlockTable:
    """One row of block ids per request, in a growable [rows, blocks] array; rows are reused as requests end."""

    def __init__(self, num_rows: int = 8, num_columns: int = 16) -> None:
        self.table = np.zeros((max(num_rows, 1), max(num_columns, 1)), dtype=np.int64)
        self.num_blocks = np.zeros(self.table.shape[0], dtype=np.int64)  # the blocks each row holds
        self.row_of: dict[str, int] = {}  # request id -> its row
        self._free_rows = list(range(self.table.shape[0] - 1, -1, -1))

    def apply(self, scheduler_output: SchedulerOutput) -> None:
        """Bring the tables up to a step: drop those of finished and preempted requests, update the scheduled."""
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.remove(req_id)
        row_of, num_blocks = self.row_of, self.num_blocks
        for req in scheduler_output.requests:
            row = row_of.get(req.req_id)
            # a decode within its last block changes nothing: the common case, kept cheap
            if req.new_block_ids or row is None or req.num_kept_blocks != num_blocks[row]:
                self.update(req.req_id, req.num_kept_blocks, req.new_block_ids)

    def update(self, req_id: str, num_kept_blocks: int, new_block_ids: list[int]) -> None:
        """Keep the first `num_kept_blocks` of the request's table and append `new_block_ids` (a new request:
        0 kept)."""
        row = self.row_of.get(req_id)
        if row is None:
            row = self.row_of[req_id] = self._take_row()
        if num_kept_blocks > self.num_blocks[row]:
            raise ValueError(
                f"request {req_id!r}: asked to keep {num_kept_blocks} blocks of a table that holds "
                f"{int(self.num_blocks[row])}"
            )
        end = num_kept_blocks + len(new_block_ids)
        if end > self.table.shape[1]:
            self._grow(columns=max(end, 2 * self.table.shape[1]))
        self.table[row, num_kept_blocks:end] = new_block_ids
        self.num_blocks[row] = end

    def remove(self, req_id: str) -> None:
        """Drop a finished or preempted request's row (nothing if it has none)."""
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.num_blocks[row] = 0
            self._free_rows.append(row)

    def gather(self, req_ids: list[str]) -> np.ndarray:
        """The tables of `req_ids` in that order, [len(req_ids), longest], zero-padded."""
        rows = np.fromiter(map(self.row_of.__getitem__, req_ids), dtype=np.int64, count=len(req_ids))
        return self.table[rows, : int(self.num_blocks[rows].max(initial=0))]

    def lengths(self, req_ids: list[str]) -> np.ndarray:
        """How many blocks each of `req_ids` holds."""
        return self.num_blocks[[self.row_of[req_id] for req_id in req_ids]]

    def block_ids(self, req_id: str) -> list[int]:
        """One request's table."""
        row = self.row_of[req_id]
        return self.table[row, : self.num_blocks[row]].tolist()

    def _take_row(self) -> int:
        if not self._free_rows:
            num_rows = self.table.shape[0]
            self._grow(rows=2 * num_rows)
            self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        return self._free_rows.pop()

    def _grow(self, rows: int | None = None, columns: int | None = None) -> None:
        old = self.table
        self.table = np.zeros((rows or old.shape[0], columns or old.shape[1]), dtype=np.int64)
        self.table[: old.shape[0], : old.shape[1]] = old
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(self.table.shape[0] - old.shape[0], np.int64)])
