"""llmplug.engine."""
