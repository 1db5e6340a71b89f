"""Each engine owns the plugin registry its config builds: two engines in one process with different plugin
configs both work as configured, and `LLM(config=EngineConfig(...))` applies the allow-list like any other config."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmplug import LLM, SamplingParams
from llmplug.core.config import EngineConfig, LoadConfig, ModelConfig, PluginConfig
from llmplug.core.plugins import PluginNotFoundError
from tests.engine.test_llm import generate_ids, hf_greedy
from tests.models.tiny_models import make_tiny
from tests.plugin_examples import example_site_fixtures, save_as_npz

LOADER_DIST, HOOKS_DIST = "llmplug-example-toy-loader", "llmplug-example-toy-hooks"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 17, 9], [200, 3, 41]]
ENGINE = {"dtype": "float32", "skip_tokenizer_init": True, "block_size": 4}


site, installed = example_site_fixtures(["toy_loader", "toy_hooks"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def npz_model(tiny, tmp_path_factory) -> Path:
    """The tiny Llama's config.json and its weights as weights.npz (what the toy loader reads)."""
    return save_as_npz(tiny, tmp_path_factory.mktemp("npz_model"))


def test_two_engines_with_different_plugin_configs_both_work_as_configured(installed, tiny, npz_model):
    import llmplug_example_toy_hooks as toy_hooks

    expected = [hf_greedy(tiny.hf_model, p, GREEDY.max_tokens) for p in PROMPTS]
    with_plugins = LLM(str(npz_model), load_format="npz", plugins={"enabled": [LOADER_DIST, HOOKS_DIST]}, **ENGINE)
    # built second: under a process-wide registry it would replace the first engine's plugins
    without = LLM(str(tiny.path), plugins={"enabled": ["some-other-dist"]}, **ENGINE)
    toy_hooks.EVENTS.clear()
    assert generate_ids(without, PROMPTS, GREEDY) == expected
    assert toy_hooks.EVENTS == []  # its hooks plugin is not allowed there
    assert generate_ids(with_plugins, PROMPTS, GREEDY) == expected  # the npz loader's engine still runs
    assert [event for event, _ in toy_hooks.EVENTS].count("finished") == len(PROMPTS)  # and its hooks fire
    with pytest.raises(PluginNotFoundError, match=rf"not allowed: {LOADER_DIST}"):
        LLM(str(npz_model), load_format="npz", plugins={"enabled": ["some-other-dist"]}, **ENGINE)


def test_a_ready_engine_config_applies_its_allow_list(installed, npz_model):
    allowing = LLM(str(npz_model), load_format="npz", plugins={"enabled": [LOADER_DIST]}, **ENGINE)
    config = EngineConfig(model=ModelConfig(model=str(npz_model), dtype="float32", skip_tokenizer_init=True),
                          load=LoadConfig(format="npz"), plugins=PluginConfig(enabled=["some-other-dist"]))
    with pytest.raises(PluginNotFoundError, match=rf"not allowed: {LOADER_DIST}"):
        LLM(config=config)  # its own allow-list, not the one of the engine built before it
    allowed = config.model_copy(update={"plugins": PluginConfig(enabled=[LOADER_DIST])})
    assert generate_ids(LLM(config=allowed), PROMPTS, GREEDY) == generate_ids(allowing, PROMPTS, GREEDY)
