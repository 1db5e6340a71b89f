"""Image content parts of chat and Responses messages: checked, then loaded off the event loop, in order.

A message with images reaches the chat template as HF processors expect it: its content a list of
`{"type": "text", "text": ...}` and `{"type": "image"}` parts (LLaVA's, Gemma 3's, SmolVLM's templates write
their image token for the latter); the images go to the engine as `multi_modal_data={"image": [...]}` in the
same order, and the model's processor expands each image token into its placeholders.

The checks come before any image is read (cheap first, STYLE 15): the model takes images, the count is within
`model.limit_mm_per_prompt`, every part has a URL. Loading (files, downloads, decoding) runs on a small thread
pool of its own, so a slow image host delays only its own request.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llmplug.core.errors import InvalidRequestError
from llmplug.engine.multimodal import DEFAULT_LIMIT
from llmplug.entrypoints.openai.errors import OpenAIError
from llmplug.entrypoints.openai.protocol import ImageURL
from llmplug.multimodal.media import MediaPolicy, load_image_url

if TYPE_CHECKING:
    from PIL import Image

IMAGE_PART_TYPES = ("image_url", "input_image")  # chat's, and the Responses API's
LOADER_THREADS = 4  # concurrent image loads of the whole server; more requests wait for a thread


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image part of a request: its URL (None when the part has none) and where the request holds it."""

    url: str | None
    param: str  # e.g. messages[0].content[1]
    message_param: str  # e.g. messages[0].content


@dataclass(slots=True)
class ImageInputs:
    """The image parts of one request, in the order the chat template meets them."""

    refs: list[ImageRef] = field(default_factory=list)

    def add(self, part: Any, param: str, message_param: str) -> dict[str, str]:
        """Record an image part (chat's `image_url` or the Responses API's `input_image`); returns its template
        part. A Responses `file_id` is a 400: this server stores no files."""
        if getattr(part, "file_id", None) is not None:  # the Responses part's field (an extra field in chat)
            raise OpenAIError(400, f"{param}: file_id is not supported (this server stores no files); send the "
                                   "image as image_url (a data:image/...;base64 URL)", param=param)
        value = part.image_url  # chat: {"url": ...}; the Responses API: the URL itself
        url = value.url if isinstance(value, ImageURL) else value
        self.refs.append(ImageRef(url, param, message_param))
        return {"type": "image"}


def is_image_part(part: Any) -> bool:
    """Whether a content part is an image (chat's image_url or the Responses API's input_image)."""
    return part.type in IMAGE_PART_TYPES


class ImageLoader:
    """Checks a request's image parts against the model and loads them under the server's MediaPolicy, on
    threads of its own."""

    def __init__(self, policy: MediaPolicy, model_name: str, takes_images: bool, max_images: int):
        self.policy = policy
        self.model_name = model_name
        self.takes_images = takes_images
        self.max_images = max_images  # model.limit_mm_per_prompt["image"]
        self._pool = ThreadPoolExecutor(max_workers=LOADER_THREADS, thread_name_prefix="llmplug-media")

    @classmethod
    def for_engine(cls, engine: Any, model_name: str, policy: MediaPolicy | None = None) -> "ImageLoader":
        """The loader of a server on `engine`: whether its model takes images, and its limit per prompt."""
        limits = engine.config.model.limit_mm_per_prompt
        return cls(policy or MediaPolicy(), model_name, engine_takes_images(engine),
                   limits.get("image", DEFAULT_LIMIT))

    def check(self, images: ImageInputs) -> None:
        """400 naming the first part the model cannot take: images to a text-only model, too many, no URL."""
        if not images.refs:
            return
        first = images.refs[0]
        if not self.takes_images:
            raise OpenAIError(400, f"{first.param}: the model {self.model_name} does not take images (it is a "
                                   "text-only model); send text content only", param=first.message_param)
        if len(images.refs) > self.max_images:
            raise OpenAIError(400, f"the request has {len(images.refs)} images, more than the limit of "
                                   f"{self.max_images} per prompt (--limit-mm-per-prompt '{{\"image\": N}}')",
                              param=images.refs[self.max_images].param)
        for ref in images.refs:
            if not ref.url:
                raise OpenAIError(400, f"{ref.param}: an image part needs its URL (image_url.url in chat, "
                                       "image_url in the Responses API)", param=ref.param)

    async def load(self, images: ImageInputs) -> list["Image.Image"]:
        """The request's images, in order, loaded on the loader's threads; checked first (`check`)."""
        self.check(images)
        if not images.refs:
            return []
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._load_all, images.refs)

    def _load_all(self, refs: list[ImageRef]) -> list["Image.Image"]:
        try:
            return [load_image_url(ref.url, self.policy, ref.param) for ref in refs]
        except InvalidRequestError as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from None

    def shutdown(self) -> None:
        """Stop the threads (loads already running finish first)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def engine_takes_images(engine: Any) -> bool:
    """Whether the engine's model takes images: the engine built its processor (a `supports_multimodal` model)."""
    return engine.llm_engine.processor.mm_processor is not None
