"""Example loader plugin 'fancy' from llmplug-example-fancy-a; another distribution claims the same name.

Used to show name conflicts: loading `llmplug.loaders` "fancy" is an error naming both distributions
until the config picks one with `plugins.prefer: {"llmplug.loaders:fancy": "llmplug-example-fancy-a"}`.
"""

from __future__ import annotations

from typing import Any

LLMPLUG_PLUGIN_API_VERSION = "1.0"


class FancyLoader:
    """A ModelLoader that only says which distribution it came from."""

    origin = "a"

    def __init__(self, load_config: Any) -> None:
        self.load_config = load_config

    def download_model(self, model_config: Any) -> None:
        """Nothing to download: the example reads no weights."""

    def load_model(self, config: Any) -> Any:
        """The example builds no model."""
        raise NotImplementedError("llmplug-example-fancy-a is an example loader; it loads no model")
