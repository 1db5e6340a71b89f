"""Bodies of vLLM's POST /tokenize and /detokenize, with vLLM's field names and defaults.

/tokenize takes a prompt (the completion form) or a conversation (the chat form, rendered with the chat
template the chat endpoint uses); which form is decided by the `messages` field, so a body missing a
field gets the error of the form it meant.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag

from llmplug.entrypoints.openai.protocol import ChatMessage, ChatTool, Name, OpenAIModel, TokenId


class TokenizeCompletionRequest(OpenAIModel):
    """/tokenize of a prompt: its token ids as a completion request would have them."""

    model: Name | None = None
    prompt: str
    add_special_tokens: bool = True  # BOS and the like, as completions add them
    return_token_strs: bool | None = False  # also the vocabulary entry of each token


class TokenizeChatRequest(OpenAIModel):
    """/tokenize of a conversation: the token ids of the prompt a chat request would have."""

    model: Name | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # as on chat completions: it wins over add_generation_prompt
    add_special_tokens: bool = False  # the template holds them already
    return_token_strs: bool | None = False
    chat_template: str | None = None  # refused: the template is the server's (as on chat completions)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None


def _form(body: Any) -> str:
    """Which /tokenize form a body is: "chat" when it has `messages`."""
    if isinstance(body, dict):
        return "chat" if "messages" in body else "completion"
    return "chat" if isinstance(body, TokenizeChatRequest) else "completion"


TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("completion")] | Annotated[TokenizeChatRequest, Tag("chat")],
    Discriminator(_form),
]


class TokenizeResponse(OpenAIModel):
    """The token ids, their number, the model's context length, and (with return_token_strs) their strings."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    """/detokenize: the text of token ids."""

    model: Name | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIModel):
    """The text of the ids (special tokens kept)."""

    prompt: str
