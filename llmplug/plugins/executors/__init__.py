"""llmplug.plugins.executors."""
