"""Turns user prompts into validated token ids (tokenizing and applying chat templates)."""

from __future__ import annotations

from typing import Any, Union

from llmplug.core.errors import InvalidRequestError
from llmplug.core.params import SamplingParams

# A prompt is text, or a dict with "prompt" (text) or "prompt_token_ids".
PromptType = Union[str, dict[str, Any]]


class InputProcessor:
    """Tokenizes and validates prompts against the model's vocabulary and context length."""

    def __init__(self, tokenizer: Any | None, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def process(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int], SamplingParams]:
        """Return (prompt text, prompt token ids, params with max_tokens resolved)."""
        text, token_ids = self._tokenize(prompt)
        self._validate(token_ids)
        room = self.max_model_len - len(token_ids)
        if params.max_tokens is None or params.max_tokens > room:
            params = params.clone()
            params.max_tokens = max(room, 1) if params.max_tokens is None else min(params.max_tokens, room)
        return text, token_ids, params

    def process_pooling(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text, token ids) of a prompt to pool: it may fill the whole context (nothing is generated)."""
        text, token_ids = self._tokenize(prompt)
        self._validate(token_ids, generates=False)
        return text, token_ids

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids', got {type(prompt).__name__}"
            )
        if self.tokenizer is None:
            raise InvalidRequestError("the engine runs without a tokenizer (skip_tokenizer_init): pass prompt_token_ids")
        return text, self.tokenizer.encode(text)

    def _validate(self, token_ids: list[int], generates: bool = True) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise InvalidRequestError(f"prompt token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if not generates and len(token_ids) > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens, but the model's context length is {self.max_model_len}: "
                "shorten the input"
            )
        if generates and len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens, but the context length is {self.max_model_len}: "
                "shorten the prompt (it must leave room for at least one generated token)"
            )

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """Render a conversation with the tokenizer's chat template, ready for generation."""
        if self.tokenizer is None:
            raise InvalidRequestError("chat needs a tokenizer; the engine runs with skip_tokenizer_init")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError("the model's tokenizer has no chat template")
        kwargs.setdefault("add_generation_prompt", True)
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
