"""Streamed chat and completion answers, whose plain text chunks are filled into a template (stream_chunks.TextChunks)
rather than built as pydantic models: over the real openai client they equal the whole answer and the offline one,
byte for byte they are what the models would write, and the chunks that leave the template (logprobs, n > 1)
agree."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from llmplug import SamplingParams
from llmplug.entrypoints.openai.protocol import ChatCompletionStreamResponse, CompletionResponse
from llmplug.entrypoints.openai.stream_chunks import TextChunks

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
GREEDY = {"temperature": 0, "max_tokens": 40, "extra_body": {"ignore_eos": True}}


def streamed(client: openai.OpenAI, model: str, **kwargs) -> tuple[dict[int, str], list]:
    """Each choice's streamed text, and the chunks."""
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **kwargs))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return texts, chunks


def test_streamed_answer_equals_the_whole_one_and_offline(server, offline):
    expected = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    client = server.client()
    whole = client.chat.completions.create(model=server.model, messages=MESSAGES, **GREEDY)
    texts, chunks = streamed(client, server.model, stream_options={"include_usage": True}, **GREEDY)
    assert texts[0] == whole.choices[0].message.content == expected.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 40


def test_chunks_are_the_bytes_the_models_write(server):
    body = {"model": server.model, "messages": MESSAGES, "stream": True, "temperature": 0, "max_tokens": 40,
            "ignore_eos": True}
    request = urllib.request.Request(f"{server.base_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        events = [line for line in response.read().decode().split("\n") if line]
    datas = [line.removeprefix("data: ") for line in events]
    assert all(line.startswith("data: ") for line in events) and datas[-1] == "[DONE]"
    contents = 0
    for data in datas[:-1]:
        chunk = ChatCompletionStreamResponse.model_validate_json(data)
        assert chunk.model_dump_json(exclude={"usage"}) == data
        contents += bool(chunk.choices and chunk.choices[0].delta.content)
    assert contents > 10  # the template's chunks were among them


@pytest.mark.parametrize("text", ["plain", 'quote " and \\ backslash', "\n\t\r\b\f\x00\x1f\x7f", "é漢字😀\u2028\ufffd",
                                  "".join(map(chr, range(128)))])
def test_text_chunks_escape_as_pydantic_does(text):
    def dump(content: str) -> str:
        return json.dumps({"model": "m", "delta": {"content": content}}, separators=(",", ":"), ensure_ascii=False)

    chunks = TextChunks(dump)
    assert chunks(text) == f"data: {dump(text)}\n\n"
    assert json.loads(chunks(text).removeprefix("data: "))["delta"]["content"] == text


def test_chunks_off_the_template_agree_and_a_bad_request_leaves_the_next_one_working(server):
    client = server.client()
    plain, _ = streamed(client, server.model, **GREEDY)
    with_logprobs, chunks = streamed(client, server.model, logprobs=True, top_logprobs=2, **GREEDY)
    assert with_logprobs == plain
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs) == 40
    with pytest.raises(openai.BadRequestError):
        streamed(client, server.model, top_logprobs=2, **GREEDY)  # top_logprobs without logprobs
    again, _ = streamed(client, server.model, **GREEDY)
    assert again == plain


def test_several_choices_stream_what_they_answer_whole(server):
    client = server.client()
    sampled = {"n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 24}
    whole = client.chat.completions.create(model=server.model, messages=MESSAGES, **sampled)
    texts, _ = streamed(client, server.model, **sampled)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert len(set(texts.values())) == 2


def test_streamed_completion_chunks_are_the_bytes_the_models_write(server, offline):
    """/v1/completions fills its plain text chunks into a template too: the bytes are the models' and the text,
    joined, is the offline answer; the finishing chunk (and a chunk with logprobs) leaves the template."""
    expected = offline.generate(["The sea is"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].text
    body = {"model": server.model, "prompt": "The sea is", "stream": True, "temperature": 0, "max_tokens": 30,
            "ignore_eos": True}
    request = urllib.request.Request(f"{server.base_url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        datas = [line.removeprefix("data: ") for line in response.read().decode().split("\n") if line]
    assert datas[-1] == "[DONE]"
    chunks = [CompletionResponse.model_validate_json(data) for data in datas[:-1]]
    assert all(chunk.model_dump_json(exclude={"usage"}) == data for chunk, data in zip(chunks, datas))
    assert "".join(chunk.choices[0].text for chunk in chunks) == expected
    assert [chunk.choices[0].finish_reason for chunk in chunks].count("length") == 1
    assert sum(chunk.choices[0].finish_reason is None and chunk.choices[0].text != "" for chunk in chunks) > 10

    stream = server.client().completions.create(model=server.model, prompt="The sea is", temperature=0,
                                                max_tokens=30, logprobs=1, extra_body={"ignore_eos": True},
                                                stream=True)
    with_logprobs = list(stream)
    assert "".join(chunk.choices[0].text for chunk in with_logprobs) == expected
    assert sum(len(chunk.choices[0].logprobs.tokens) for chunk in with_logprobs) == 30
