"""LoRA adapters: the request type (`LoRARequest`); loading PEFT folders (`adapter`), the per-layer
slots and their batched compute (`layers`), the worker's slot and host caches (`manager`)."""

from llmplug.lora.request import LoRARequest

__all__ = ["LoRARequest"]
