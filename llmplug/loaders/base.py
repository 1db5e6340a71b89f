"""BaseModelLoader: what every weight format shares — finding the model, its HF config, tokenizer and
class, building the model on the device in the target dtype, checking that every parameter got a
value, and letting the layers process their weights after loading (int4 copies, see
docs/quantization.md). A format implements `iter_weights` (or overrides `load_weights`)."""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
from tqdm import tqdm

from llmplug.core.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from llmplug.core.config import EngineConfig, LoadConfig, ModelConfig

__all__ = ["BaseModelLoader", "model_dtype", "record_stored_nbytes"]

log = logging.getLogger("llmplug.loaders")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(name: str) -> torch.dtype:
    """The torch dtype of ModelConfig.dtype; "auto" (normally resolved by the platform) means float32."""
    return _DTYPES.get(name, torch.float32)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Make `dtype` torch's default while the model is built (parameters are created in it)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _hf_cache_snapshot(name: str, cache_dir: str | None) -> str | None:
    """The local snapshot of hub repo `name` in the HF cache, looked up offline; None when absent."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(name, cache_dir=cache_dir, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):
        return None


class BaseModelLoader(abc.ABC):
    """Shared steps of every loader; constructed with the engine's LoadConfig in each process."""

    def __init__(self, load_config: "LoadConfig") -> None:
        self.load_config = load_config

    # ---- locating the model -------------------------------------------------------------------
    def model_path(self, name: str) -> str:
        """A local path for `name`: an existing path, an embedded model, or a snapshot in the HF cache."""
        from llmplug.loaders.default_model import resolve_model_path

        path = resolve_model_path(name)
        if os.path.exists(path):
            return path
        snapshot = _hf_cache_snapshot(name, self.load_config.download_dir)
        if snapshot is None:
            raise ModelLoadError(
                f"model path {name!r} was not found: it is not a local file or directory and not in the Hugging "
                f"Face cache{f' ({self.load_config.download_dir})' if self.load_config.download_dir else ''}. "
                "llmplug does not download from model hubs at run time; download it first "
                f"(e.g. `huggingface-cli download {name}`) or pass a local directory."
            )
        return snapshot

    def download_model(self, model_config: "ModelConfig") -> None:
        """Check the model is available locally (a local path or the HF cache); never downloads."""
        self.model_path(model_config.model)

    # ---- config, tokenizer, class --------------------------------------------------------------
    def load_hf_config(self, model_config: "ModelConfig") -> "PretrainedConfig":
        """The transformers config of the model (local files only), with `hf_overrides` applied."""
        from transformers import AutoConfig

        path = self.model_path(model_config.model)
        try:
            config = AutoConfig.from_pretrained(
                path, trust_remote_code=model_config.trust_remote_code, local_files_only=True
            )
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"cannot read the config of {model_config.model!r} ({path}): {error}") from error
        config.update(dict(model_config.hf_overrides))
        return config

    def load_tokenizer(self, model_config: "ModelConfig") -> "PreTrainedTokenizerBase":
        """The model's tokenizer (or `model_config.tokenizer`'s), from local files only."""
        from transformers import AutoTokenizer

        path = self.model_path(model_config.tokenizer or model_config.model)
        try:
            return AutoTokenizer.from_pretrained(
                path, trust_remote_code=model_config.trust_remote_code, local_files_only=True
            )
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"cannot load the tokenizer from {path}: {error}") from error

    def get_model_class(self, hf_config: "PretrainedConfig") -> type:
        """The `llmplug.models` plugin registered under the config's first architecture."""
        from llmplug.core.plugins import get_registry

        architectures = getattr(hf_config, "architectures", None) or []
        if not architectures:
            raise ModelLoadError("the model's config.json lists no `architectures`; set it via hf_overrides")
        return get_registry().load("llmplug.models", architectures[0])

    # ---- weights ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def iter_weights(self, model_config: "ModelConfig") -> Iterable[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) pairs of the model's weights, read lazily."""

    def load_weights(self, model: torch.nn.Module, model_config: "ModelConfig") -> int:
        """Feed `iter_weights` to `model.load_weights`; every parameter must be loaded. Returns bytes read."""
        counter = _ByteCounter(self.iter_weights(model_config))
        progress = tqdm(counter, desc=f"Loading {os.path.basename(model_config.model)}", unit=" tensors", disable=None)
        loaded = model.load_weights(progress)
        missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
        if missing:
            raise ModelLoadError(
                f"{len(missing)} parameter(s) of {type(model).__name__} got no weights from {model_config.model!r}: "
                f"{missing}; the checkpoint is incomplete or of another architecture"
            )
        return counter.num_bytes

    def load_model(
        self, config: "EngineConfig", device: torch.device | str | None = None, model_class: type | None = None
    ) -> torch.nn.Module:
        """Build the model in the configured dtype on `device`, load its weights, return it in eval mode.

        `model_class` skips the registry lookup (tests, embedding programs).
        """
        start = time.perf_counter()
        model_config = config.model
        hf_config = self.load_hf_config(model_config)
        cls = model_class or self.get_model_class(hf_config)
        device = torch.device(device) if device is not None else torch.get_default_device()
        dtype = model_dtype(model_config.dtype)
        with _default_dtype(dtype), device:
            model = cls(config=hf_config, prefix="")
        num_bytes = self.load_weights(model, model_config)
        _check_materialized(model)
        self.process_weights_after_loading(model, model_config)
        model.eval()
        log.info(
            "loaded %s (%s, %s) in %.2f s, %.1f MB read",
            cls.__name__, dtype, device, time.perf_counter() - start, num_bytes / 2**20,
        )
        return model


    def process_weights_after_loading(self, model: torch.nn.Module, model_config: "ModelConfig") -> None:
        """Let the layers turn their loaded weights into the form they compute with (default: int4 copies,
        oneDNN-packed dense weights)."""
        _process_weights_after_loading(model, model_config)


def record_stored_nbytes(tensor: torch.Tensor, num_bytes: int) -> torch.Tensor:
    """Mark a stand-in tensor (e.g. a placeholder for quantized data) as `num_bytes` read; returns it."""
    tensor.stored_nbytes = num_bytes  # type: ignore[attr-defined]
    return tensor


def _tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes a checkpoint tensor took to read: what a loader recorded, else its own size."""
    recorded = getattr(tensor, "stored_nbytes", None)
    return recorded if recorded is not None else tensor.numel() * tensor.element_size()


class _ByteCounter:
    """Passes (name, tensor) pairs through and counts their bytes."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.weights, self.num_bytes = weights, 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.weights:
            self.num_bytes += _tensor_nbytes(tensor)
            yield name, tensor


def _process_weights_after_loading(model: torch.nn.Module, model_config: ModelConfig) -> None:
    """Let the layers pack their weights: int4 copies (ModelConfig.quantization; see docs/quantization.md)
    and oneDNN-packed dense weights (ModelConfig.prepack_weights)."""
    from llmplug.layers.quantization import LinearOptions, process_weights_after_loading

    quantization = model_config.quantization
    forced = quantization == "int4"
    options = LinearOptions(
        int4=quantization != "none", quantize_dense=forced, required=forced, prepack=model_config.prepack_weights
    )
    process_weights_after_loading(model, options)


def _check_materialized(model: torch.nn.Module) -> None:
    """ModelLoadError naming any parameter or buffer still on the meta device."""
    tensors: list[tuple[str, Any]] = [*model.named_parameters(), *model.named_buffers()]
    on_meta = [name for name, t in tensors if t.device.type == "meta"]
    if on_meta:
        raise ModelLoadError(f"after loading, these tensors were never materialized (still on meta): {on_meta}")
