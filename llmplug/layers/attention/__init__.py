"""llmplug.layers.attention."""
