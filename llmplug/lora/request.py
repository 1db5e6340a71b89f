"""LoRARequest: which adapter a request runs with (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass

from llmplug.core.errors import InvalidRequestError

__all__ = ["LoRARequest"]


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`) to apply to one request.

    `lora_int_id` (> 0) identifies the adapter inside the engine: requests with the same id share its
    slot and its prefix-cache blocks, so one id must always name the same folder.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise InvalidRequestError(
                f"LoRARequest.lora_int_id={self.lora_int_id!r} must be an integer >= 1", param="lora_int_id"
            )
        if not self.lora_name:
            raise InvalidRequestError("LoRARequest.lora_name must not be empty", param="lora_name")
