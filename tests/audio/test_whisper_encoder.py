"""The Whisper encoder block equals transformers' `WhisperEncoder` on the same weights and mel frames (float32),
loaded through its own `load_weights` under transformers' names (so the name map and Whisper's missing k_proj
bias are tested too)."""

from __future__ import annotations

import pytest
import torch
from transformers import WhisperConfig
from transformers.models.whisper.modeling_whisper import WhisperEncoder as HFWhisperEncoder

from llmplug.layers.audio import WhisperEncoder, whisper_encoder_config
from llmplug.layers.weight_utils import missing_parameters

SHAPE = dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, max_source_positions=50)


@pytest.fixture(scope="module", params=[80, 128], ids=["80-mels", "128-mels"])
def encoders(request) -> tuple[HFWhisperEncoder, WhisperEncoder]:
    torch.manual_seed(0)
    hf = HFWhisperEncoder(WhisperConfig(**SHAPE, num_mel_bins=request.param)).eval()
    ours = WhisperEncoder(whisper_encoder_config(hf.config))
    loaded = ours.load_weights(hf.state_dict().items())
    assert missing_parameters(ours, loaded) == []
    return hf, ours.eval()


def test_encoder_is_transformers_whisper_encoder(encoders) -> None:
    hf, ours = encoders
    mel = torch.randn(2, hf.config.num_mel_bins, 100, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(mel).last_hidden_state
        torch.testing.assert_close(ours(mel), expected, atol=1e-5, rtol=1e-5)
    assert expected.shape == (2, 50, 32)


def test_more_frames_than_the_window_are_refused(encoders) -> None:
    _, ours = encoders
    with pytest.raises(ValueError, match="exceed the encoder's window of 100"):
        ours(torch.zeros(1, ours.config.num_mel_bins, 102))
