"""The worker's persistent block tables (engine/block_table.py), updated by the scheduler's per-step diffs."""

from __future__ import annotations

import numpy as np
import pytest

from llmplug.engine.block_table import BlockTable
from llmplug.engine.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput


def test_updates_keep_a_prefix_and_append():
    table = BlockTable(num_rows=1, num_columns=2)
    table.update("a", 0, [4, 5, 6])  # wider than the array: it grows
    table.update("b", 0, [9])  # more requests than rows: it grows
    table.update("a", 3, [7])
    table.update("a", 2, [1])  # a trimmed tail, replaced
    assert table.block_ids("a") == [4, 5, 1] and table.block_ids("b") == [9]
    np.testing.assert_array_equal(table.gather(["b", "a"]), [[9, 0, 0], [4, 5, 1]])
    np.testing.assert_array_equal(table.lengths(["b", "a"]), [1, 3])


def test_a_removed_request_frees_its_row_for_the_next():
    table = BlockTable(num_rows=2)
    table.update("a", 0, [1, 2])
    table.update("b", 0, [3])
    table.remove("a")
    table.remove("missing")  # nothing to drop
    table.update("c", 0, [5])
    assert table.table.shape[0] == 2 and table.block_ids("c") == [5] and set(table.row_of) == {"b", "c"}
    assert table.gather(["c"]).tolist() == [[5]]


def test_keeping_more_blocks_than_held_is_an_error_naming_the_request():
    table = BlockTable()
    table.update("a", 0, [1])
    with pytest.raises(ValueError, match="'a'.*keep 2 blocks.*holds 1"):
        table.update("a", 2, [3])


def test_a_step_without_blocks_gathers_no_columns():
    table = BlockTable()
    table.update("pool", 0, [])
    assert table.gather(["pool"]).shape == (1, 0)


def test_apply_drops_finished_and_preempted_before_updating_the_scheduled():
    table = BlockTable()
    table.update("a", 0, [1, 2])
    table.update("b", 0, [3])
    new = NewRequestData("a", [0], [], None)
    resumed = ScheduledRequest("a", [0, 1], 0, True, new, num_kept_blocks=0, new_block_ids=[7])
    decoding = ScheduledRequest("c", [5], 4, True, None, num_kept_blocks=1, new_block_ids=[])
    trimmed = ScheduledRequest("d", [6], 4, True, None, num_kept_blocks=1, new_block_ids=[])  # drafts rejected
    table.update("c", 0, [8])
    table.update("d", 0, [9, 10])
    table.apply(SchedulerOutput([resumed, decoding, trimmed], 3, finished_req_ids={"b"}, preempted_req_ids={"a"}))
    assert set(table.row_of) == {"a", "c", "d"} and table.block_ids("a") == [7]
    assert table.block_ids("c") == [8] and table.block_ids("d") == [9]
