"""A client regex whose automaton grows exponentially is refused with a bounded 400 naming the budget, while the
server keeps answering others, and the next good constrained request is served."""

from __future__ import annotations

import re
import time

import openai
import pytest

from .liveness import watching

RUNAWAY = "(a|b)*a(a|b){16}"  # 2^17 states; lm-format-enforcer built it for > 9 minutes on the engine thread


@pytest.mark.parametrize("backend", ["lm_format_enforcer", "outlines"])
def test_a_runaway_regex_gets_a_bounded_400_and_stalls_nothing(server, backend):
    client = server.client(timeout=120)
    with watching(server):
        time.sleep(1.0)  # the watch's first probes, before the request
        start = time.monotonic()
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model=server.model, prompt="x", max_tokens=5,
                                      extra_body={"guided_regex": RUNAWAY, "guided_decoding_backend": backend})
        refused_after = time.monotonic() - start
        time.sleep(2.5)  # one more completion after the refusal
    message = str(error.value)
    assert "guided_compile_timeout_s" in message or "guided_max_states" in message, message
    assert refused_after < 30, f"refused after {refused_after:.1f} s"
    good = client.completions.create(model=server.model, prompt="x", max_tokens=8, temperature=1.0,
                                     extra_body={"guided_regex": "[ab]{3}", "guided_decoding_backend": backend})
    assert re.fullmatch("[ab]{3}", good.choices[0].text)
