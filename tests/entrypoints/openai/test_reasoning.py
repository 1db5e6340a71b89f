"""--reasoning-parser through the real openai client: reasoning_content apart from content, streamed too,
and structured output that constrains the answer after the reasoning, never the reasoning.

The tiny model writes `</think>` (SmolLM2 tokens `</`, `think`, `>`) only when pushed: logit_bias lifts
those three tokens over all others, so it writes them in random order until the sequence appears; from
then on the grammar alone decides (a token the grammar masks stays masked whatever its bias).
"""

from __future__ import annotations

import pytest

from llmplug.core.errors import ConfigError
from llmplug.core.plugins import PluginNotFoundError
from llmplug.entrypoints.openai.api_server import ServerSettings

from .conftest import serve

MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]
THINK_END = ("</", "think", ">")


@pytest.fixture(scope="module")
def r1_server(engine):
    """The tiny model's engine served with --reasoning-parser deepseek_r1 (the answer starts in the reasoning)."""
    with serve(engine, ServerSettings(reasoning_parser="deepseek_r1")) as running:
        yield running


@pytest.fixture(scope="module")
def think_bias(smollm_tokenizer) -> dict[str, int]:
    ids = smollm_tokenizer.convert_tokens_to_ids(list(THINK_END))
    assert smollm_tokenizer.encode("</think>", add_special_tokens=False) == ids
    return {str(i): 100 for i in ids}


def streamed(stream) -> tuple[str, str, str | None]:
    reasoning, content, finish = "", "", None
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish


@pytest.mark.parametrize("seed", range(3))
def test_grammar_constrains_the_answer_after_the_reasoning(r1_server, think_bias, seed):
    client = r1_server.client()
    kwargs = dict(model=r1_server.model, messages=MESSAGES, temperature=1.0, seed=seed, logit_bias=think_bias,
                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    reply = client.chat.completions.create(**kwargs)
    message = reply.choices[0].message
    assert message.content in ("yes", "no")
    assert reply.choices[0].finish_reason == "stop"
    reasoning = message.reasoning_content or ""
    assert reasoning.replace("</", "").replace("think", "").replace(">", "") == ""  # only the pushed tokens
    assert streamed(client.chat.completions.create(stream=True, **kwargs)) == (reasoning, message.content, "stop")


def test_without_the_end_of_reasoning_everything_is_reasoning(r1_server, server):
    kwargs = dict(messages=MESSAGES, temperature=1.0, seed=3, max_tokens=12)
    plain = server.client().chat.completions.create(model=server.model, **kwargs).choices[0].message.content
    reply = r1_server.client().chat.completions.create(model=r1_server.model, **kwargs)
    assert reply.choices[0].message.reasoning_content == plain.strip()
    assert reply.choices[0].message.content is None
    stream = r1_server.client().chat.completions.create(model=r1_server.model, stream=True, **kwargs)
    assert streamed(stream) == (plain.strip(), "", "length")


def test_unknown_parser_names_fail_at_startup_with_the_known_names(engine):
    with pytest.raises(PluginNotFoundError, match="deepseek_r1") as error:
        with serve(engine, ServerSettings(reasoning_parser="deepseek")):
            pass
    assert "llmplug.reasoning_parsers" in str(error.value)
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        with serve(engine, ServerSettings(enable_auto_tool_choice=True)):
            pass


def test_responses_api_gives_the_reasoning_as_an_item(r1_server):
    client = r1_server.client()
    kwargs = dict(temperature=1.0, max_tokens=12, seed=3)
    chat = client.chat.completions.create(model=r1_server.model, messages=MESSAGES, **kwargs).choices[0].message
    request = dict(model=r1_server.model, input=MESSAGES[0]["content"], temperature=1.0, max_output_tokens=12,
                   extra_body={"seed": 3})
    response = client.responses.create(**request)
    assert [item.type for item in response.output] == ["reasoning"]
    assert response.output[0].content[0].text == chat.reasoning_content
    events = list(client.responses.create(stream=True, **request))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == chat.reasoning_content == events[-1].response.output[0].content[0].text
    assert events[-1].type == "response.incomplete"
