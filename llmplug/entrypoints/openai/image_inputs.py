"""Image content parts of chat and Responses messages (and chat's audio parts): checked, then loaded off the event
loop, in order.

A message with images reaches the chat template as HF processors expect it: its content a list of
`{"type": "text", "text": ...}` and `{"type": "image"}` parts (LLaVA's, Gemma 3's, SmolVLM's templates write
their image token for the latter); the images go to the engine as `multi_modal_data={"image": [...]}` in the
same order, and the model's processor expands each image token into its placeholders. Audio parts (OpenAI's
`input_audio` with base64 data, vLLM's `audio_url`) go the same way as `{"type": "audio"}` and
`multi_modal_data={"audio": [...]}`, decoded at the model's sampling rate (llmplug.multimodal.audio).

The checks come before any image is read (cheap first, STYLE 15): the model takes images, the count is within
`model.limit_mm_per_prompt`, every part has a URL. Loading (files, downloads, decoding) runs on a small thread
pool of its own, so a slow image host delays only its own request.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from llmplug.core.errors import InvalidRequestError
from llmplug.engine.multimodal import DEFAULT_LIMIT
from llmplug.entrypoints.openai.errors import OpenAIError
from llmplug.entrypoints.openai.protocol import ImageURL
from llmplug.multimodal.media import MediaPolicy, load_audio_url, load_image_url, load_input_audio

IMAGE_PART_TYPES = ("image_url", "input_image")  # chat's, and the Responses API's
AUDIO_PART_TYPES = ("input_audio", "audio_url")  # OpenAI's base64 clip, and vLLM's URL
# what a part without its URL (or data) is told
MISSING = {
    "image_url": "an image part needs its URL (image_url.url in chat, image_url in the Responses API)",
    "input_audio": "an input_audio part needs its data (input_audio.data: the base64 text of a WAV, MP3, ... file)",
    "audio_url": "an audio_url part needs its URL (audio_url.url)",
}
LOADER_THREADS = 4  # concurrent image loads of the whole server; more requests wait for a thread


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image or audio part of a request: its URL (None when the part has none) and where the request holds it."""

    url: str | None  # an input_audio part's: its base64 data
    param: str  # e.g. messages[0].content[1]
    message_param: str  # e.g. messages[0].content
    kind: str = "image_url"  # the part's type

    @property
    def modality(self) -> str:
        """"image" or "audio"."""
        return "audio" if self.kind in AUDIO_PART_TYPES else "image"


@dataclass(slots=True)
class ImageInputs:
    """The image and audio parts of one request, in the order the chat template meets them."""

    refs: list[ImageRef] = field(default_factory=list)

    def add(self, part: Any, param: str, message_param: str) -> dict[str, str]:
        """Record an image part (chat's `image_url` or the Responses API's `input_image`) or an audio part
        (`input_audio`, `audio_url`); returns its template part. A Responses `file_id` is a 400: this server stores
        no files."""
        if part.type in AUDIO_PART_TYPES:
            value = getattr(part, part.type, None)  # InputAudio or AudioURL; absent from Responses parts
            field = "data" if part.type == "input_audio" else "url"
            self.refs.append(ImageRef(getattr(value, field, None), param, message_param, part.type))
            return {"type": "audio"}
        if getattr(part, "file_id", None) is not None:  # the Responses part's field (an extra field in chat)
            raise OpenAIError(400, f"{param}: file_id is not supported (this server stores no files); send the "
                                   "image as image_url (a data:image/...;base64 URL)", param=param)
        value = part.image_url  # chat: {"url": ...}; the Responses API: the URL itself
        url = value.url if isinstance(value, ImageURL) else value
        self.refs.append(ImageRef(url, param, message_param))
        return {"type": "image"}


def is_media_part(part: Any) -> bool:
    """Whether a content part is an image (chat's image_url or the Responses API's input_image) or an audio clip
    (input_audio, audio_url)."""
    return part.type in IMAGE_PART_TYPES + AUDIO_PART_TYPES


class ImageLoader:
    """Checks a request's image and audio parts against the model and loads them under the server's MediaPolicy, on
    threads of its own."""

    def __init__(self, policy: MediaPolicy, model_name: str, takes_images: bool, max_images: int,
                 takes_audio: bool = False, max_audio: int = DEFAULT_LIMIT, sampling_rate: int | None = None):
        self.policy = policy
        self.model_name = model_name
        self.takes_images = takes_images
        self.max_images = max_images  # model.limit_mm_per_prompt["image"]
        self.takes_audio = takes_audio
        self.max_audio = max_audio  # model.limit_mm_per_prompt["audio"]
        self.sampling_rate = sampling_rate  # the rate clips are decoded at: the model's feature extractor's
        self._pool = ThreadPoolExecutor(max_workers=LOADER_THREADS, thread_name_prefix="llmplug-media")

    @classmethod
    def for_engine(cls, engine: Any, model_name: str, policy: MediaPolicy | None = None) -> "ImageLoader":
        """The loader of a server on `engine`: whether its model takes images or audio, and its limits per prompt."""
        limits = engine.config.model.limit_mm_per_prompt
        processor = engine.llm_engine.processor.mm_processor  # None: a text-only model
        modality = processor.modality if processor is not None else None
        return cls(policy or MediaPolicy(), model_name, modality == "image", limits.get("image", DEFAULT_LIMIT),
                   modality == "audio", limits.get("audio", DEFAULT_LIMIT),
                   processor.sampling_rate if processor is not None else None)

    def check(self, images: ImageInputs) -> None:
        """400 naming the first part the model cannot take: images or audio to a model that takes none, too many,
        no URL (no data)."""
        if not images.refs:
            return
        first = images.refs[0]
        if not (self.takes_images or self.takes_audio):
            noun = "images" if first.modality == "image" else "audio"
            raise OpenAIError(400, f"{first.param}: the model {self.model_name} does not take {noun} (it is a "
                                   "text-only model); send text content only", param=first.message_param)
        self._check_modality([r for r in images.refs if r.modality == "image"], "image", self.takes_images,
                             self.max_images)
        self._check_modality([r for r in images.refs if r.modality == "audio"], "audio", self.takes_audio,
                             self.max_audio)
        for ref in images.refs:
            if not ref.url:
                raise OpenAIError(400, f"{ref.param}: {MISSING.get(ref.kind, MISSING['image_url'])}", param=ref.param)

    def _check_modality(self, refs: list[ImageRef], modality: str, takes: bool, limit: int) -> None:
        """400 when the model does not take `modality` or the parts are more than its limit per prompt."""
        if not refs:
            return
        noun = "images" if modality == "image" else "audio clips"
        if not takes:
            other = "audio" if modality == "image" else "images"
            raise OpenAIError(400, f"{refs[0].param}: the model {self.model_name} does not take {noun} (it takes "
                                   f"{other})", param=refs[0].message_param)
        if len(refs) > limit:
            raise OpenAIError(400, f"the request has {len(refs)} {noun}, more than the limit of {limit} per prompt "
                                   f"(--limit-mm-per-prompt '{{\"{modality}\": N}}')", param=refs[limit].param)

    async def load(self, images: ImageInputs) -> dict[str, list[Any]]:
        """The request's images and clips (`multi_modal_data`: each modality's items in order; empty without any),
        loaded on the loader's threads; checked first (`check`)."""
        self.check(images)
        if not images.refs:
            return {}
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._load_all, images.refs)

    def _load_all(self, refs: list[ImageRef]) -> dict[str, list[Any]]:
        loaded: dict[str, list[Any]] = {}
        try:
            for ref in refs:
                loaded.setdefault(ref.modality, []).append(self._load(ref))
        except InvalidRequestError as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from None
        return loaded

    def _load(self, ref: ImageRef) -> Any:
        if ref.kind == "input_audio":
            return load_input_audio(ref.url, self.policy, self.sampling_rate, ref.param)
        if ref.kind == "audio_url":
            return load_audio_url(ref.url, self.policy, self.sampling_rate, ref.param)
        return load_image_url(ref.url, self.policy, ref.param)

    def shutdown(self) -> None:
        """Stop the threads (loads already running finish first)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
