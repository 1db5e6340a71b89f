"""Every Whisper size is data: the config adapter builds each one (on the meta device, no weights), with transformers'
own model of the same config as the reference — every checkpoint tensor of it loads into ours by name and shape,
every parameter of ours is loaded, and the parameter counts agree (ours holds one more bias per self-attention: the
zero key bias of its fused q/k/v)."""

from __future__ import annotations

import pytest
import torch
from transformers import WhisperConfig
from transformers import WhisperForConditionalGeneration as HFWhisper

from llmplug.layers.weight_utils import missing_parameters
from llmplug.plugins.models.whisper import WhisperForConditionalGeneration

LARGE = dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20, decoder_attention_heads=20,
             encoder_ffn_dim=5120, decoder_ffn_dim=5120, num_mel_bins=128, vocab_size=51866)
# the shapes of openai/whisper-* and distil-whisper's config.json files
SIZES = {
    "tiny": dict(d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
                 decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536, vocab_size=51865),
    "large-v3": dict(LARGE, decoder_layers=32),
    "large-v3-turbo": dict(LARGE, decoder_layers=4),
    "distil-large-v3": dict(LARGE, decoder_layers=2),
}


@pytest.mark.parametrize("size", SIZES)
def test_every_whisper_size_loads_transformers_tensors_whole(size: str) -> None:
    config = WhisperConfig(**SIZES[size])
    with torch.device("meta"):
        hf, ours = HFWhisper(config), WhisperForConditionalGeneration(config=config)
        loaded = ours.load_weights(hf.state_dict().items())
    assert missing_parameters(ours, loaded) == []
    assert len(ours.model.decoder.layers) == config.decoder_layers
    assert ours.model.encoder.conv1.in_channels == config.num_mel_bins
    num_self_attentions = config.encoder_layers + config.decoder_layers
    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731 (a tied table once)
    assert count(ours) == count(hf) + num_self_attentions * config.d_model
