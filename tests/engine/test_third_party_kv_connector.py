"""A third-party KV connector (tests/plugins/toy_kv_connector, `toy_shelf`), pip-installed, is found by its entry
point alone (this test never imports it) and passes `llmplug.testing.check_kv_connector`, which catches the same
connector when it loads wrong K/V."""

from __future__ import annotations

import pytest

from llmplug.core.plugins import PluginRegistry
from llmplug.testing.kv_connectors import check_kv_connector
from tests.models.tiny_models import make_tiny
from tests.plugin_examples import example_site_fixtures

site, installed = example_site_fixtures(["toy_kv_connector"])  # only this example, installed by pip


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama"))


def test_the_connector_is_listed_from_its_entry_point_and_not_in_tree(installed):
    [info] = [i for i in PluginRegistry().infos("llmplug.kv_connectors") if i.name == "toy_shelf"]
    assert (info.distribution, info.builtin) == ("llmplug-example-toy-kv-connector", False)


def test_the_installed_connector_passes_the_conformance_kit(installed, tiny_llama):
    report = check_kv_connector(tiny_llama.path, {"kv_connector": "toy_shelf"})
    assert report.round_trip_cached_tokens == 32 and report.partial_cached_tokens == 12 and report.failed_loads == 8


def test_the_kit_catches_a_connector_that_loads_wrong_blocks(installed, tiny_llama):
    config = {"kv_connector": "toy_shelf", "kv_connector_extra_config": {"lie": True}}
    with pytest.raises(AssertionError, match="round_trip: tokens .* differ from the engine without a connector"):
        check_kv_connector(tiny_llama.path, config)
