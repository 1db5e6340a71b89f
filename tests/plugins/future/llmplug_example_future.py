"""Example executor plugin that targets plugin API 2.0, which this llmplug (1.x) does not provide.

Loading it raises PluginVersionError naming the plugin, its distribution, its API version and ours.
"""

from __future__ import annotations

LLMPLUG_PLUGIN_API_VERSION = "2.0"


class FutureExecutor:
    """An executor for an API that does not exist yet."""
