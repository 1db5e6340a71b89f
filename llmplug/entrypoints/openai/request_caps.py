"""The caps on what one request may ask for, checked first in each handler, before any per-item work.

Each cap bounds work that grows with the request: prompts and pooling inputs (each one tokenized, checked
and queued), documents to score (tokenized in pairs), `allowed_token_ids` and `bad_words` (checked, then
turned into masks), tools and constraints (compiled into grammars). The caps are engine options
(`decoding.max_*`, one flag each: docs/serving.md lists them), and the engine applies the same ones to
offline requests where they apply. Past one, the request is a 400 naming the field, the cap and its flag.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

from llmplug.core.config import DecodingConfig
from llmplug.entrypoints.openai.errors import OpenAIError

__all__ = ["check_request_caps", "num_items"]

# request field -> the cap on its number of items
COUNTED = {
    "prompt": "max_prompts",
    "input": "max_pooling_inputs",
    "text_1": "max_pooling_inputs",
    "text_2": "max_pooling_inputs",
    "queries": "max_pooling_inputs",
    "documents": "max_pooling_inputs",
    "allowed_token_ids": "max_allowed_token_ids",
    "bad_words": "max_bad_words",
    "tools": "max_tools",
}
# fields where a text or one token-id list is one item
PROMPT_LIKE = frozenset({"prompt", "input", "text_1", "text_2", "queries", "documents"})
# request fields that carry a structured-output constraint (their size, in characters, is capped)
CONSTRAINTS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice", "structured_outputs",
               "response_format", "text", "tools")


def check_request_caps(body: BaseModel, caps: DecodingConfig) -> None:
    """A 400 naming the first field of `body` past its cap in `caps` (fields `body` does not declare are not
    looked at: unknown fields are ignored)."""
    for param, size, option in _sizes(body):
        limit = getattr(caps, option)
        if size > limit:
            flag = "--" + option.replace("_", "-")
            raise OpenAIError(400, f"{param} is too large: {size}, more than this server's limit of {limit} "
                                   f"(decoding.{option}, {flag})", param=param)


def num_items(value: Any) -> int:
    """How many items a prompt-like field holds: a text or one token-id list is one, a list of them is its length."""
    if value is None:
        return 0
    if isinstance(value, str) or (value and all(isinstance(t, int) for t in value)):
        return 1
    return len(value)


def _sizes(body: BaseModel) -> Iterator[tuple[str, int, str]]:
    """(param, size, cap) of each capped field `body` sets."""
    fields = type(body).model_fields
    for name, option in COUNTED.items():
        value = getattr(body, name) if name in fields else None
        if value is not None and not (name == "input" and _conversation(value)):  # the Responses API's input
            yield name, num_items(value) if name in PROMPT_LIKE else len(value), option
    for i, word in enumerate(getattr(body, "bad_words", None) or () if "bad_words" in fields else ()):
        yield f"bad_words[{i}]", len(word), "max_bad_word_length"
    chars = sum(_chars(getattr(body, name)) for name in CONSTRAINTS if name in fields)
    if chars:
        yield "structured output constraint", chars, "max_constraint_chars"


def _conversation(value: Any) -> bool:
    return isinstance(value, list) and any(isinstance(item, BaseModel) for item in value)


def _chars(value: Any) -> int:
    """The size of a constraint field in characters: a text's length, anything else's as compact JSON."""
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value)
    return len(json.dumps(value, separators=(",", ":"), default=_plain))


def _plain(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_none=True, by_alias=True)
