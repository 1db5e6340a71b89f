"""Example of a broken plugin: its import fails, as it would with a dependency not installed.

The registry reports it with its distribution, group, name and this ImportError, and every other
plugin keeps working.
"""

from __future__ import annotations

import llmplug_example_missing_dependency  # noqa: F401  (deliberately not installed)


class BrokenLoader:
    """Never reached: the import above fails first."""
