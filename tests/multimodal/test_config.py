"""The multimodal config fields: vLLM's `--limit-mm-per-prompt` JSON flag, and the encoder budgets."""

from __future__ import annotations

import importlib.util
import json

import pytest

from llmplug.core.config import load_config
from llmplug.core.errors import ConfigError


def test_limit_mm_per_prompt_flag_is_json_like_vllms():
    config = load_config(cli={"limit_mm_per_prompt": '{"image": 3}'}).config
    assert config.model.limit_mm_per_prompt == {"image": 3}
    assert load_config(kwargs={"limit_mm_per_prompt": {"image": 0}}).config.model.limit_mm_per_prompt == {"image": 0}


@pytest.mark.parametrize("value, message", [("{image: 2}", "not JSON"), ({"image": -1}, "0 or more")])
def test_bad_limits_name_the_field(value, message):
    with pytest.raises(ConfigError, match=f"model.limit_mm_per_prompt.*{message}"):
        load_config(kwargs={"limit_mm_per_prompt": value})


def test_encoder_budget_fields_have_vllms_names():
    config = load_config(kwargs={"max_num_encoder_input_tokens": 1024, "encoder_cache_size": 4096}).config
    assert (config.scheduler.max_num_encoder_input_tokens, config.scheduler.encoder_cache_size) == (1024, 4096)


def test_a_processor_that_needs_torchvision_is_a_load_error_that_says_so(tmp_path):
    """Qwen2-VL's processor comes with a video processor transformers builds only with torchvision (absent here)."""

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from llmplug.core.errors import ModelLoadError
    from llmplug.engine.multimodal import MultiModalProcessor
    from tests.models.tiny_models import train_llama_tokenizer

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: the processor loads")
    tokenizer = train_llama_tokenizer(tmp_path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|image_pad|>", "<|video_pad|>"]})
    tokenizer.save_pretrained(tmp_path)
    Qwen2VLImageProcessorPil().save_pretrained(tmp_path)
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    with pytest.raises(ModelLoadError, match="processor cannot be loaded here.*install the torchvision release"):
        MultiModalProcessor(str(tmp_path), token_id=0, limits={"image": 1})
