"""Prompts from client input: the chat template (the server's, never a client's) and tokenization, off the event loop.

- The chat template is the model's, or the one the server was started with (`--chat-template`, a file
  or the template text). A client cannot replace or bypass it: `chat_template_kwargs` carries only the
  template's own variables (e.g. `enable_thinking`); a key that `apply_chat_template` itself takes
  (`chat_template`, `tokenize`, ...), the template's `messages`, or a special token it inserts
  (`bos_token`, ...) is refused with 400. vLLM's CVE-2025-61620 (a client-sent template that exhausts
  the server) is the precedent.
- Rendering and tokenizing run on one thread of their own: a multi-megabyte prompt takes seconds to
  tokenize, and on the event loop it would stall every other stream for that long. One thread, because
  the fast tokenizer is not safe to call from several threads at once; its encode releases the GIL.
"""

from __future__ import annotations

import asyncio
import inspect
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from llmplug.core.errors import ConfigError
from llmplug.engine.pooling import pair_prompt
from llmplug.entrypoints.openai.errors import OpenAIError

# The variable the template renders the conversation from; apply_chat_template sets it.
_TEMPLATE_MESSAGES = ("messages", "conversation")


def load_chat_template(value: str) -> str:
    """The template `--chat-template` names: the text of a file, or `value` itself when it is template text.

    ConfigError when it is neither an existing file nor Jinja (a mistyped path), or does not compile.
    """
    path = Path(value)
    looks_like_jinja = "{{" in value or "{%" in value
    if not looks_like_jinja:
        if not path.is_file():
            raise ConfigError(f"--chat-template {value!r}: no such file, and not template text (no '{{{{' or '{{%')")
        value = path.read_text(encoding="utf-8")
    _compile(value)
    return value


def _compile(template: str) -> None:
    """Refuse a template that does not compile, at start-up rather than at the first request."""
    import jinja2.sandbox

    try:
        jinja2.sandbox.ImmutableSandboxedEnvironment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"--chat-template does not compile: {exc.message} (line {exc.lineno})") from None


def reserved_template_kwargs(tokenizer: Any) -> frozenset[str]:
    """Keys a client may not send in `chat_template_kwargs`: what would replace or bypass the template."""
    parameters = inspect.signature(tokenizer.apply_chat_template).parameters
    own = {name for name, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset(own | set(_TEMPLATE_MESSAGES) | set(tokenizer.special_tokens_map))


class PromptRenderer:
    """Renders conversations and tokenizes text on one worker thread, with the server's chat template."""

    def __init__(self, tokenizer: Any | None, chat_template: str | None = None, mm_processor: Any | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # None: the tokenizer's own
        # a multimodal model's processor (llmplug.engine.multimodal.MultiModalProcessor): its chat template renders
        # conversations with images, as LLM.chat renders them
        self.mm_processor = mm_processor
        self.reserved = reserved_template_kwargs(tokenizer) if tokenizer is not None else frozenset()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmplug-prompts")

    def template_text(self) -> str | None:
        """The chat template every request is rendered with (None: there is none)."""
        if self.chat_template is not None:
            return self.chat_template
        return getattr(self.tokenizer, "chat_template", None) or self._processor_template()

    def _processor_template(self) -> str | None:
        """The chat template of a multimodal model's processor (None: no such processor, or it has none)."""
        return getattr(self.mm_processor.hf_processor, "chat_template", None) if self.mm_processor else None

    def need_tokenizer(self) -> Any:
        """The tokenizer; 400 when the engine runs without one."""
        if self.tokenizer is None:
            raise OpenAIError(400, "the server runs without a tokenizer (skip_tokenizer_init): "
                                   "only token-id prompts on /v1/completions are accepted", param="prompt")
        return self.tokenizer

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt, as the offline engine tokenizes it (by default: with BOS and the like)."""
        tokenizer = self.need_tokenizer()
        return await self._off_loop(lambda: list(tokenizer.encode(text, add_special_tokens=add_special_tokens)))

    async def decode(self, token_ids: list[int]) -> str:
        """The text of token ids (special tokens included), as the tokenizer decodes them."""
        tokenizer = self.need_tokenizer()
        return await self._off_loop(lambda: tokenizer.decode(token_ids))

    async def token_strs(self, token_ids: list[int]) -> list[str]:
        """The vocabulary entry of each token id (byte-level pieces such as 'Ġthe', not decoded text)."""
        tokenizer = self.need_tokenizer()
        return await self._off_loop(lambda: list(tokenizer.convert_ids_to_tokens(token_ids)))

    async def encode_pairs(self, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """Each text pair as a cross-encoder's tokenizer joins it (`pair_prompt`), tokenized off the event loop."""
        tokenizer = self.need_tokenizer()
        return await self._off_loop(lambda: [pair_prompt(tokenizer, a, b) for a, b in pairs])

    async def render_chat(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any],
                          client_kwargs: dict[str, Any] | None = None,
                          has_images: bool = False) -> tuple[str, list[int]]:
        """A conversation through the chat template: (prompt text, token ids), as `LLM.chat` renders it.

        `client_kwargs` (a request's chat_template_kwargs) may hold only the template's own variables. With
        `has_images` (image parts as `{"type": "image"}` in the messages' content lists) and no --chat-template, the
        model processor's template renders it, or the tokenizer's with each image as the processor's placeholder.
        """
        self.need_tokenizer()
        self.check_client_kwargs(client_kwargs or {})
        if self.template_text() is None:
            raise OpenAIError(400, "the model's tokenizer has no chat template; start the server with "
                                   "--chat-template FILE", param="messages")
        kwargs = {**(client_kwargs or {}), **template_kwargs}
        return await self._off_loop(lambda: self._render(messages, kwargs, has_images))

    def check_client_kwargs(self, kwargs: dict[str, Any]) -> None:
        """400 for a `chat_template_kwargs` key that would replace or bypass the template."""
        refused = sorted(set(kwargs) & self.reserved)
        if refused:
            raise OpenAIError(
                400, f"chat_template_kwargs may not set {', '.join(map(repr, refused))}: the chat template and how "
                     "it is applied are the server's (--chat-template); send only the template's own variables, "
                     "and add_generation_prompt / continue_final_message as request fields",
                param="chat_template_kwargs")

    def _render(self, messages: list[dict[str, Any]], kwargs: dict[str, Any],
                has_images: bool = False) -> tuple[str, list[int]]:
        kwargs.setdefault("add_generation_prompt", True)
        try:
            text = self._apply_template(messages, kwargs, has_images)
        except Exception as exc:  # a template that raises (jinja's raise_exception) is the caller's input problem
            raise OpenAIError(400, f"the chat template failed on these messages: {exc}", param="messages") from exc
        # the template already holds the special tokens: no second BOS
        return text, list(self.tokenizer.encode(text, add_special_tokens=False))

    def _apply_template(self, messages: list[dict[str, Any]], kwargs: dict[str, Any], has_images: bool) -> str:
        """The prompt text; a conversation with images is rendered as LLM.chat renders it (the processor's template,
        else each image as the placeholder in the tokenizer's), unless the server has its own template."""
        own = getattr(self.tokenizer, "chat_template", None)
        if self.chat_template is None and self.mm_processor is not None and (has_images or own is None):
            if self._processor_template():
                return self.mm_processor.hf_processor.apply_chat_template(messages, tokenize=False, **kwargs)
            from llmplug.engine.multimodal import flatten_media_parts

            messages = flatten_media_parts(messages, self.mm_processor.placeholder)
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False, **kwargs)

    async def _off_loop(self, work: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, work)

    def shutdown(self) -> None:
        """Stop the thread (work already queued finishes first)."""
        self._thread.shutdown(wait=False, cancel_futures=True)
