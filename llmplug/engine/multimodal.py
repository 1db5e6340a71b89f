"""Images and audio clips in prompts (vLLM's `multi_modal_data`): their checks, their processing by the model's own
HF processor, and what the engine keeps of each one — a `MultiModalFeature`.

The processor (transformers' `AutoProcessor` of the model folder) resizes and normalizes the pixels and expands
each image placeholder of the prompt (LLaVA's `<image>`) into the image's tokens, so the prompt's token count is
final before the request is queued. Each image becomes a feature: its processor tensors, a content hash and the
span of placeholder tokens it fills. The engine never looks at the pixels again: the scheduler counts and chunks
the placeholders like any prompt tokens, the block hashes name them by the content hash, and the model runner puts
the encoder's output rows in the placeholders' place (engine/encoder_cache.py). An audio clip goes the same way
(`AudioProcessor`: the processor's feature extractor makes its log-mel frames and expands Qwen2-Audio's `<|AUDIO|>`);
a model takes one of the two.

Processing runs where the request is made: on the caller's thread for `LLM`, on a worker thread for `AsyncLLM`
(never on the event loop or the engine thread).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import torch

from llmplug.core.errors import ConfigError, InvalidRequestError, ModelLoadError

if TYPE_CHECKING:
    from PIL import Image

    from llmplug.core.config import EngineConfig

__all__ = [
    "AudioProcessor", "MultiModalFeature", "MultiModalProcessor", "accepted_processor_kwargs", "bidirectional_spans",
    "block_keys", "check_engine", "mm_processor_for", "span_safe", "to_image",
]

DEFAULT_LIMIT = 1  # items of a modality per prompt when limit_mm_per_prompt does not name it (vLLM's default)
LIMIT_FLAG = "model.limit_mm_per_prompt (--limit-mm-per-prompt)"
# processor outputs that are not the image's (mm_token_type_ids: which tokens are placeholders, Qwen2-VL's; labels:
# PaliGemma's, from its token_type_ids)
TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "labels"})
KWARGS_FLAG = "model.mm_processor_kwargs (--mm-processor-kwargs)"
# processor call arguments the engine sets itself: mm_processor_kwargs may not name them
RESERVED_KWARGS = frozenset({"text", "images", "audio", "videos", "return_tensors", "sampling_rate",
                             "return_text_replacement_offsets"})


@dataclass(slots=True, frozen=True, eq=False)
class MultiModalFeature:
    """One image or audio clip of a prompt, as the engine keeps it (vLLM's MultiModalFeatureSpec)."""

    modality: str  # "image" or "audio"
    identifier: str  # content hash of `data`: equal processed items, equal identifier (encoder cache, block hashes)
    data: dict[str, torch.Tensor]  # the processor's tensors for this item alone, e.g. pixel_values [1, 3, H, W]
    offset: int  # its first placeholder token in the prompt
    length: int  # tokens of its span, from its first placeholder to its last
    # which tokens of the span take the encoder's rows (vLLM's PlaceholderRange.is_embed): None when all do; an item
    # whose placeholders are split into runs by text tokens (Idefics3's tiles and their <row_i_col_j> tags) has one
    is_embed: torch.Tensor | None = None  # bool [length]

    @property
    def end(self) -> int:
        """One past its last placeholder token."""
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        """The rows `embed_multimodal` returns for it: its placeholder tokens."""
        return self.length if self.is_embed is None else int(self.is_embed.sum())

    def embed_runs(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(first token, one past the last, first encoder row) of each run of its placeholders within tokens
        [start, end) — a chunk may start or end anywhere inside the item."""
        lo, hi = max(start, self.offset), min(end, self.end)
        if lo >= hi:
            return []
        if self.is_embed is None:
            return [(lo, hi, lo - self.offset)]
        rows_before = torch.cumsum(self.is_embed, 0) - self.is_embed.long()  # [length]: rows before each token
        runs = []
        for run_lo, run_hi in _true_runs(self.is_embed[lo - self.offset : hi - self.offset].tolist()):
            runs.append((lo + run_lo, lo + run_hi, int(rows_before[lo - self.offset + run_lo])))
        return runs


def _true_runs(flags: list[bool]) -> list[tuple[int, int]]:
    """(start, end) of each run of True in `flags`."""
    runs, i = [], 0
    while i < len(flags):
        if flags[i]:
            j = i
            while j < len(flags) and flags[j]:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


def check_engine(config: EngineConfig, model: Any) -> None:
    """ConfigError when a multimodal model is run where its images cannot go: pipeline parallelism (the image rows
    enter at the first layer, on the first stage only) or speculative decoding (drafters read token ids)."""
    if not getattr(model, "supports_multimodal", False):
        return
    if config.parallel.pipeline_parallel_size > 1:
        raise ConfigError(f"{type(model).__name__} takes images, which pipeline parallelism does not carry yet "
                          "(parallel.pipeline_parallel_size > 1): run it with tensor parallelism or on one worker")
    if config.speculative_config.method is not None:
        raise ConfigError(f"{type(model).__name__} takes images, whose placeholder tokens the drafters of "
                          "speculative decoding cannot read: start without speculative_config")


def block_keys(features: list[MultiModalFeature] | None, start: int, end: int) -> tuple:
    """The extra keys of the block of tokens [start, end): (identifier, first placeholder of it in the block) of each
    item whose placeholders fall in it — the same tokens with another image are another block."""
    if not features:
        return ()
    return tuple((f.identifier, start - f.offset) for f in features if f.offset < end and f.end > start)


def bidirectional_spans(kind: str | None, features: list[MultiModalFeature] | None,
                        num_prompt_tokens: int) -> list[tuple[int, int]]:
    """(first token, one past the last) of each run of prompt tokens that attend to one another both ways in a model
    declaring `bidirectional_spans`: "image", each run of an image's placeholders (Gemma 3: the image, and each of
    its pan-and-scan crops apart, never the text between them, as transformers groups consecutive image tokens);
    "prompt", the whole prompt (PaliGemma's prefix); None, none. The scheduler never splits one across steps, nor a
    prefix-cache hit ends inside one."""
    if kind is None:
        return []
    if kind == "image":
        return [(lo, hi) for f in features or () for lo, hi, _ in f.embed_runs(f.offset, f.end)]
    if kind == "prompt":
        return [(0, num_prompt_tokens)]
    raise ValueError(f"bidirectional_spans={kind!r} is not one of 'image', 'prompt'")


def span_safe(spans: list[tuple[int, int]], num_tokens: int, block_size: int) -> int:
    """The longest prefix of whole blocks, at most `num_tokens` tokens, that ends inside no span (a cache hit that
    would end inside one is cut back to the block holding the span's start: the span is computed whole)."""
    for start, end in spans:
        if start < num_tokens < end:
            return start // block_size * block_size
    return num_tokens


def to_image(value: Any, where: str) -> Image.Image:
    """A PIL image (RGB) from a PIL image, a numpy [H, W, C] uint8 array or a torch [C, H, W] / [H, W, C] tensor."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB") if value.mode != "RGB" else value
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dim() == 3 and value.shape[0] in (1, 3, 4) and value.shape[-1] not in (1, 3, 4):
            value = value.permute(1, 2, 0)  # CHW -> HWC
        value = value.numpy()
    if not isinstance(value, np.ndarray):
        raise InvalidRequestError(
            f"{where} is a {type(value).__name__}; an image must be a PIL image, a numpy [H, W, C] uint8 array or a "
            "torch [C, H, W] tensor", param="multi_modal_data")
    return Image.fromarray(_uint8_hwc(value, where)).convert("RGB")


def _uint8_hwc(array: np.ndarray, where: str) -> np.ndarray:
    """An [H, W, C] uint8 array (C 1, 3 or 4), from uint8 or [0, 1] floats; InvalidRequestError otherwise."""
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[-1] not in (1, 3, 4) or 0 in array.shape:
        raise InvalidRequestError(f"{where} has shape {list(array.shape)}; an image array is [H, W, C] with C 1, 3 "
                                  "or 4 (or [C, H, W] as a torch tensor)", param="multi_modal_data")
    if array.dtype.kind == "f":
        if not np.isfinite(array).all() or array.min() < 0 or array.max() > 1:
            raise InvalidRequestError(f"{where}: a float image must hold values in [0, 1]", param="multi_modal_data")
        array = np.round(array * 255)
    elif array.dtype != np.uint8:
        raise InvalidRequestError(f"{where} has dtype {array.dtype}; an image array is uint8 or float in [0, 1]",
                                  param="multi_modal_data")
    array = array.astype(np.uint8)
    return array[:, :, 0] if array.shape[-1] == 1 else array


def content_hash(data: dict[str, torch.Tensor]) -> str:
    """A digest of an item's processed tensors (names, dtypes, shapes and bytes): identical images, identical hash."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(data):
        tensor = data[name].contiguous()
        h.update(f"{name}:{tensor.dtype}:{list(tensor.shape)};".encode())
        h.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()


def mm_processor_for(model_path: str, info: dict[str, Any], limits: dict[str, int], trust_remote_code: bool = False,
                     processor_kwargs: Mapping[str, Any] | None = None,
                     hf_processor: Any | None = None) -> "MultiModalProcessor | None":
    """The processor of a model that reported `info` (a worker's model_info): an image model's, an audio model's
    (its `audio_token_id`), or None for a text-only model. `processor_kwargs`: model.mm_processor_kwargs;
    `hf_processor`: the family's own processing (None: transformers' AutoProcessor of the folder)."""
    if info.get("image_token_id") is not None:
        return MultiModalProcessor(model_path, info["image_token_id"], limits, trust_remote_code, processor_kwargs,
                                   hf_processor)
    if info.get("audio_token_id") is not None:
        return AudioProcessor(model_path, info["audio_token_id"], limits, trust_remote_code, processor_kwargs,
                              hf_processor)
    return None


def accepted_processor_kwargs(hf_processor: Any) -> frozenset[str]:
    """The keyword arguments an HF processor's call takes, as transformers' `ProcessorMixin._merge_kwargs` routes
    them: its own (`valid_processor_kwargs`) and each modality's, the sub-processors' `valid_kwargs` included.
    transformers ignores any other name with a warning, so the engine checks names against this first."""
    typed = getattr(hf_processor, "valid_processor_kwargs", None)
    if typed is None:
        return frozenset()
    names = set(typed.__annotations__)
    for modality, attribute in (("text_kwargs", "tokenizer"), ("images_kwargs", "image_processor"),
                                ("audio_kwargs", "feature_extractor"), ("videos_kwargs", "video_processor")):
        names |= set(getattr(typed.__annotations__.get(modality), "__annotations__", {}))
        sub = getattr(hf_processor, attribute, None)
        names |= set(getattr(getattr(sub, "valid_kwargs", None), "__annotations__", {}))
    return frozenset(names - RESERVED_KWARGS)


class MultiModalProcessor:
    """The model's own HF processor, run on a request's text (or token ids) and images.

    `token_id`: the placeholder token the processor expands each item into (config `image_token_index` /
    `image_token_id`); `limits`: the most items of each modality per prompt."""

    modality = "image"  # what the model takes; AudioProcessor: "audio"
    noun = "images"  # its items, in messages
    sampling_rate: int | None = None  # the rate clips are decoded at (AudioProcessor's); None: the model takes none

    def __init__(self, model_path: str, token_id: int, limits: dict[str, int], trust_remote_code: bool = False,
                 processor_kwargs: Mapping[str, Any] | None = None, hf_processor: Any | None = None) -> None:
        # `hf_processor`: the model family's own (its `build_hf_processor`), for a family transformers has none for
        if hf_processor is None:
            hf_processor = self._auto_processor(model_path, trust_remote_code)
        self.hf_processor = hf_processor
        self.token_id = token_id
        self.limits = limits
        self.accepted_kwargs = accepted_processor_kwargs(self.hf_processor)
        unknown = self._unknown_kwargs(processor_kwargs or {})
        if unknown:
            raise ConfigError(f"{KWARGS_FLAG} names {unknown}, which {type(self.hf_processor).__name__} does not "
                              f"take; it takes {sorted(self.accepted_kwargs)}")
        self.processor_kwargs = dict(processor_kwargs or {})  # the engine's defaults of every call
        self._lock = threading.Lock()  # a processor and its tokenizer are not documented as thread-safe

    @staticmethod
    def _auto_processor(model_path: str, trust_remote_code: bool) -> Any:
        """transformers' `AutoProcessor` of the folder, with the PIL image processors (the torchvision ones need
        torchvision, which llmplug does not require)."""
        from transformers import AutoProcessor

        try:
            return AutoProcessor.from_pretrained(model_path, backend="pil", trust_remote_code=trust_remote_code)
        except (ImportError, ValueError) as error:  # a processor transformers builds only with torchvision's classes
            # an image processor that exists for torchvision only (Llama 4's) is refused with a ValueError naming it
            if isinstance(error, ValueError) and "torchvision" not in str(error):
                raise
            raise ModelLoadError(
                f"{model_path}: the model's processor cannot be loaded here ({error}); transformers builds some "
                "processors (Qwen2-VL's, InternVL's, Pixtral's and Llama 4's among them) only with torchvision "
                "installed, for their video or image processor classes: install the torchvision release built for "
                "your torch"
            ) from error

    @property
    def placeholder(self) -> str:
        """The text a prompt holds once per image (get_placeholder_str in vLLM): LLaVA's `<image>`."""
        return self.hf_processor.image_token

    def items_of(self, mm_data: Any) -> list[Any]:
        """The request's items of the model's modality, checked (modality, count, type) before any processing."""
        if not isinstance(mm_data, dict):
            raise InvalidRequestError(f"multi_modal_data must be a dict such as {{'{self.modality}': ...}}, got "
                                      f"{type(mm_data).__name__}", param="multi_modal_data")
        unknown = sorted(set(mm_data) - {self.modality})
        if unknown:
            raise InvalidRequestError(f"multi_modal_data holds {unknown}; this model takes {[self.modality]}",
                                      param="multi_modal_data")
        items = self._as_list(mm_data.get(self.modality, []))
        limit = self.limits.get(self.modality, DEFAULT_LIMIT)
        if len(items) > limit:
            raise InvalidRequestError(
                f"the prompt has {len(items)} {self.noun}, but at most {limit} are allowed per prompt; "
                f"raise {LIMIT_FLAG}, e.g. '{{\"{self.modality}\": {len(items)}}}'", param="multi_modal_data")
        return [self.to_item(item, f"multi_modal_data['{self.modality}'][{i}]") for i, item in enumerate(items)]

    def to_item(self, value: Any, where: str) -> Any:
        """One item as the HF processor takes it: a PIL image in RGB."""
        return to_image(value, where)

    @staticmethod
    def _as_list(value: Any) -> list[Any]:
        """The items of `multi_modal_data[modality]`: one item, or a list (or tuple) of them."""
        return list(value) if isinstance(value, (list, tuple)) else [value]

    def _unknown_kwargs(self, kwargs: Mapping[str, Any]) -> list[str]:
        return sorted(name for name in kwargs if name not in self.accepted_kwargs)

    def call_kwargs(self, request_kwargs: Any) -> dict[str, Any]:
        """The processor call's keyword arguments for a request: the engine's (model.mm_processor_kwargs) updated by
        the request's own `mm_processor_kwargs` (vLLM's), whose names must be the processor's; InvalidRequestError
        naming any other."""
        if request_kwargs is None:
            return self.processor_kwargs
        if not isinstance(request_kwargs, Mapping):
            raise InvalidRequestError(f"mm_processor_kwargs must be a dict such as {{\"do_pan_and_scan\": true}}, got "
                                      f"{type(request_kwargs).__name__}", param="mm_processor_kwargs")
        unknown = self._unknown_kwargs(request_kwargs)
        if unknown:
            raise InvalidRequestError(
                f"mm_processor_kwargs names {unknown}, which this model's processor "
                f"({type(self.hf_processor).__name__}) does not take; it takes {sorted(self.accepted_kwargs)}",
                param="mm_processor_kwargs")
        return {**self.processor_kwargs, **request_kwargs}

    def process(self, text: str | None, token_ids: list[int] | None, items: list[Any],
                request_kwargs: Mapping[str, Any] | None = None,
                add_special_tokens: bool = True) -> tuple[list[int], list[MultiModalFeature]]:
        """(prompt token ids with each item's placeholders expanded, one feature per item in prompt order);
        `request_kwargs`: the request's `mm_processor_kwargs` (`call_kwargs`); `add_special_tokens` False for a
        text that holds them already (a rendered chat template: no second BOS)."""
        kwargs = self.call_kwargs(request_kwargs)
        if not items:
            ids = token_ids if token_ids is not None else self._tokenize(text, add_special_tokens)
            return ids, []
        call_text = text if token_ids is None else self.placeholder * len(items)
        call_kwargs = kwargs if add_special_tokens or token_ids is not None else {**kwargs, "add_special_tokens": False}
        with self._lock:
            out = self._call_with_items(call_text, items, call_kwargs)
            if token_ids is None:
                ids = out["input_ids"][0].tolist()
            else:  # token ids: each single placeholder becomes the run the processor makes of it
                ids = self._expand(token_ids, out["input_ids"][0].tolist(), items, kwargs)
            tensors = {k: v for k, v in out.items() if k not in TEXT_KEYS and torch.is_tensor(v)}
            runs = _true_runs([t == self.token_id for t in ids])
            # an item as several runs of placeholders, or a prompt's tiles in one row: ask the processor whose is
            # which
            laid_out = len(runs) == len(items) and all(t.shape[0] == len(items) for t in tensors.values())
            counts = None if laid_out else self._counts(items, kwargs, call_text, runs, tensors)
        spans = self._spans(runs, ids, len(items), counts and counts["tokens"])
        data = _split_items(tensors, len(items), counts and counts["rows"])
        features = [MultiModalFeature(self.modality, content_hash(d), d, offset, length, is_embed)
                    for d, (offset, length, is_embed) in zip(data, spans)]
        return ids, features

    def _call_with_items(self, text: str, items: list[Any], kwargs: Mapping[str, Any]) -> Any:
        return self._call(text=[text], images=items, **kwargs)

    def _counts(self, images: list[Any], kwargs: Mapping[str, Any], text: str, runs: list[tuple[int, int]],
                tensors: dict[str, torch.Tensor]) -> dict[str, list[int] | None] | None:
        """Each image's placeholder tokens ("tokens") and tiles ("rows") as the processor reckons them (transformers'
        `_get_num_multimodal_tokens`), for prompts where an image is several runs of placeholders or several tiles;
        where its count misses placeholders the call made (Gemma 3's ignores pan-and-scan crops), each image's own
        expansion (`_replacement_counts`); None when the processor does not tell."""
        count = getattr(self.hf_processor, "_get_num_multimodal_tokens", None)
        if count is None:
            return None
        try:
            data = count(image_sizes=[(image.height, image.width) for image in images], **kwargs)
        except (NotImplementedError, TypeError, ValueError, KeyError, AttributeError):
            return None  # not implemented for this processor's options: the runs alone decide, or the prompt is refused
        tokens, patches = getattr(data, "num_image_tokens", None), getattr(data, "num_image_patches", None)
        if tokens is None or patches is None:
            return None
        counts = {"tokens": list(tokens), "rows": list(patches)}
        if sum(tokens) != sum(end - start for start, end in runs):
            return self._replacement_counts(text, images, kwargs, len(runs), tensors, list(patches)) or counts
        return counts

    def _replacement_counts(self, text: str, images: list[Any], kwargs: Mapping[str, Any], num_runs: int,
                            tensors: dict[str, torch.Tensor], rows: list[int]) -> dict[str, list[int] | None] | None:
        """Each image's placeholders, read from the text the processor put in its place (`return_text_replacement_
        offsets`); its tiles are its runs of placeholders when the tensors hold one row per run (Gemma 3's image and
        pan-and-scan crops), else `rows`. None when the processor does not report its replacements."""
        out = self._call(text=[text], images=images, **kwargs, return_text_replacement_offsets=True)
        offsets = out.get("text_replacement_offsets")
        if not offsets or len(offsets[0]) != len(images):
            return None
        encoded = [self._tokenize_plain(item["replacement"]) for item in offsets[0]]
        tokens = [ids.count(self.token_id) for ids in encoded]
        runs = [len(_true_runs([t == self.token_id for t in ids])) for ids in encoded]
        one_row_per_run = all(t.shape[0] == num_runs for t in tensors.values())
        return {"tokens": tokens, "rows": runs if one_row_per_run else rows}

    def _tokenize_plain(self, text: str) -> list[int]:
        return list(self.hf_processor.tokenizer.encode(text, add_special_tokens=False))

    def _call(self, **kwargs: Any) -> Any:
        from huggingface_hub.errors import StrictDataclassError  # transformers' check of a kwarg's type raises it

        try:
            return self.hf_processor(**kwargs, return_tensors="pt")
        except (ValueError, TypeError, OSError, StrictDataclassError) as error:  # e.g. fewer placeholders than images
            raise InvalidRequestError(f"the model's processor refused the prompt: {error}",
                                      param="multi_modal_data") from None

    def _tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf_processor.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _expand(self, token_ids: list[int], processed: list[int], images: list[Image.Image],
                kwargs: Mapping[str, Any]) -> list[int]:
        """`token_ids` whose single placeholders are replaced by the processor's expansion of one image each (each
        image's own count: anyres images of other sizes expand to other counts); ids expanded already (as many
        placeholders as the processor makes) are kept."""
        num_images, num_expanded = len(images), processed.count(self.token_id)
        if token_ids.count(self.token_id) == num_expanded:
            return list(token_ids)
        if token_ids.count(self.token_id) != num_images:
            raise InvalidRequestError(
                f"prompt_token_ids hold {token_ids.count(self.token_id)} {self.modality} placeholders (token "
                f"{self.token_id}), but {num_images} {self.modality} items were given: put one per item",
                param="prompt_token_ids")
        plain = self._tokenize(self.placeholder * num_images)
        if len(processed) - num_expanded != len(plain) - plain.count(self.token_id):
            raise InvalidRequestError(
                "this model's processor expands an image into placeholder and other tokens (tile tags, image "
                "delimiters), which a token-id prompt cannot be expanded into: send the prompt as text, or "
                "prompt_token_ids holding each image's expansion already", param="prompt_token_ids")
        lengths = iter(self._run_lengths(processed, images, kwargs))
        return [t for token in token_ids
                for t in ([self.token_id] * next(lengths) if token == self.token_id else [token])]

    def _run_lengths(self, processed: list[int], images: list[Image.Image], kwargs: Mapping[str, Any]) -> list[int]:
        """Each image's placeholder count in `processed` (the expansion of one placeholder per image, whose runs
        may touch): the runs themselves, else the processor's count, else equal parts."""
        runs = _true_runs([t == self.token_id for t in processed])
        if len(runs) == len(images):
            return [end - start for start, end in runs]
        total = sum(end - start for start, end in runs)
        counts = self._counts(images, kwargs, self.placeholder * len(images), runs, {})
        if counts is not None and counts["tokens"] is not None and sum(counts["tokens"]) == total:
            return counts["tokens"]
        if total % len(images):
            raise InvalidRequestError(
                f"the processor expanded {len(images)} images into {total} placeholders and does not say whose is "
                "which: send the prompt as text", param="prompt_token_ids")
        return [total // len(images)] * len(images)

    def _spans(self, runs: list[tuple[int, int]], ids: list[int], num_images: int,
               num_tokens: list[int] | None = None) -> list[tuple[int, int, torch.Tensor | None]]:
        """(offset, length, is_embed) of each image's span, from the (start, end) `runs` of placeholders in `ids`:
        one run per image; else the processor's count of each image's placeholders (`num_tokens`), each image's
        span then running from its first placeholder to its last, its text tokens masked out; else runs that touch
        split into equal parts (every image of the prompt expands alike)."""
        if len(runs) == num_images:
            return [(start, end - start, None) for start, end in runs]
        total = sum(end - start for start, end in runs)
        if num_tokens is not None and len(num_tokens) == num_images and sum(num_tokens) == total:
            return self._grouped_spans(ids, num_tokens)
        if len(runs) < num_images and total % num_images == 0:
            each = total // num_images
            return [(start + k * each, each, None) for start, end in runs for k in range((end - start) // each)]
        raise InvalidRequestError(
            f"the prompt holds {len(runs)} {self.modality} placeholder runs for {num_images} items: write the "
            f"placeholder {self.placeholder!r} once per item", param="multi_modal_data")

    def _grouped_spans(self, ids: list[int], num_tokens: list[int]) -> list[tuple[int, int, torch.Tensor | None]]:
        """Consecutive placeholders grouped `num_tokens[i]` to image i; each span's mask marks its placeholders."""
        ids_t = torch.tensor(ids)
        positions = (ids_t == self.token_id).nonzero().flatten().tolist()
        spans, first = [], 0
        for count in num_tokens:
            offset, end = positions[first], positions[first + count - 1] + 1
            is_embed = ids_t[offset:end] == self.token_id
            spans.append((offset, end - offset, None if bool(is_embed.all()) else is_embed))
            first += count
        return spans


class AudioProcessor(MultiModalProcessor):
    """The HF processor of an audio-language model (Qwen2-Audio's, AudioFlamingo3's), run on a request's text and
    audio clips: its feature extractor turns each clip, resampled to its rate, into log-mel frames (a window of them,
    or several for a long clip) and the processor expands each audio placeholder into the clip's tokens."""

    modality = "audio"
    noun = "audio clips"

    @property
    def placeholder(self) -> str:
        """The text a prompt holds once per clip: Qwen2-Audio's `<|AUDIO|>`, AudioFlamingo3's `<sound>`."""
        return self.hf_processor.audio_token

    @property
    def sampling_rate(self) -> int:
        """The feature extractor's samples per second (16 kHz for Whisper's)."""
        return int(self.hf_processor.feature_extractor.sampling_rate)

    def to_item(self, value: Any, where: str) -> np.ndarray:
        """One clip, mono float32 at the feature extractor's rate (vLLM's `(samples, rate)` or samples alone)."""
        from llmplug.multimodal.audio import to_audio

        return to_audio(value, self.sampling_rate, where)

    @staticmethod
    def _as_list(value: Any) -> list[Any]:
        """One clip (an array, or vLLM's `(samples, rate)` tuple), or a list of them."""
        return list(value) if isinstance(value, list) else [value]

    def _call_with_items(self, text: str, items: list[Any], kwargs: Mapping[str, Any]) -> Any:
        return self._call(text=[text], audio=items, sampling_rate=self.sampling_rate, **kwargs)

    def _counts(self, items: list[Any], *_: Any) -> dict[str, list[int] | None]:
        """Each clip's windows of `chunk_length` seconds (its rows of the processor's frames: AudioFlamingo3 cuts a
        long clip into several); its placeholders are one run, so their count is the runs'."""
        chunk_length = self.hf_processor.feature_extractor.chunk_length
        most = getattr(self.hf_processor, "max_audio_len", None)  # AudioFlamingo3's: longer clips are cut
        windows = [max(1, -(-len(clip) // (chunk_length * self.sampling_rate))) for clip in items]
        return {"tokens": None, "rows": [min(w, int(most // chunk_length)) if most else w for w in windows]}


def _split_items(tensors: dict[str, torch.Tensor], num_items: int,
                 num_tiles: list[int] | None = None) -> list[dict[str, torch.Tensor]]:
    """Each item's own slice of the processor's batched tensors: one row per item along the first dimension, or,
    for a processor that lays one prompt's tiles out along the second ([1, tiles, ...], Idefics3's), each item's
    `num_tiles` of them (kept as [1, its tiles, ...]), or along the first (all items' patches in one run
    [patches, ...], Qwen2-VL's), each item's `num_tiles` rows."""
    items: list[dict[str, torch.Tensor]] = [{} for _ in range(num_items)]
    for name, tensor in tensors.items():
        if tensor.shape[0] == num_items:
            parts = tensor.split(1)
        elif tensor.shape[0] == 1 and tensor.dim() > 1 and num_tiles and sum(num_tiles) == tensor.shape[1]:
            parts = tensor.split(num_tiles, dim=1)
        elif num_tiles and sum(num_tiles) == tensor.shape[0]:
            parts = tensor.split(num_tiles)
        else:
            raise InvalidRequestError(f"the processor's {name} has {tensor.shape[0]} rows for {num_items} items; "
                                      "this model's processor is not supported", param="multi_modal_data")
        for item, part in zip(items, parts):
            item[name] = part.contiguous()
    return items


IMAGE_PART_TYPES = ("image_url", "image_pil", "image")  # OpenAI's, and vLLM's offline forms
AUDIO_PART_TYPES = ("input_audio", "audio_url")  # OpenAI's, and vLLM's


def has_media_parts(conversation: list[dict[str, Any]]) -> bool:
    """True when a message's content lists an image or audio part."""
    kinds = IMAGE_PART_TYPES + AUDIO_PART_TYPES
    return any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") in kinds
                                                          for p in m["content"]) for m in conversation)


def split_chat_media(conversation: list[dict[str, Any]],
                     sampling_rate: int | None = None) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """(the conversation with each image part as {"type": "image"} and each audio part as {"type": "audio"}, the
    items of each modality in order: images, and clips decoded at `sampling_rate`). URL parts are read by the server's
    media loader (llmplug.multimodal.media) under its default policy: data URLs only offline."""
    messages, items = [], {"image": [], "audio": []}
    for message in conversation:
        content = message.get("content")
        if not isinstance(content, list):
            messages.append(message)
            continue
        parts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PART_TYPES:
                items["image"].append(_part_image(part, kind, f"content[{i}]"))
                parts.append({"type": "image"})
            elif kind in AUDIO_PART_TYPES:
                items["audio"].append(_part_audio(part, kind, f"content[{i}]", sampling_rate))
                parts.append({"type": "audio"})
            else:
                parts.append(part)
        messages.append({**message, "content": parts})
    return messages, {modality: found for modality, found in items.items() if found}


def _part_audio(part: dict[str, Any], kind: str, where: str, sampling_rate: int | None) -> np.ndarray:
    """The clip of an `input_audio` ({"data": base64, "format": ...}) or `audio_url` ({"url": ...}) part."""
    from llmplug.multimodal.media import MediaPolicy, load_audio_url, load_input_audio

    value = part.get(kind)
    field = "data" if kind == "input_audio" else "url"
    text = value.get(field) if isinstance(value, dict) else value if kind == "audio_url" else None
    if not isinstance(text, str):
        raise InvalidRequestError(f"{where}: an {kind} part needs {{'{kind}': {{'{field}': ...}}}}", param="messages")
    if kind == "input_audio":
        return load_input_audio(text, MediaPolicy(), sampling_rate, param=f"{where}.input_audio")
    return load_audio_url(text, MediaPolicy(), sampling_rate, param=f"{where}.audio_url")


def _part_image(part: dict[str, Any], kind: str, where: str) -> Image.Image:
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str):
            raise InvalidRequestError(f"{where}: an image_url part needs {{'image_url': {{'url': ...}}}}",
                                      param="messages")
        from llmplug.multimodal.media import MediaPolicy, load_image_url

        return load_image_url(url, MediaPolicy(), param=f"{where}.image_url")
    if kind not in part:
        raise InvalidRequestError(f"{where}: a part of type {kind!r} needs the image under {kind!r}", param="messages")
    return to_image(part[kind], f"{where}.{kind}")


def flatten_media_parts(messages: list[dict[str, Any]], placeholder: str) -> list[dict[str, Any]]:
    """Messages whose list contents are one string, each image or audio part as `placeholder` (for a text chat
    template)."""
    def text(content: Any) -> Any:
        if not isinstance(content, list):
            return content
        return "".join(placeholder if p.get("type") in ("image", "audio") else str(p.get("text", "")) for p in content)

    return [{**m, "content": text(m.get("content"))} for m in messages]
