"""POST /tokenize and /detokenize (vLLM's): prompts and conversations to token ids, and token ids to text.

The answers are those of the generation endpoints: a prompt is tokenized as /v1/completions tokenizes it, a
conversation is rendered by the chat endpoint's own `render_prompt` (the server's chat template, the same
tools handling), so /tokenize tells a client exactly what a request would cost. The tokenizer runs on the
prompt renderer's thread, never on the event loop: the work grows with the client's input.
"""

from __future__ import annotations

from llmplug.engine.async_llm import AsyncLLM
from llmplug.entrypoints.openai.admission import AdmissionControl
from llmplug.entrypoints.openai.errors import OpenAIError
from llmplug.entrypoints.openai.metrics import ServerMetrics
from llmplug.entrypoints.openai.prompt_renderer import PromptRenderer
from llmplug.entrypoints.openai.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from llmplug.entrypoints.openai.serving_chat import OpenAIServingChat
from llmplug.entrypoints.openai.serving_engine import OpenAIServing
from llmplug.entrypoints.openai.serving_lora import ServedAdapters
from llmplug.entrypoints.openai.tools import tool_choice

__all__ = ["OpenAIServingTokenization"]


class OpenAIServingTokenization(OpenAIServing):
    """Tokenize and detokenize with the served model's tokenizer (LoRA adapters share it)."""

    def __init__(self, engine: AsyncLLM, model_names: list[str], metrics: ServerMetrics, renderer: PromptRenderer,
                 admission: AdmissionControl, chat: OpenAIServingChat, adapters: ServedAdapters | None = None):
        super().__init__(engine, model_names, metrics, renderer, admission, adapters)
        self.chat = chat  # renders conversations exactly as chat completions do

    async def tokenize(self, body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """The token ids of a prompt or a conversation, their count, the context length, and their strings."""
        await self.resolve_model(body.model)
        self.check_caps(body)
        self.log_ignored_fields(body, "/tokenize")
        if isinstance(body, TokenizeChatRequest):
            tokens = await self._chat_tokens(body)
        else:
            tokens = await self.renderer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        strings = await self.renderer.token_strs(tokens) if body.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens,
                                token_strs=strings)

    async def _chat_tokens(self, body: TokenizeChatRequest) -> list[int]:
        """The prompt a chat request with these messages and tools (tool_choice left to its default) would have."""
        if body.chat_template is not None:
            raise OpenAIError(400, "chat_template is the server's (--chat-template); a request cannot set it",
                              param="chat_template")
        # "auto" whether or not this server enables it: the prompt is the same, only the answer is read differently
        choice = tool_choice([t.function for t in body.tools or ()], None, None, True, auto_enabled=True)
        text, tokens = await self.chat.render_prompt(body, choice)
        if body.add_special_tokens:  # vLLM's: the rendered text tokenized once more, with BOS and the like
            tokens = await self.renderer.encode(text, add_special_tokens=True)
        return tokens

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids; 400 naming the ids outside the tokenizer's vocabulary."""
        await self.resolve_model(body.model)
        self.log_ignored_fields(body, "/detokenize")
        num_tokens = len(self.renderer.need_tokenizer())
        bad = [t for t in body.tokens if not 0 <= t < num_tokens]
        if bad:
            shown = ", ".join(map(str, bad[:10])) + (f" (and {len(bad) - 10} more)" if len(bad) > 10 else "")
            raise OpenAIError(400, f"tokens holds ids outside the tokenizer's vocabulary [0, {num_tokens}): {shown}",
                              param="tokens", code="token_id_out_of_vocabulary")
        return DetokenizeResponse(prompt=await self.renderer.decode(body.tokens))
