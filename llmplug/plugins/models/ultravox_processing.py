"""Ultravox's processing, which transformers has no class for: a model folder's WhisperFeatureExtractor
(preprocessor_config.json) and tokenizer, doing what Ultravox's own processor does with them.

Each clip (at least two hops of samples) becomes its log-mel frames alone, unpadded; a clip longer than the
encoder's window (30 s) is cut into windows of its frames, the last one shorter. A window of n valid frames takes
ceil(n / (2 * stack_factor)) placeholder tokens (the encoder halves the frames, the projector stacks
`stack_factor` states into one token: 6.25 tokens a second for Whisper with stack_factor 8). The text is split at
each `<|audio|>`, its parts tokenized without special tokens, and each placeholder becomes the run of
`audio_token_index` its clip's windows take; a plain text prompt gets the tokenizer's BOS first, as every llmplug
text prompt does (a chat template's rendering holds its own).

The tensors handed to the model are each window's frames, zero-padded to the window (`input_features`
[windows, n_mels, window frames]), and its valid frames (`audio_lens` [windows]).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
from transformers import PretrainedConfig

from llmplug.core.errors import ModelLoadError

__all__ = ["PLACEHOLDER", "UltravoxProcessor"]

PLACEHOLDER = "<|audio|>"  # what a prompt holds once per clip
ENCODER_STRIDE = 2  # the Whisper encoder's second convolution halves the frames


class UltravoxProcessor:
    """A text prompt and its clips -> the prompt's token ids (each placeholder expanded) and each clip's window
    frames; called as an HF processor is (`text=[...]`, `audio=[...]`, `sampling_rate`)."""

    audio_token = PLACEHOLDER

    def __init__(self, feature_extractor: Any, tokenizer: Any, audio_token_id: int, stack_factor: int,
                 window_frames: int) -> None:
        self.feature_extractor = feature_extractor
        self.tokenizer = tokenizer
        self.audio_token_id = audio_token_id
        self.tokens_per_frame = ENCODER_STRIDE * stack_factor  # mel frames per placeholder token
        self.window_frames = window_frames

    @classmethod
    def from_pretrained(cls, model_path: str, config: PretrainedConfig) -> "UltravoxProcessor":
        """The folder's feature extractor and tokenizer; ModelLoadError when its windows are not the encoder's."""
        from transformers import AutoTokenizer, WhisperFeatureExtractor

        try:
            extractor = WhisperFeatureExtractor.from_pretrained(model_path, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(model_path, config=config, local_files_only=True)
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"{model_path}: Ultravox's processing needs the folder's preprocessor_config.json "
                                 f"(a WhisperFeatureExtractor) and tokenizer: {error}") from error
        window = 2 * config.audio_config.max_source_positions
        if extractor.nb_max_frames != window:
            raise ModelLoadError(f"{model_path}: the feature extractor's {extractor.chunk_length} s windows are "
                                 f"{extractor.nb_max_frames} frames, the audio encoder's {window}: they must agree")
        return cls(extractor, tokenizer, int(config.audio_token_index), int(config.stack_factor), window)

    def __call__(self, text: Sequence[str], audio: Sequence[np.ndarray], sampling_rate: int,
                 return_tensors: str = "pt", add_special_tokens: bool = True) -> dict[str, torch.Tensor]:
        """`text`: one prompt; `audio`: its clips (mono float32 at `sampling_rate`) -> input_ids [1, tokens],
        input_features [windows, n_mels, window frames], audio_lens [windows]. ValueError when the prompt's
        placeholders and clips differ in number. `add_special_tokens`: the tokenizer's BOS first, as every llmplug
        text prompt gets (Ultravox's own processor adds none; a rendered chat template holds it: False)."""
        if return_tensors != "pt":
            raise ValueError(f"return_tensors={return_tensors!r}: Ultravox's processing returns torch tensors ('pt')")
        (prompt,) = text
        parts = prompt.split(PLACEHOLDER)
        if len(parts) - 1 != len(audio):
            raise ValueError(f"the prompt holds {len(parts) - 1} {PLACEHOLDER} placeholders for {len(audio)} clips: "
                             "write the placeholder once per clip")
        windows = [self.clip_windows(clip, sampling_rate) for clip in audio]
        ids = [self.tokenizer.bos_token_id] if add_special_tokens and self.tokenizer.bos_token_id is not None else []
        for i, part in enumerate(parts):
            ids += self.tokenizer.encode(part, add_special_tokens=False) if part else []
            if i < len(windows):
                ids += [self.audio_token_id] * sum(self.num_tokens(frames) for _, frames in windows[i])
        features = [window for clip in windows for window, _ in clip]
        lens = [frames for clip in windows for _, frames in clip]
        return {"input_ids": torch.tensor([ids]), "input_features": torch.stack(features),
                "audio_lens": torch.tensor(lens)}

    def num_tokens(self, frames: int) -> int:
        """Placeholder tokens of a window of `frames` valid mel frames."""
        return -(-frames // self.tokens_per_frame)

    def clip_windows(self, clip: np.ndarray, sampling_rate: int) -> list[tuple[torch.Tensor, int]]:
        """(frames zero-padded to the window [n_mels, window frames], valid frames) of each window of one clip."""
        hop = self.feature_extractor.hop_length
        clip = np.pad(clip, (0, max(0, 2 * hop - len(clip))))  # the feature extractor needs two hops
        out = self.feature_extractor(clip, sampling_rate=sampling_rate, padding="longest", pad_to_multiple_of=hop,
                                     truncation=False, return_attention_mask=True, return_tensors="pt")
        frames = out["input_features"][0]  # [n_mels, frames]
        valid = int(out["attention_mask"][0].sum())
        windows = []
        for start in range(0, valid, self.window_frames):
            window = frames[:, start : min(valid, start + self.window_frames)]
            windows.append((torch.nn.functional.pad(window, (0, self.window_frames - window.shape[1])),
                            window.shape[1]))
        return windows
