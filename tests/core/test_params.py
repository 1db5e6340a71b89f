"""SamplingParams refuses values that pass a naive check yet break the step (found by fuzzing the server)."""

from __future__ import annotations

import pytest

from llmplug import SamplingParams
from llmplug.core.errors import InvalidRequestError


@pytest.mark.parametrize("penalty", [5e-324, 1e-30, 0.0099, 100.5, 1e300])
def test_a_repetition_penalty_that_overflows_the_logits_is_refused(penalty):
    with pytest.raises(InvalidRequestError, match=r"repetition_penalty=.* must be in \[0.01, 100\]") as info:
        SamplingParams(repetition_penalty=penalty)
    assert info.value.param == "repetition_penalty"


@pytest.mark.parametrize("penalty", [0.01, 1.0, 1.3, 100.0])
def test_repetition_penalties_in_range_are_accepted(penalty):
    assert SamplingParams(repetition_penalty=penalty).repetition_penalty == penalty
