"""--enable-log-requests: each request's id, prompt (cut to --max-log-len) and sampling params at info level;
off by default, when no prompt reaches the log."""

from __future__ import annotations

import logging

import pytest

from llmplug.entrypoints.openai.api_server import ServerSettings

from .conftest import serve

LOGGER = "llmplug.entrypoints.openai.loggable"
PROMPT = "The secret prompt of a client\nwith a second line"


@pytest.fixture(scope="module")
def logging_server(engine):
    with serve(engine, ServerSettings(enable_log_requests=True, max_log_len=20)) as running:
        yield running


def test_requests_are_logged_with_the_prompt_cut_to_max_log_len(logging_server, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    client = logging_server.client()
    client.completions.create(model=logging_server.model, prompt=PROMPT, max_tokens=2, temperature=0.3)
    records = [r for r in caplog.records if r.name == LOGGER and r.getMessage().startswith("Received request")]
    assert len(records) == 1
    line = records[0].getMessage()
    assert records[0].levelno == logging.INFO
    assert "cmpl-" in line  # the request id
    assert f"prompt: '{PROMPT[:20]}... ({len(PROMPT) - 20} more characters)'" in line
    assert "second line" not in line and "\n" not in line
    assert "temperature=0.3" in line and "max_tokens=2" in line


def test_prompts_stay_out_of_the_log_by_default(server, caplog):
    caplog.set_level(logging.DEBUG)
    server.client().completions.create(model=server.model, prompt=PROMPT, max_tokens=2)
    assert not [r for r in caplog.records if "secret prompt" in r.getMessage()]
    assert not [r for r in caplog.records if r.getMessage().startswith("Received request")]
