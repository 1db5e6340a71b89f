"""The row-count probe (layers/row_invariance.py) catches kernels whose rows depend on how many rows share a call,
and the plan it picks makes them invariant. The kernels here are test doubles that sum in another order for some
row counts or positions, standing in for kernel families this machine may not have (oneDNN's AMX kernels)."""

from __future__ import annotations

import pytest
import torch

from llmplug.layers.row_invariance import RowPlan, cancelling_weight, find_row_plan, order_sensitive_rows

K, N = 64, 32
MAX_ROWS = 257  # the probe's largest count here (the engine's: 1025); the doubles switch below it
WEIGHT = cancelling_weight(N, K)


def forward(x: torch.Tensor) -> torch.Tensor:
    """x W^T with each output summed over K alone, in one order whatever the rows (not `x @ W.T`: MKL's float32
    matmul itself sums in an order that depends on the number of rows)."""
    return (x.unsqueeze(1) * WEIGHT).sum(-1)


def backward(x: torch.Tensor) -> torch.Tensor:
    """The same products summed over K in the other order (different bits on order-sensitive rows)."""
    return (x.flip(-1).unsqueeze(1) * WEIGHT.flip(-1)).sum(-1)


def reversed_above(rows: int):
    """A kernel that sums in the other order when a call has more than `rows` rows (a blocking chosen by M)."""
    return lambda x: backward(x) if x.shape[0] > rows else forward(x)


def reversed_below(rows: int):
    """A kernel that sums in the other order for calls of fewer than `rows` rows (a small-M kernel)."""
    return lambda x: backward(x) if x.shape[0] < rows else forward(x)


def reversed_from_position(position: int):
    """Rows from `position` on in a call are summed in the other order (a kernel whose row blocks differ)."""

    def matmul(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([forward(x[:position]), backward(x[position:])])

    return matmul


def reversed_odd_positions(x: torch.Tensor) -> torch.Tensor:
    """A kernel whose order depends on a row's position in the call: nothing fixes it."""
    out = forward(x)
    out[1::2] = backward(x[1::2])
    return out


def reversed_unless_multiple_of(rows: int):
    """Another order unless the call's row count is a multiple of `rows` (a kernel with an M-tail path)."""
    return lambda x: forward(x) if x.shape[0] % rows == 0 else backward(x)


def test_the_doubles_really_sum_in_another_order() -> None:
    """The probe rows expose the doubles' order change (else every test below would pass vacuously)."""
    x = order_sensitive_rows(8, K, torch.float32)
    assert not torch.equal(forward(x), backward(x))


@pytest.mark.parametrize(
    ("matmul", "expected"),
    [
        (forward, RowPlan()),
        (reversed_below(2), RowPlan(min_rows=2)),  # oneDNN's one-row kernel on AVX-512
        (reversed_below(17), RowPlan(min_rows=17)),
        (reversed_above(40), RowPlan(min_rows=41)),  # pad small calls up to the kernel's larger blocking
        (reversed_above(100), RowPlan(tile=32)),  # too far to pad to: fixed tiles
        (reversed_unless_multiple_of(16), RowPlan(tile=32)),
        (reversed_from_position(8), RowPlan(tile=8)),
        (reversed_from_position(2), None),  # no tile small enough
        (reversed_odd_positions, None),
    ],
    ids=["invariant", "lone-row", "below-17", "above-40", "above-100", "tail-16", "from-8", "from-2", "by-position"],
)
def test_the_probe_finds_the_cheapest_plan_that_holds(matmul, expected) -> None:
    assert find_row_plan(matmul, K, torch.float32, MAX_ROWS) == expected


@pytest.mark.parametrize(
    "matmul",
    [reversed_below(2), reversed_below(17), reversed_above(40), reversed_above(100), reversed_unless_multiple_of(16),
     reversed_from_position(8)],
    ids=["lone-row", "below-17", "above-40", "above-100", "tail-16", "from-8"],
)
def test_the_chosen_plan_gives_every_row_count_the_same_bits(matmul) -> None:
    """Every row, among any 1..200 rows and at any position, gets under the plan the bits it gets alone under the
    plan; without the plan some row does not (the double really depends on the batch)."""
    plan = find_row_plan(matmul, K, torch.float32, MAX_ROWS)
    assert plan is not None
    x = order_sensitive_rows(220, K, torch.float32, seed=7)
    alone = torch.cat([plan(matmul, x[i : i + 1]) for i in range(220)])
    for rows in range(1, 201):
        start = rows % 20
        got = plan(matmul, x[start : start + rows])
        assert torch.equal(got, alone[start : start + rows]), f"{plan}: rows changed among {rows}"
    assert any(not torch.equal(matmul(x[rows % 20 : rows % 20 + rows]), alone[rows % 20 : rows % 20 + rows])
               for rows in range(1, 201))


def test_a_plan_keeps_the_output_shape_for_any_row_count() -> None:
    x = order_sensitive_rows(37, K, torch.float32)
    for plan in (RowPlan(), RowPlan(min_rows=16), RowPlan(tile=8)):
        for rows in (1, 8, 9, 37):
            assert plan(forward, x[:rows]).shape == (rows, N)
