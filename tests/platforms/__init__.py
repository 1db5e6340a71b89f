"""Tests of llmplug.platforms."""
