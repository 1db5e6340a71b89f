"""llmplug.plugins.guided_decoding."""
