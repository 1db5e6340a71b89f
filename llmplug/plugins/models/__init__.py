"""llmplug.plugins.models."""
