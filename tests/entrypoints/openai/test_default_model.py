"""End to end on the embedded default model (SmolLM2-135M-Instruct): real answers, equal to offline ones."""

from __future__ import annotations

import pytest

from llmplug import LLM, AsyncLLM, SamplingParams
from llmplug.core.config import DEFAULT_MODEL

from .conftest import serve

pytestmark = pytest.mark.slow

# a question whose greedy answer leads by >= 0.875 nats per token in bf16 (tests/loaders/test_gguf_int4.py, CHATS)
QUESTION = [{"role": "user", "content": "What is the capital city of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def offline_then_served():
    """Offline answers first, then the same engine served (loading the model once keeps this test short)."""
    llm = LLM(max_model_len=512)
    expected = {
        "greedy": llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0],
        "seeded": llm.generate(["The three primary colors are"], SamplingParams(temperature=0.8, seed=42,
                               max_tokens=20), use_tqdm=False)[0].outputs[0],
    }
    engine = AsyncLLM.from_engine(llm.llm_engine, DEFAULT_MODEL)  # the offline LLM is not used any more
    try:
        with serve(engine) as running:
            yield running, expected
    finally:
        engine.shutdown()


def test_default_model_answers_like_offline(offline_then_served):
    default_server, expected = offline_then_served
    client = default_server.client()
    assert default_server.model == DEFAULT_MODEL
    reply = client.chat.completions.create(model=default_server.model, messages=QUESTION, temperature=0,
                                           max_tokens=24)
    assert reply.choices[0].message.content == expected["greedy"].text
    assert "Paris" in reply.choices[0].message.content
    stream = client.chat.completions.create(model=default_server.model, messages=QUESTION, temperature=0,
                                            max_tokens=24, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected["greedy"].text
    completion = client.completions.create(model=default_server.model, prompt="The three primary colors are",
                                           temperature=0.8, seed=42, max_tokens=20)
    assert completion.choices[0].text == expected["seeded"].text
    response = client.responses.create(model=default_server.model, input=QUESTION[0]["content"],
                                       temperature=0, max_output_tokens=24)
    assert response.output_text == expected["greedy"].text
