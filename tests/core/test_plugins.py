"""The plugin registry, exercised with real example distributions (tests/plugins/*) installed by pip.

The examples are pip-installed once per session into a temporary --target directory that only these
tests put on sys.path (in-process via monkeypatch, in subprocesses via PYTHONPATH), so other test
files never see them.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from types import SimpleNamespace

import pluggy
import pytest
import yaml

from llmplug.core import hookspecs, plugins
from llmplug.core.config import EngineConfig, PluginConfig
from llmplug.core.errors import PluginConflictError, PluginError, PluginLoadError, PluginVersionError
from llmplug.core.plugins import (
    GROUPS,
    NAMED_GROUPS,
    PluginInfo,
    PluginNotFoundError,
    PluginRegistry,
    check_api_version,
    get_registry,
    load_plugin,
    set_registry,
)
from llmplug.core.protocols import PLUGIN_API_VERSION, Platform, VllmModelForTextGeneration
from tests.plugin_examples import EXAMPLES_DIR, pip_install_examples, run_python

IN_TREE_PLATFORMS = {"cpu", "cuda", "rocm", "tpu", "xpu"}
FANCY = ("llmplug.loaders", "fancy")


# --- installing the examples ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding every example distribution, installed by pip."""
    site = tmp_path_factory.mktemp("plugin_site")
    packages = sorted(path.name for path in EXAMPLES_DIR.iterdir() if (path / "pyproject.toml").is_file())
    pip_install_examples(packages, site, tmp_path_factory.mktemp("plugin_sources"))
    return site


@pytest.fixture
def installed(plugin_site: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The examples on sys.path for this test only, with no allow-list from the environment."""
    monkeypatch.syspath_prepend(str(plugin_site))
    monkeypatch.delenv(plugins.ENABLED_ENV, raising=False)
    return plugin_site


# --- groups and discovery --------------------------------------------------------------------------------


def test_groups_are_the_thirteen_of_the_design():
    assert set(GROUPS) == {
        "llmplug.platforms", "llmplug.loaders", "llmplug.models", "llmplug.guided_decoding",
        "llmplug.executors", "llmplug.attention", "llmplug.communicators", "llmplug.tool_parsers",
        "llmplug.reasoning_parsers", "llmplug.lora_resolvers", "llmplug.quantization", "llmplug.kv_connectors",
        "llmplug.hooks",
    }
    assert "llmplug.hooks" not in NAMED_GROUPS and len(NAMED_GROUPS) == 12
    assert all(description and "\n" not in description for description in GROUPS.values())


def test_in_tree_platforms_are_listed_as_builtin_even_with_an_empty_allow_list(installed):
    registry = PluginRegistry(enabled=[])
    infos = [info for info in registry.infos("llmplug.platforms") if info.name in IN_TREE_PLATFORMS]
    assert {info.name for info in infos} == IN_TREE_PLATFORMS
    assert all(info.builtin and info.distribution == "llmplug" for info in infos)
    assert "toy" not in registry.names("llmplug.platforms")


def test_discovery_reads_name_target_distribution_version_and_extras(installed):
    registry = PluginRegistry()
    [toy] = [info for info in registry.infos("llmplug.platforms") if info.name == "toy"]
    assert toy == PluginInfo(
        group="llmplug.platforms", name="toy", value="llmplug_example_toy_platform:ToyPlatform",
        distribution="llmplug-example-toy-platform", version="0.1.0", builtin=False,
    )
    assert toy.key == "llmplug.platforms:toy" and toy.module == "llmplug_example_toy_platform"
    fancy = [info.distribution for info in registry.infos("llmplug.loaders") if info.name == "fancy"]
    assert fancy == ["llmplug-example-fancy-a", "llmplug-example-fancy-b"]
    assert {"ToyForCausalLM", "ToyTurboForCausalLM"} <= set(registry.names("llmplug.models"))
    [turbo] = [info for info in registry.infos("llmplug.models") if info.name == "ToyTurboForCausalLM"]
    assert turbo.extras == ("turbo",) and turbo.value == "llmplug_example_toy_model:ToyForCausalLM"
    assert registry.names("llmplug.hooks") == ["broken", "toy", "typo"]


def test_listing_and_describe_import_no_plugin_module_and_not_torch(plugin_site):
    result = run_python(
        """
        import json, sys
        from llmplug.core.plugins import GROUPS, PluginRegistry
        registry = PluginRegistry()
        listing = {group: registry.names(group) for group in GROUPS}
        rows = registry.describe()
        prefixes = ("torch", "llmplug_example", "llmplug.platforms.", "llmplug.loaders.", "llmplug.plugins.",
                    "stevedore", "pluggy")
        imported = sorted(m for m in sys.modules if m.startswith(prefixes))
        print(json.dumps({"listing": listing, "rows": len(rows), "imported": imported}))
        """,
        plugin_site,
    )
    assert result["imported"] == []
    assert "toy" in result["listing"]["llmplug.platforms"] and result["rows"] >= 10


def test_load_imports_only_the_chosen_plugin(plugin_site):
    result = run_python(
        """
        import json, sys
        from llmplug.core.plugins import PluginRegistry
        platform = PluginRegistry().load("llmplug.platforms", "toy")
        imported = sorted(m for m in sys.modules if m.startswith(("torch", "llmplug_example")))
        print(json.dumps({"name": platform.name, "imported": imported}))
        """,
        plugin_site,
    )
    assert result == {"name": "toy", "imported": ["llmplug_example_toy_platform"]}


def test_newly_pip_installed_plugin_is_seen_by_new_processes_and_after_refresh(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    registry = PluginRegistry()
    list_platforms = """
        import json
        from llmplug.core.plugins import PluginRegistry
        print(json.dumps(PluginRegistry().names("llmplug.platforms")))
        """
    assert "toy" not in registry.names("llmplug.platforms")
    assert "toy" not in run_python(list_platforms, site)

    pip_install_examples(["toy_platform"], site, tmp_path)

    assert "toy" in run_python(list_platforms, site)
    registry.refresh()
    assert "toy" in registry.names("llmplug.platforms")
    assert registry.load("llmplug.platforms", "toy").name == "toy"


# --- choosing and loading ---------------------------------------------------------------------------------


def test_yaml_config_selecting_the_toy_platform_resolves_by_name(installed):
    text = "device:\n  platform: toy\nplugins:\n  enabled: [llmplug-example-toy-platform]\n"
    config = EngineConfig.model_validate(yaml.safe_load(text))
    registry = PluginRegistry.from_config(config.plugins)
    platform = registry.load("llmplug.platforms", config.device.platform)
    assert isinstance(platform, Platform)
    assert platform.name == "toy" and platform.is_available() and platform.priority < 0


def test_model_plugin_is_a_text_generation_model_that_runs(installed):
    import torch

    model_class = PluginRegistry().load("llmplug.models", "ToyForCausalLM")
    model = model_class(config=SimpleNamespace(vocab_size=32, hidden_size=8))
    assert isinstance(model, VllmModelForTextGeneration)
    hidden = model(torch.tensor([1, 2, 3]), torch.arange(3))  # [3, 8]
    logits = model.compute_logits(hidden[-1:])
    assert hidden.shape == (3, 8) and logits.shape == (1, 32) and logits.dtype == torch.float32
    names = {name for name, _ in model.named_parameters()}
    assert model.load_weights((n, torch.zeros_like(p)) for n, p in model.named_parameters()) == names


def test_load_returns_the_same_object_each_time(installed):
    registry = PluginRegistry()
    assert registry.load("llmplug.platforms", "toy") is registry.load("llmplug.platforms", "toy")


def test_unknown_name_lists_available_names_and_suggests_the_closest(installed):
    with pytest.raises(PluginNotFoundError) as caught:
        PluginRegistry().load("llmplug.platforms", "tyo")
    message = str(caught.value)
    assert isinstance(caught.value, KeyError)
    assert "Did you mean 'toy'?" in message and "cpu" in message and "llmplug.platforms" in message


def test_unknown_group_is_refused_with_the_closest_group():
    with pytest.raises(PluginError, match="Did you mean 'llmplug.platforms'"):
        PluginRegistry().names("llmplug.platform")


# --- conflicts -----------------------------------------------------------------------------------------------


def test_conflict_names_both_distributions_and_how_to_choose(installed):
    with pytest.raises(PluginConflictError) as caught:
        PluginRegistry().load(*FANCY)
    message = str(caught.value)
    assert "llmplug-example-fancy-a" in message and "llmplug-example-fancy-b" in message
    assert 'plugins.prefer: {"llmplug.loaders:fancy": ' in message


@pytest.mark.parametrize(
    "preferred, origin", [("llmplug-example-fancy-a", "a"), ("llmplug_example_fancy_b", "b")]
)
def test_prefer_picks_the_named_distribution(installed, preferred, origin):
    registry = PluginRegistry(prefer={"llmplug.loaders:fancy": preferred})
    assert registry.load(*FANCY).origin == origin


def test_prefer_naming_a_distribution_without_that_name_is_an_error(installed):
    registry = PluginRegistry(prefer={"llmplug.loaders:fancy": "llmplug-example-toy-platform"})
    claimants = "registered only by llmplug-example-fancy-a, llmplug-example-fancy-b"
    with pytest.raises(PluginNotFoundError, match=claimants):
        registry.load(*FANCY)


def test_prefer_keys_must_be_group_colon_name():
    with pytest.raises(PluginError, match="'group:name'"):
        PluginRegistry(prefer={"fancy": "llmplug-example-fancy-a"})


# --- allow-list ------------------------------------------------------------------------------------------------


def test_allow_list_hides_other_third_party_plugins(installed):
    registry = PluginRegistry(enabled=["llmplug_example_toy_platform"])  # any spelling of the name
    assert "toy" in registry.names("llmplug.platforms")
    assert IN_TREE_PLATFORMS <= set(registry.names("llmplug.platforms"))
    assert not {"fancy", "broken"} & set(registry.names("llmplug.loaders"))
    with pytest.raises(PluginNotFoundError) as caught:
        registry.load(*FANCY)
    assert "llmplug-example-fancy-a" in str(caught.value) and "plugins.enabled" in str(caught.value)


def test_allow_list_accepts_group_name_entries(installed):
    registry = PluginRegistry(enabled=["llmplug.loaders:fancy"])
    assert [info.distribution for info in registry.infos("llmplug.loaders") if info.name == "fancy"] == [
        "llmplug-example-fancy-a", "llmplug-example-fancy-b",
    ]
    assert "toy" not in registry.names("llmplug.platforms")


def test_env_var_is_the_allow_list_when_the_config_leaves_it_unset(installed, monkeypatch):
    monkeypatch.setenv(plugins.ENABLED_ENV, " llmplug-example-toy-platform , llmplug-example-fancy-b")
    registry = PluginRegistry.from_config(PluginConfig())
    assert registry.enabled == ["llmplug-example-toy-platform", "llmplug-example-fancy-b"]
    assert registry.load(*FANCY).origin == "b"  # fancy-a is not allowed, so there is no conflict
    from_config = PluginRegistry.from_config(PluginConfig(enabled=["llmplug-example-fancy-a"]))
    assert "toy" not in from_config.names("llmplug.platforms")
    monkeypatch.setattr(plugins, "_registry", None)  # let get_registry build from the environment
    assert get_registry().enabled == registry.enabled


def test_allow_list_entry_matching_nothing_is_logged(installed, caplog):
    caplog.set_level(logging.WARNING, logger="llmplug.plugins")
    PluginRegistry(enabled=["llmplug-example-toy-platfrom"]).names("llmplug.platforms")
    assert any("llmplug-example-toy-platfrom" in record.getMessage() for record in caplog.records)


# --- broken plugins ----------------------------------------------------------------------------------------------


def test_broken_plugin_error_names_distribution_group_name_and_cause(installed):
    with pytest.raises(PluginLoadError) as caught:
        PluginRegistry().load("llmplug.loaders", "broken")
    message = str(caught.value)
    for part in ("llmplug-example-broken", "llmplug.loaders", "'broken'", "llmplug_example_missing_dependency"):
        assert part in message
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_broken_hooks_module_is_reported_while_other_hooks_and_plugins_work(installed, caplog):
    caplog.set_level(logging.WARNING, logger="llmplug.plugins")
    registry = PluginRegistry()
    manager = registry.hook_manager()
    [error] = [error for error in registry.errors if "llmplug-example-broken" in str(error)]
    assert isinstance(error, PluginLoadError) and isinstance(error.__cause__, ModuleNotFoundError)
    assert "llmplug-example-broken" in str(error) and "llmplug.hooks" in str(error)
    assert any("llmplug-example-broken" in record.getMessage() for record in caplog.records)
    config = {"model": {"hf_overrides": {"toy_hook": 7}}}
    manager.hook.llmplug_adjust_config(config=config)
    assert config["scheduler"]["max_num_seqs"] == 7
    assert registry.load("llmplug.platforms", "toy").name == "toy"


# --- hooks ---------------------------------------------------------------------------------------------------


def test_hook_manager_is_built_once(installed):
    registry = PluginRegistry()
    assert registry.hook_manager() is registry.hook_manager()
    assert len(registry.errors) == 2  # broken and typo, recorded once


def test_adjust_config_hook_leaves_configs_that_do_not_ask_unchanged(installed):
    config = {"model": {"hf_overrides": {"rope_theta": 10.0}}}
    PluginRegistry().hook_manager().hook.llmplug_adjust_config(config=config)
    assert config == {"model": {"hf_overrides": {"rope_theta": 10.0}}}


def test_request_events_reach_a_hook_that_takes_only_some_arguments(installed):
    manager = PluginRegistry().hook_manager()
    import llmplug_example_toy_hooks

    llmplug_example_toy_hooks.EVENTS.clear()
    for event in hookspecs.REQUEST_EVENTS:
        manager.hook.llmplug_request_event(event=event, request_id="req-1", info={})
    assert llmplug_example_toy_hooks.EVENTS == [(event, "req-1") for event in hookspecs.REQUEST_EVENTS]


def test_hooks_module_with_a_misspelled_hook_is_refused_whole(installed):
    registry = PluginRegistry()
    manager = registry.hook_manager()
    [error] = [error for error in registry.errors if "llmplug-example-typo-hooks" in str(error)]
    assert isinstance(error, PluginLoadError)
    assert "llmplug_request_evnt (did you mean llmplug_request_event?)" in str(error)
    import llmplug_example_typo_hooks

    llmplug_example_typo_hooks.STATS.clear()
    manager.hook.llmplug_stats(stats={"num_running": 0})
    assert llmplug_example_typo_hooks.STATS == []  # its correct hook was not registered either


def test_hooks_of_disallowed_distributions_are_never_registered(installed):
    registry = PluginRegistry(enabled=[])
    manager = registry.hook_manager()
    assert registry.errors == []
    assert manager.get_plugin("llmplug-example-toy-hooks:toy") is None
    config = {"model": {"hf_overrides": {"toy_hook": 7}}}
    manager.hook.llmplug_adjust_config(config=config)
    assert "scheduler" not in config


def test_hookspecs_are_documented_and_none_is_firstresult():
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    specified = {"llmplug_adjust_config", "llmplug_logits_processors", "llmplug_request_event", "llmplug_stats"}
    assert {name for name in hookspecs.__all__ if name.startswith("llmplug_")} == specified
    for name in specified:
        assert getattr(manager.hook, name).spec.opts["firstresult"] is False
        assert "Who calls it" in getattr(hookspecs, name).__doc__
    assert hookspecs.hookimpl.project_name == "llmplug"


# --- API versions -----------------------------------------------------------------------------------------------


def test_plugin_for_a_newer_api_major_is_refused_with_both_versions(installed):
    with pytest.raises(PluginVersionError) as caught:
        PluginRegistry().load("llmplug.executors", "future")
    message = str(caught.value)
    for part in ("llmplug.executors:future", "llmplug-example-future 0.1.0", "2.0", PLUGIN_API_VERSION):
        assert part in message


def _info_for(name: str) -> PluginInfo:
    return PluginInfo("llmplug.executors", name, f"m:{name}", "llmplug-example-x", "0.1.0", builtin=False)


@pytest.mark.parametrize("declared, compatible", [
    ("1.0", True), ("1.9", True), ("1.10", True), ("1.11", True), ("1.12", True), ("1.13", True), (None, True), ("1.14", False), ("2.0", False),
    ("0.9", False), ("one", False),
])
def test_api_version_rule_same_major_and_not_newer_minor(declared, compatible):
    plugin = type("Plugin", (), {} if declared is None else {"LLMPLUG_PLUGIN_API_VERSION": declared})
    if compatible:
        check_api_version(plugin, _info_for("plugin"))
    else:
        with pytest.raises(PluginVersionError, match="llmplug-example-x"):
            check_api_version(plugin, _info_for("plugin"))


def test_api_version_is_read_from_the_module_when_the_object_has_none(installed):
    import llmplug_example_future

    with pytest.raises(PluginVersionError, match="2.0"):
        check_api_version(llmplug_example_future.FutureExecutor, _info_for("future"))


# --- describe (the `llmplug plugins` listing) ----------------------------------------------------------------


def _rows(registry: PluginRegistry) -> dict[tuple[str, str, str], dict]:
    return {(row["group"], row["name"], row["distribution"]): row for row in registry.describe()}


def test_describe_says_why_a_plugin_is_not_usable(installed):
    rows = _rows(PluginRegistry())
    toy = rows[("llmplug.platforms", "toy", "llmplug-example-toy-platform")]
    assert toy == {"group": "llmplug.platforms", "name": "toy", "distribution": "llmplug-example-toy-platform",
                   "version": "0.1.0", "usable": True, "reason": ""}
    fancy_a = rows[("llmplug.loaders", "fancy", "llmplug-example-fancy-a")]
    assert not fancy_a["usable"] and "plugins.prefer" in fancy_a["reason"]
    turbo = rows[("llmplug.models", "ToyTurboForCausalLM", "llmplug-example-toy-model")]
    assert not turbo["usable"] and "llmplug-example-not-installed" in turbo["reason"]
    ghost = rows[("llmplug.attention", "ghost", "llmplug-example-broken")]
    assert not ghost["usable"] and "'llmplug_example_ghost' is not installed" in ghost["reason"]


def test_describe_lists_disallowed_and_unchosen_plugins_with_the_fix(installed):
    registry = PluginRegistry(enabled=["llmplug-example-fancy-a", "llmplug-example-fancy-b"],
                              prefer={"llmplug.loaders:fancy": "llmplug-example-fancy-b"})
    rows = _rows(registry)
    assert rows[("llmplug.loaders", "fancy", "llmplug-example-fancy-b")]["usable"]
    assert "not chosen" in rows[("llmplug.loaders", "fancy", "llmplug-example-fancy-a")]["reason"]
    toy = rows[("llmplug.platforms", "toy", "llmplug-example-toy-platform")]
    assert not toy["usable"] and "plugins.enabled" in toy["reason"]


# --- process-wide registry ------------------------------------------------------------------------------------


def test_set_registry_is_what_load_plugin_uses(installed, monkeypatch):
    monkeypatch.setattr(plugins, "_registry", None)  # restored after the test
    registry = PluginRegistry(prefer={"llmplug.loaders:fancy": "llmplug-example-fancy-b"})
    set_registry(registry)
    assert get_registry() is registry
    assert load_plugin(*FANCY).origin == "b"


def test_registry_pickles_to_the_same_allow_list_and_preferences():
    registry = PluginRegistry(enabled=["llmplug-example-toy-platform"], prefer={"llmplug.loaders:fancy": "x"})
    copy = pickle.loads(pickle.dumps(registry))
    assert (copy.enabled, copy.prefer) == (registry.enabled, registry.prefer)
