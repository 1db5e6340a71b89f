"""llmplug.communicators."""
