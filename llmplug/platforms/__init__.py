"""llmplug.platforms."""
