"""/v1/responses through the real openai client: text in, text out, streamed as OpenAI's events."""

from __future__ import annotations

from llmplug import SamplingParams


def offline_chat(llm, messages, **params):
    return llm.chat(messages, SamplingParams(**params), use_tqdm=False)[0].outputs[0]


def test_string_input_with_instructions_equals_offline_chat(server, offline):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello!"}]
    expected = offline_chat(offline, messages, temperature=0.0, max_tokens=9)
    response = server.client().responses.create(model=server.model, input="Hello!", instructions="Answer briefly.",
                                                temperature=0, max_output_tokens=9)
    assert response.output_text == expected.text
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 9
    assert response.output[0].type == "message" and response.output[0].role == "assistant"


def test_message_input_equals_offline_chat(server, offline):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "input_text", "text": "Count to three."}]},
    ]
    plain = messages[:2] + [{"role": "user", "content": "Count to three."}]
    expected = offline_chat(offline, plain, temperature=1.0, seed=21, max_tokens=7)
    response = server.client().responses.create(model=server.model, input=messages, temperature=1.0,
                                                max_output_tokens=7, extra_body={"seed": 21})
    assert response.output_text == expected.text


def test_streaming_events_in_order(server, offline):
    expected = offline_chat(offline, [{"role": "user", "content": "Tell a story."}], temperature=0.0, max_tokens=8)
    stream = server.client().responses.create(model=server.model, input="Tell a story.", temperature=0,
                                              max_output_tokens=8, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == expected.text == events[-4].text
    assert events[-1].response.output_text == expected.text
