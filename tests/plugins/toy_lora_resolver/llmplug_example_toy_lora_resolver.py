"""An `llmplug.lora_resolvers` plugin: the adapter named `model` is the folder of that name under the
directory LLMPLUG_TOY_LORA_DIR (a stand-in for a hub or an object store)."""

from __future__ import annotations

import os
from pathlib import Path

from llmplug.lora import LoRARequest

DIR_ENV = "LLMPLUG_TOY_LORA_DIR"


class DirectoryResolver:
    """Resolves `lora_name` to `$LLMPLUG_TOY_LORA_DIR/<lora_name>` when that folder holds an adapter config."""

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        folder = Path(os.environ.get(DIR_ENV, "")) / lora_name
        if not (folder / "adapter_config.json").is_file():
            return None
        return LoRARequest(lora_name, 1, str(folder))  # the server gives it an id of its own
