"""The in-tree reasoning parsers on fixed outputs: whole, and streamed in pieces cut at every place."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from llmplug.core.plugins import get_registry
from llmplug.plugins.reasoning_parsers import ReasoningParser, ReasoningStart
from tests.tool_parsers.test_tool_parsers import splits

REASONING, ANSWER, BY_TAG = ReasoningStart.REASONING, ReasoningStart.ANSWER, ReasoningStart.BY_TAG

# (parser, prompt tail, output, expected reasoning, expected content)
CASES = [
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Paris is in France.\n</think>\n\nParis.", "Paris is in France.", "Paris."),
    ("deepseek_r1", "<｜Assistant｜>", "<think>\nHmm, 2+2.\n</think>4", "Hmm, 2+2.", "4"),
    ("deepseek_r1", "<｜Assistant｜>", "Still thinking about <thi", "Still thinking about <thi", None),
    ("qwen3", "<|im_start|>assistant\n", "<think>\nlet me see </thin k>\n</think>\n\n{\"a\": 1}",
     "let me see </thin k>", '{"a": 1}'),
    ("qwen3", "<|im_start|>assistant\n", "No reasoning here, <think> is text.", None,
     "No reasoning here, <think> is text."),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<think>literal</think>", None,
     "<think>literal</think>"),
]


@pytest.fixture(scope="module")
def parsers() -> dict[str, ReasoningParser]:
    """The registered parsers, on a tokenizer that has `<think>` and `</think>` as tokens (as Qwen3's has)."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tokenizer.add_tokens(["<think>", "</think>"])
    return {name: get_registry().load("llmplug.reasoning_parsers", name)(tokenizer) for name in ("deepseek_r1", "qwen3")}


@pytest.mark.parametrize("name, prompt, text, reasoning, content", CASES)
def test_whole_and_streamed_outputs_split_reasoning_from_answer(parsers, name, prompt, text, reasoning, content):
    reasoning_parser = parsers[name]
    start = reasoning_parser.start(prompt)
    assert reasoning_parser.extract(text, start) == (reasoning, content)
    for pieces in splits(text):
        stream = reasoning_parser.stream(start)
        deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
        assert "".join(d.reasoning for d in deltas) == (reasoning or ""), pieces
        assert "".join(d.content for d in deltas) == (content or ""), pieces


def test_where_the_output_starts_follows_the_prompt(parsers):
    r1, qwen3 = parsers["deepseek_r1"], parsers["qwen3"]
    assert r1.start("<｜Assistant｜>") is REASONING and r1.start("x<think>\n") is REASONING
    assert qwen3.start("<|im_start|>assistant\n") is BY_TAG and qwen3.start("assistant\n<think>\n") is REASONING
    assert qwen3.start("<think>\n\n</think>\n\n") is ANSWER and r1.start("<think>\n\n</think>\n\n") is ANSWER


def test_end_token_ids_are_the_tokenized_end_tag(parsers):
    tokenizer = parsers["qwen3"].tokenizer
    assert parsers["qwen3"].end_token_ids() == (tokenizer.convert_tokens_to_ids("</think>"),)
