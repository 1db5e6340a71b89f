"""The multimodal config fields: vLLM's `--limit-mm-per-prompt` JSON flag, and the encoder budgets."""

from __future__ import annotations

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
