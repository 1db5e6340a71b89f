"""llmplug.loaders."""
