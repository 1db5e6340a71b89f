"""Turns user prompts into validated token ids (tokenizing and applying chat templates)."""

from __future__ import annotations

import numbers
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Sequence, Union

from llmplug.core.errors import InvalidRequestError
from llmplug.core.params import SamplingParams
from llmplug.engine.prompt_embeds import PLACEHOLDER_TOKEN_ID, check_prompt_embeds
from llmplug.engine.request_limits import RequestLimits, check_list_sizes, check_params

if TYPE_CHECKING:
    import torch

    from llmplug.engine.encoder_decoder import EncoderDecoderProcessor
    from llmplug.engine.multimodal import MultiModalProcessor

# A prompt is text, or a dict with "prompt" (text) or "prompt_token_ids", or "prompt_embeds" (EmbedsPrompt).
PromptType = Union[str, dict[str, Any]]


def is_embeds_prompt(prompt: PromptType) -> bool:
    """True for a prompt given as embeddings ({"prompt_embeds": tensor})."""
    return isinstance(prompt, dict) and "prompt_embeds" in prompt


def is_multimodal_prompt(prompt: PromptType) -> bool:
    """True for a prompt with images or audio: {"prompt" or "prompt_token_ids", "multi_modal_data"}, an encoder-decoder
    prompt ({"encoder_prompt", "decoder_prompt"}), or one processed already (`InputProcessor.process_multimodal`'s
    result, which carries "mm_features")."""
    return isinstance(prompt, dict) and any(key in prompt for key in ("multi_modal_data", "mm_features",
                                                                      "encoder_prompt"))


BAD_WORDS_CACHE_SIZE = 64  # bad-word lists kept tokenized (shared read-only by the requests that give them)


class InputProcessor:
    """Tokenizes prompts and checks prompts and sampling parameters against the model and the engine's limits."""

    def __init__(self, tokenizer: Any | None, limits: RequestLimits, embedding_size: int | None = None,
                 mm_processor: MultiModalProcessor | None = None,
                 encoder_decoder_processor: EncoderDecoderProcessor | None = None):
        self.tokenizer = tokenizer
        self.limits = limits
        self.embedding_size = embedding_size  # prompt embeddings' width; None: the engine takes no prompt_embeds
        self.mm_processor = mm_processor  # a multimodal model's HF processor; None: the model takes text only
        self.encoder_decoder_processor = encoder_decoder_processor  # an encoder-decoder (Whisper) model's
        self._bad_words: OrderedDict[tuple[str, ...], list[list[int]]] = OrderedDict()  # words -> sequences, LRU
        self._lock = threading.Lock()  # AsyncLLM fills the cache from a worker thread, the engine thread reads it

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to vocab_size - 1."""
        return self.limits.vocab_size

    @property
    def max_model_len(self) -> int:
        """The context length: prompt plus generated tokens."""
        return self.limits.max_model_len

    def process(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int], SamplingParams]:
        """Return (prompt text, prompt token ids, params with max_tokens and bad words resolved).

        Raises InvalidRequestError, naming the field, for anything that would fail once the request runs.
        """
        text, token_ids = self._tokenize(prompt)
        self._validate(token_ids)
        params = params.clone()
        if params.max_tokens is None:  # all the room the context leaves
            params.max_tokens = self.max_model_len - len(token_ids)
        check_list_sizes(params, self.limits)
        params.bad_words_token_ids = self.bad_words_token_ids(params) if params.bad_words else None
        check_params(params, len(token_ids), self.limits)
        return text, token_ids, params

    def process_embeds(
        self, prompt: dict[str, Any], params: SamplingParams
    ) -> tuple[torch.Tensor, list[int], SamplingParams]:
        """Return (the prompt's embeddings on the CPU, its placeholder token ids, params resolved) for a prompt
        given as embeddings; InvalidRequestError naming what is wrong."""
        embeds = check_prompt_embeds(prompt["prompt_embeds"], self.embedding_size, self.max_model_len)
        if params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs need the prompt's tokens; a prompt given as prompt_embeds has "
                                      "none", param="prompt_logprobs")
        _, token_ids, params = self.process({"prompt_token_ids": [PLACEHOLDER_TOKEN_ID] * len(embeds)}, params)
        return embeds, token_ids, params

    def process_multimodal(self, prompt: dict[str, Any]) -> dict[str, Any]:
        """A prompt with images run through the model's processor (with the prompt's `mm_processor_kwargs` over the
        engine's; a text prompt with `"add_special_tokens": False` holds its special tokens already, as a rendered
        chat does): {"prompt": text or None, "prompt_token_ids": ids with each image's placeholders expanded,
        "mm_features": one MultiModalFeature per image}. Checks the images (modality, count, type) first;
        InvalidRequestError naming what is wrong. Blocking (pixels, tokenizer): call
        it off the event loop and the engine thread."""
        if "mm_features" in prompt:  # processed already (AsyncLLM does it on a worker thread)
            return prompt
        if self.encoder_decoder_processor is not None:  # the audio for the encoder, the text for the decoder
            return self.encoder_decoder_processor.process(prompt)
        if "encoder_prompt" in prompt:
            raise InvalidRequestError("encoder_prompt / decoder_prompt were given, but this model is not an "
                                      "encoder-decoder model: send one prompt", param="encoder_prompt")
        if self.mm_processor is None:
            raise InvalidRequestError("multi_modal_data was given, but this model takes text only (it is not a "
                                      "multimodal model); send the prompt without images or audio",
                                      param="multi_modal_data")
        items = self.mm_processor.items_of(prompt["multi_modal_data"])
        text = prompt.get("prompt")
        ids = _token_ids(prompt["prompt_token_ids"]) if "prompt_token_ids" in prompt else None
        if ids is None and not isinstance(text, str):
            raise InvalidRequestError("a prompt with multi_modal_data needs 'prompt' (text) or 'prompt_token_ids'",
                                      param="prompt")
        token_ids, features = self.mm_processor.process(text if ids is None else None, ids, items,
                                                        prompt.get("mm_processor_kwargs"),
                                                        add_special_tokens=prompt.get("add_special_tokens", True))
        return {"prompt": text, "prompt_token_ids": token_ids, "mm_features": features}

    def process_pooling(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text, token ids) of a prompt to pool: it may fill the whole context (nothing is generated)."""
        text, token_ids = self._tokenize(prompt)
        self._validate(token_ids, generates=False)
        return text, token_ids

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """The token sequences of `params.bad_words` (their counts checked first), cached by the words: AsyncLLM
        tokenizes them on a worker thread before queueing the request, and the engine thread finds them here."""
        check_list_sizes(params, self.limits)
        key = tuple(params.bad_words)
        with self._lock:
            if key in self._bad_words:
                self._bad_words.move_to_end(key)
                return self._bad_words[key]
        sequences = self._bad_words_token_ids(params.bad_words)
        with self._lock:
            self._bad_words[key] = sequences
            while len(self._bad_words) > BAD_WORDS_CACHE_SIZE:
                self._bad_words.popitem(last=False)
        return sequences

    def _bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each bad word's token sequences: alone and after a space, as it would appear mid-text (as vLLM)."""
        if self.tokenizer is None:
            raise InvalidRequestError(
                "bad_words need a tokenizer; the engine runs with skip_tokenizer_init", param="bad_words"
            )
        sequences: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise InvalidRequestError(
                        f"SamplingParams.bad_words: {word!r} is spelled with token ids {bad} outside the model's "
                        f"vocabulary [0, {self.vocab_size}) (the tokenizer has more tokens than the model)",
                        param="bad_words",
                    )
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if is_embeds_prompt(prompt):  # generate() takes them (process_embeds); pooling and beam search do not
            raise InvalidRequestError("prompt_embeds is accepted by generation only (LLM.generate, completions); "
                                      "pooling and beam search take text or token ids", param="prompt_embeds")
        if is_multimodal_prompt(prompt):  # generate() takes them (process_multimodal)
            raise InvalidRequestError("multi_modal_data is accepted by generation only (LLM.generate, LLM.chat, chat "
                                      "completions); pooling and beam search take text or token ids",
                                      param="multi_modal_data")
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
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
            raise InvalidRequestError("the prompt is empty", param="prompt")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}", param="prompt"
            )
        if not generates and len(token_ids) > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens, but the model's context length is {self.max_model_len}: "
                "shorten the input", param="prompt"
            )
        if generates and len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens, but the context length is {self.max_model_len}: "
                "shorten the prompt (it must leave room for at least one generated token)", param="prompt"
            )

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """Render a conversation with the tokenizer's chat template, ready for generation."""
        if self.tokenizer is None:
            raise InvalidRequestError("chat needs a tokenizer; the engine runs with skip_tokenizer_init")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError("the model's tokenizer has no chat template")
        kwargs.setdefault("add_generation_prompt", True)
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def _token_ids(values: Any) -> list[int]:
    """Prompt token ids as Python ints (numpy's too); InvalidRequestError for anything else."""
    items = values.tolist() if hasattr(values, "tolist") else list(values) if isinstance(values, (list, tuple)) else 0
    if not isinstance(items, list) or not all(map(_is_token_id, items)):
        raise InvalidRequestError(
            f"prompt_token_ids must be a list of integers, got {str(values)[:80]}", param="prompt"
        )
    return [int(t) for t in items]


def _is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
