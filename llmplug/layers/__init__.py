"""llmplug.layers."""
