"""llmplug.plugins."""
