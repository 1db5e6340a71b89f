"""Fixtures of the guided-decoding tests: a tiny random model with a small tokenizer, the real default model,
the constraints each backend is tested with and the independent validators of their outputs."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jsonschema
import lark
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from llmplug import LLM
from llmplug.core.params import GuidedDecodingParams
from llmplug.plugins.guided_decoding.common import byte_level_chars
from tests.models.tiny_models import save_tiny_llama

# The tiny model's vocabulary: one token per character (byte-level, as GPT-2's), enough for JSON,
# the schema, regex and grammar below (their letters are all in it); few tokens keep random strings
# short enough to close.
ALPHABET = '{}[]":,.-+*()0123456789abcdeflnrstu@ '
EOS = "<eos>"

BACKENDS = ("xgrammar", "llguidance", "outlines", "lm_format_enforcer")

# A small context-free grammar (balanced parentheses), in Lark for llguidance and the test's parser,
# and in GBNF-style EBNF for xgrammar.
LARK_GRAMMAR = """
start: expr
expr: DIGIT | "(" expr OP expr ")"
DIGIT: /[0-9]/
OP: "+" | "*"
"""
EBNF_GRAMMAR = """
root ::= expr
expr ::= [0-9] | "(" expr op expr ")"
op ::= "+" | "*"
"""
GRAMMAR_PARSER = lark.Lark(LARK_GRAMMAR, parser="lalr")

SCHEMA = {
    "type": "object",
    "properties": {
        "flat": {"type": "boolean"},
        "dress": {"enum": ["red", "blue", "tan"]},
        # a pattern, not maxLength, bounds the string: lm-format-enforcer lets a string that starts with a
        # space run past maxLength; and no integer: it lets one take an exponent (1e999, no integer)
        "label": {"type": "string", "pattern": "^[a-f]{1,6}$"},
        "sets": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["flat", "dress", "label", "sets"],
    "additionalProperties": False,
}
REGEX = r"[a-f]{2,4}@[0-9]{1,3}\.(net|edu)"
CHOICES = ["true", "false", "(1+2)"]


@dataclass(frozen=True)
class Case:
    """One constraint kind: how to ask for it and how to check an output independently."""

    kind: str
    params: Callable[[str], GuidedDecodingParams]  # backend -> constraint
    valid: Callable[[str], bool]


def _json_valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _object_valid(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _grammar_valid(text: str) -> bool:
    try:
        GRAMMAR_PARSER.parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


CASES = {
    "json": Case("json", lambda b: GuidedDecodingParams(json=SCHEMA, backend=b), _json_valid),
    "json_object": Case("json_object", lambda b: GuidedDecodingParams(json_object=True, backend=b), _object_valid),
    "regex": Case("regex", lambda b: GuidedDecodingParams(regex=REGEX, backend=b), lambda t: bool(re.fullmatch(REGEX, t))),
    "choice": Case("choice", lambda b: GuidedDecodingParams(choice=CHOICES, backend=b), lambda t: t in CHOICES),
    "grammar": Case(
        "grammar",
        lambda b: GuidedDecodingParams(grammar=EBNF_GRAMMAR if b == "xgrammar" else LARK_GRAMMAR, backend=b),
        _grammar_valid,
    ),
}
KINDS = {
    "xgrammar": ("json", "json_object", "regex", "choice", "grammar"),
    "llguidance": ("json", "json_object", "regex", "choice", "grammar"),
    "outlines": ("json", "json_object", "regex", "choice"),
    "lm_format_enforcer": ("json", "regex", "choice"),  # its any-object mode emits trailing commas
}
BACKEND_KINDS = [(b, k) for b in BACKENDS for k in KINDS[b]]


def make_char_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer without merges over ALPHABET, plus an end-of-sequence token."""
    to_unicode = {b: c for c, b in byte_level_chars().items()}
    vocab = {EOS: 0, **{to_unicode[ord(ch)]: i + 1 for i, ch in enumerate(ALPHABET)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)


@pytest.fixture(scope="session")
def tiny_guided_model(tmp_path_factory) -> Path:
    """A tiny random Llama whose vocabulary is the character tokenizer's, saved with it."""
    path = tmp_path_factory.mktemp("tiny_guided")
    save_tiny_llama(path, make_char_tokenizer(), max_position_embeddings=512, bos_token_id=None, eos_token_id=0,
                    tie_word_embeddings=False)
    return path


# package and module scopes, not session: an engine holds its model and KV cache until its fixture ends
@pytest.fixture(scope="package")
def tiny_llm(tiny_guided_model) -> LLM:
    """The offline engine on the tiny model."""
    return LLM(str(tiny_guided_model), dtype="float32", max_model_len=512, block_size=16)


@pytest.fixture(scope="module")  # its one user is test_generation.py
def smollm_llm() -> LLM:
    """The offline engine on the embedded default model (SmolLM2-135M-Instruct), dense: the sampled tests' budgets
    (how many of 10 samples at temperature 1.0 may run out of tokens) were calibrated on its dense weights, and the
    grammar's masks do not depend on the kernel that computes the logits."""
    return LLM(max_model_len=512, quantization="none")
