"""llmplug.entrypoints."""
