"""The chat template is the server's: clients cannot replace it, `--chat-template` sets it, and rendering and
tokenizing run off the event loop (a huge prompt never stalls other streams)."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest

from llmplug import SamplingParams
from llmplug.core.errors import ConfigError
from llmplug.entrypoints.cli import build_parser
from llmplug.entrypoints.openai.api_server import ServerSettings
from llmplug.entrypoints.openai.prompt_renderer import load_chat_template

from .conftest import serve

MESSAGES = [{"role": "user", "content": "Name a color."}]
# a template of the server's own, with a variable clients may set through chat_template_kwargs
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ greeting | default('') }}{{ m['content'] }}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def greedy_reply(server, **extra):
    return server.client().chat.completions.create(model=server.model, messages=MESSAGES, temperature=0,
                                                   max_tokens=8, **extra)


@pytest.mark.parametrize("key", ["chat_template", "tokenize", "return_dict", "bos_token", "messages",
                                 "add_generation_prompt"])
def test_chat_template_kwargs_cannot_replace_the_template(server, key):
    before = greedy_reply(server).choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        greedy_reply(server, extra_body={"chat_template_kwargs": {key: "{% for _ in range(10**9) %}x{% endfor %}"}})
    error = info.value.response.json()["error"]
    assert error["param"] == "chat_template_kwargs" and repr(key) in error["message"]
    assert greedy_reply(server).choices[0].message.content == before  # the next request is served as before


def test_a_request_level_chat_template_is_refused(server):
    before = greedy_reply(server).choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="chat_template is the server's"):
        greedy_reply(server, extra_body={"chat_template": "{{ 'hijacked' }}"})
    assert greedy_reply(server).choices[0].message.content == before


def test_the_server_chat_template_renders_every_request_with_its_variables(engine, offline_llm, smollm_tokenizer):
    variables = {"greeting": "Hello! "}
    expected_text = smollm_tokenizer.apply_chat_template(MESSAGES, chat_template=TEMPLATE, tokenize=False,
                                                         add_generation_prompt=True, **variables)
    assert "Hello! Name a color." in expected_text  # the variable reaches the template
    with serve(engine, ServerSettings(chat_template=TEMPLATE)) as running:
        reply = greedy_reply(running, extra_body={"chat_template_kwargs": variables})
        running.wait_idle()
        offline = offline_llm.generate([expected_text], SamplingParams(temperature=0, max_tokens=8),
                                       use_tqdm=False)[0]
    assert reply.usage.prompt_tokens == len(smollm_tokenizer.encode(expected_text, add_special_tokens=False))
    assert reply.choices[0].message.content == offline.outputs[0].text


def test_chat_template_option_takes_a_file_or_the_text(tmp_path):
    file = tmp_path / "template.jinja"
    file.write_text(TEMPLATE)
    assert load_chat_template(str(file)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ConfigError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="does not compile"):
        load_chat_template("{% for m in messages %}")
    parser, _ = build_parser()
    args = parser.parse_args(["serve", "--chat-template", str(file), "--max-waiting-requests", "7"])
    settings = ServerSettings.from_args(args)
    assert settings.chat_template == TEMPLATE and settings.max_waiting_requests == 7


def test_a_huge_prompt_being_tokenized_does_not_stall_other_streams(server, monkeypatch):
    """The huge prompt's tokenization is held at a gate until another stream has produced all its tokens.

    On the event loop, the held tokenization would block that stream: it could not finish before the gate
    opens by itself (after GATE_TIMEOUT_S), which the test reports as a failure.
    """
    gate_timeout_s = 60.0
    tokenizer = server.engine.get_tokenizer()
    real_encode = tokenizer.encode
    entered, release, timed_out = threading.Event(), threading.Event(), threading.Event()

    def gated_encode(text, *args, **kwargs):
        if len(text) > 1_000_000:
            entered.set()
            if not release.wait(gate_timeout_s):
                timed_out.set()
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", gated_encode)
    huge_prompt = "word " * 1_200_000  # 6 MB: under the body limit, seconds to tokenize

    async def run() -> tuple[int, asyncio.Task]:
        client = server.async_client(timeout=120)
        stream = await client.completions.create(model=server.model, prompt="Count:", temperature=0, max_tokens=40,
                                                 stream=True, extra_body={"ignore_eos": True})
        huge = asyncio.ensure_future(client.completions.create(model=server.model, prompt=huge_prompt, max_tokens=1))
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 60)
        assert entered.is_set(), "the huge prompt never reached the tokenizer"
        chunks = [chunk async for chunk in stream]
        assert not huge.done() and not timed_out.is_set()  # the stream ended while the huge prompt was held
        release.set()
        with pytest.raises(openai.BadRequestError) as info:
            await huge
        assert info.value.response.json()["error"]["code"] == "context_length_exceeded"
        await client.close()
        return sum(len(c.choices[0].text) > 0 for c in chunks if c.choices), huge

    try:
        num_text_chunks, _ = asyncio.run(run())
    finally:
        release.set()
    assert num_text_chunks > 1
    assert not timed_out.is_set()
    assert greedy_reply(server).choices[0].finish_reason in ("length", "stop")
