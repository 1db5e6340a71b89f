"""Model architectures, one module per family; each class is registered under its HF architecture
name in the `llmplug.models` entry-point group (see pyproject.toml). Nothing is imported here:
the registry imports the one module a checkpoint needs.

- `llama`: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM (one generic decoder)
- `arch_config`: the typed, frozen architecture configs the adapters produce
"""
