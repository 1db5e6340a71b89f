"""BaseModelLoader: what every weight format shares — finding the model, its HF config, tokenizer and
class, building the model on the device in the target dtype, checking that every parameter got a
value, and letting the layers process their weights after loading (int4 copies, see
docs/quantization.md). A format implements `iter_weights` (or overrides `load_weights`).

`LoadProgress` is the one progress bar and load log every loader reports through (docs/loaders.md)."""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import os
import time
from typing import IO, TYPE_CHECKING, Any, Iterable, Iterator

import torch
from tqdm import tqdm

from llmplug.core.errors import ModelLoadError
from llmplug.layers.weight_utils import missing_parameters

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from llmplug.core.config import EngineConfig, LoadConfig, ModelConfig
    from llmplug.core.plugins import PluginRegistry

__all__ = [
    "BaseModelLoader",
    "LoadProgress",
    "finish_loading",
    "hf_cache_snapshot",
    "model_dtype",
    "record_stored_nbytes",
]

log = logging.getLogger("llmplug.loaders")
# the `llmplug.models` name of the transformers backend, which runs what no native plugin does (model.model_impl)
TRANSFORMERS_BACKEND = "TransformersForCausalLM"

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


def hf_cache_snapshot(name: str, cache_dir: str | None) -> str:
    """The local snapshot of hub repo `name` in the HF cache (`cache_dir`, else the default), found offline.

    Never downloads: ModelLoadError says how to get the model when it is not there (or only partly).
    """
    from huggingface_hub import errors, snapshot_download

    try:
        return snapshot_download(name, cache_dir=cache_dir, local_files_only=True)
    except (errors.LocalEntryNotFoundError, errors.HFValidationError) as error:
        where = f"the Hugging Face cache {cache_dir}" if cache_dir else "the Hugging Face cache"
        partial = isinstance(error, getattr(errors, "IncompleteSnapshotError", ()))
        reason = f"its snapshot in {where} is incomplete: {error}" if partial else f"it is not in {where}"
        raise ModelLoadError(
            f"model {name!r} was not found: it is not a local file or directory and {reason}. llmplug does "
            f"not download from model hubs at run time; download it first (e.g. `hf download {name}`) "
            "or pass a local directory."
        ) from error


class BaseModelLoader(abc.ABC):
    """Shared steps of every loader; constructed with the engine's LoadConfig in each process.

    `registry` is the engine's plugin registry, where the model class is looked up; default (a loader
    used outside an engine): the process-wide one.
    """

    def __init__(self, load_config: "LoadConfig", registry: "PluginRegistry | None" = None) -> None:
        self.load_config = load_config
        self.registry = registry

    # ---- locating the model -------------------------------------------------------------------
    def model_path(self, name: str) -> str:
        """A local path for `name`: an existing path, an embedded model, or a snapshot in the HF cache."""
        from llmplug.loaders.default_model import resolve_model_path

        path = resolve_model_path(name)
        return path if os.path.exists(path) else hf_cache_snapshot(name, self.load_config.download_dir)

    def download_model(self, model_config: "ModelConfig") -> None:
        """Check the model is available locally (a local path or the HF cache); never downloads."""
        self.model_path(model_config.model)

    # ---- config, tokenizer, class --------------------------------------------------------------
    def load_hf_config(self, model_config: "ModelConfig") -> "PretrainedConfig":
        """The transformers config of the model (local files only), with `hf_overrides` applied."""
        from transformers import AutoConfig

        path = self.model_path(model_config.model)
        try:
            config_class = self._plugin_config_class(path)
            if config_class is not None:
                config = config_class.from_pretrained(path, local_files_only=True)
            else:
                config = AutoConfig.from_pretrained(
                    path, trust_remote_code=model_config.trust_remote_code, local_files_only=True
                )
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"cannot read the config of {model_config.model!r} ({path}): {error}") from error
        config.update(dict(model_config.hf_overrides))
        return config

    def _plugin_config_class(self, path: str) -> type | None:
        """The config class a model plugin brings (its `hf_config_class`) for a config.json whose model_type
        transformers does not know (Ultravox's, whose checkpoints bring theirs as remote code); None otherwise."""
        from transformers import CONFIG_MAPPING

        from llmplug.core.plugins import get_registry

        try:
            with open(os.path.join(path, "config.json"), encoding="utf-8") as file:
                raw = json.load(file)
        except (OSError, ValueError):
            return None  # AutoConfig says what is wrong with the folder
        architectures = (raw.get("architectures") or []) if isinstance(raw, dict) else []
        if not architectures or raw.get("model_type") in CONFIG_MAPPING:
            return None
        registry = self.registry or get_registry()
        if architectures[0] not in registry.names("llmplug.models"):
            return None
        return getattr(registry.load("llmplug.models", architectures[0]), "hf_config_class", None)

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

    def load_generation_config(self, model_config: "ModelConfig") -> dict[str, Any]:
        """The model's generation_config.json as a dict (eos_token_id, default sampling values); {} without one."""
        path = os.path.join(self.model_path(model_config.model), "generation_config.json")
        if not os.path.isfile(path):
            return {}
        try:
            with open(path, encoding="utf-8") as file:
                return json.load(file)
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"cannot read {path}: {error}") from error

    def get_model_class(self, hf_config: "PretrainedConfig", model_impl: str = "auto") -> type:
        """The `llmplug.models` plugin that runs the config's first architecture under `model_impl`
        (ModelConfig.model_impl): the one registered under its name (native), or the transformers backend."""
        from llmplug.core.plugins import get_registry

        architectures = getattr(hf_config, "architectures", None) or []
        if not architectures:
            raise ModelLoadError("the model's config.json lists no `architectures`; set it via hf_overrides")
        registry = self.registry or get_registry()
        native = architectures[0] in registry.names("llmplug.models")
        if model_impl == "native" or (model_impl == "auto" and native):
            return registry.load("llmplug.models", architectures[0])
        backend = registry.load("llmplug.models", TRANSFORMERS_BACKEND)
        try:
            return backend.for_config(hf_config)
        except ValueError as error:
            raise ModelLoadError(f"{error} (model.model_impl={model_impl!r})") from None

    # ---- weights ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def iter_weights(self, model_config: "ModelConfig") -> Iterable[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) pairs of the model's weights, read lazily."""

    def load_weights(self, model: torch.nn.Module, model_config: "ModelConfig", progress: "LoadProgress") -> None:
        """Feed `iter_weights` through `progress` to `model.load_weights`; every parameter must be loaded."""
        loaded = model.load_weights(progress.track(self.iter_weights(model_config)))
        missing = missing_parameters(model, loaded)
        if missing:
            raise ModelLoadError(
                f"{len(missing)} parameter(s) of {type(model).__name__} got no weights from {model_config.model!r}: "
                f"{missing}; the checkpoint is incomplete or of another architecture"
            )

    def load_model(
        self, config: "EngineConfig", device: torch.device | str | None = None, model_class: type | None = None
    ) -> torch.nn.Module:
        """Build the model in the configured dtype on `device`, load its weights, return it in eval mode.

        `model_class` skips the registry lookup (tests, embedding programs).
        """
        model_config = config.model
        with LoadProgress(os.path.basename(os.path.normpath(model_config.model))) as progress:
            hf_config = self.load_hf_config(model_config)
            cls = model_class or self.get_model_class(hf_config, model_config.model_impl)
            if model_class is None and model_config.convert not in ("auto", "none"):
                from llmplug.layers.decoder.pooling import converted_class

                cls = converted_class(cls, model_config.convert)
            device = torch.device(device) if device is not None else torch.get_default_device()
            from llmplug.core.plugins import get_registry
            from llmplug.quantization import building_with, resolve_quantization

            quantization = resolve_quantization(hf_config, model_config, self.registry or get_registry())
            with _default_dtype(model_dtype(model_config.dtype)), device, building_with(quantization):
                model = cls(config=hf_config, prefix="")
            self.load_weights(model, model_config, progress)
            _check_materialized(model)
            self.process_weights_after_loading(model, model_config)
            model.eval()
        return model

    def process_weights_after_loading(self, model: torch.nn.Module, model_config: "ModelConfig") -> None:
        """Let the layers turn their loaded weights into what they compute with (default: `finish_loading`)."""
        finish_loading(model, model_config)


class LoadProgress:
    """The progress bar, clock and byte count of one model load; one log line when it ends.

    Every loader reports through it, whatever it reads:

        with LoadProgress("my-model") as progress:
            model.load_weights(progress.track(weights))   # (name, tensor) pairs, counted as they pass
            progress.advance(num_bytes, count=1)          # or: a loader that reads whole files / modules

    The tqdm bar shows on a terminal only (unless `file` or `disable` say otherwise). On a clean exit
    it logs, on the `llmplug.loaders` logger at INFO, the tensors and bytes read and the seconds taken;
    the record also carries them as `num_tensors`, `num_bytes` and `seconds`.
    """

    def __init__(
        self, name: str, total: int | None = None, *, file: IO[str] | None = None, disable: bool | None = None
    ) -> None:
        self.name, self.total, self.num_tensors, self.num_bytes = name, total, 0, 0
        self._bar_options: dict[str, Any] = {"file": file, "disable": disable}
        self._start = 0.0
        self._bar: tqdm | None = None

    @property
    def seconds(self) -> float:
        """Seconds since the load started."""
        return time.perf_counter() - self._start

    def __enter__(self) -> "LoadProgress":
        self._start = time.perf_counter()
        self._bar = tqdm(desc=f"Loading {self.name}", total=self.total, unit=" tensors", **self._bar_options)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self._bar.close()
        if exc_type is None:
            seconds, mib = self.seconds, self.num_bytes / 2**20
            log.info(
                "loaded %s: %d tensors, %.1f MiB read in %.2f s (%.1f MiB/s)",
                self.name, self.num_tensors, mib, seconds, mib / max(seconds, 1e-9),
                extra={"num_tensors": self.num_tensors, "num_bytes": self.num_bytes, "seconds": seconds},
            )

    def advance(self, num_bytes: int, count: int = 1) -> None:
        """Count `count` tensors holding `num_bytes` bytes as read."""
        self.num_tensors += count
        self.num_bytes += num_bytes
        self._bar.update(count)

    def track(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass (name, tensor) pairs through, counting each one as it is handed on."""
        for name, tensor in weights:
            self.advance(_tensor_nbytes(tensor))
            yield name, tensor


def record_stored_nbytes(tensor: torch.Tensor, num_bytes: int) -> torch.Tensor:
    """Mark a stand-in tensor (e.g. a placeholder for quantized data) as `num_bytes` read; returns it."""
    tensor.stored_nbytes = num_bytes  # type: ignore[attr-defined]
    return tensor


def _tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes a checkpoint tensor took to read: what its loader recorded, else its own size."""
    recorded = getattr(tensor, "stored_nbytes", None)
    return recorded if recorded is not None else tensor.numel() * tensor.element_size()


def finish_loading(model: torch.nn.Module, model_config: ModelConfig, only_dense: bool = False) -> None:
    """Let the layers derive what they compute with from their new weights: int4 copies
    (ModelConfig.quantization, docs/quantization.md) and oneDNN-packed dense weights (ModelConfig.prepack_weights).

    `only_dense`: after a weight update, only the layers computing densely now (those whose weights
    changed, or that were dense anyway) are redone; the others keep their packed copies.
    """
    from llmplug.layers.kernels.int4_matmul import native_int4_available
    from llmplug.layers.quantization import LinearOptions, process_weights_after_loading

    quantization = model_config.quantization
    forced = quantization == "int4"
    invariant = model_config.batch_invariant_on
    # batch invariant, an int4 copy computes the generated tokens (auto: prompts stay dense) or every token (int4);
    # else the calls of a few tokens, whatever they are
    int4_rows = ("all" if forced else "generated") if invariant else "small"
    param = next(model.parameters(), None)
    dtype = None if param is None else param.dtype
    # auto's int4 copies only where their kernel beats the dense weight: bf16, and float32 with llmplug's int4
    # kernel (the batch-invariant mode's); torch's has no fast float32 path (~20x slower than dense for one row)
    auto_int4 = quantization == "auto" and (
        dtype == torch.bfloat16 or (dtype == torch.float32 and int4_rows != "small" and native_int4_available())
    )
    options = LinearOptions(
        int4=forced or auto_int4, int4_rows=int4_rows, int8=quantization == "int8",
        quantize_dense=forced, required=forced, prepack=model_config.prepack_weights, row_invariant=invariant,
    )
    process_weights_after_loading(model, options, only_dense=only_dense)


def _check_materialized(model: torch.nn.Module) -> None:
    """ModelLoadError naming any parameter or buffer still on the meta device."""
    tensors: list[tuple[str, Any]] = [*model.named_parameters(), *model.named_buffers()]
    on_meta = [name for name, t in tensors if t.device.type == "meta"]
    if on_meta:
        raise ModelLoadError(f"after loading, these tensors were never materialized (still on meta): {on_meta}")
