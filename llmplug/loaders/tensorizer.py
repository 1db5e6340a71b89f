"""TensorizerLoader (`load.format: tensorizer`): weights serialized with the tensorizer library.

`llmplug tensorize MODEL OUT` (`tensorize_model`) writes OUT/config.json, the tokenizer files and
OUT/model.tensors: every checkpoint tensor under its checkpoint name, exactly as MODEL's own loader
yields it (so a GGUF model is stored dequantized). The loader streams the tensors back with tensorizer's
`TensorDeserializer` (hashes verified) into the model's one generic load_weights loop, so fused projections
and tensor-parallel sharding work as for any checkpoint. `load.tensorizer_uri` points at the tensors
elsewhere: another local file, or an s3:// / http(s):// URI that tensorizer opens itself.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

import torch
from tqdm import tqdm

from llmplug.core.errors import ModelLoadError
from llmplug.loaders.base import BaseModelLoader

if TYPE_CHECKING:
    from llmplug.core.config import EngineConfig, ModelConfig

__all__ = ["TENSORS_FILE", "TensorizerLoader", "tensorize_model"]

log = logging.getLogger("llmplug.loaders")

TENSORS_FILE = "model.tensors"
_REMOTE_SCHEMES = ("s3://", "http://", "https://")


class TensorizerLoader(BaseModelLoader):
    """Reads config and tokenizer from the model directory and the weights from its tensorizer file."""

    def tensors_uri(self, model_config: "ModelConfig") -> str:
        """`load.tensorizer_uri`, else model.tensors in the model directory."""
        return self.load_config.tensorizer_uri or os.path.join(self.model_path(model_config.model), TENSORS_FILE)

    def iter_weights(self, model_config: "ModelConfig") -> Iterable[tuple[str, torch.Tensor]]:
        """Every serialized tensor, deserialized one at a time."""
        return _deserialize(self.tensors_uri(model_config))


def _deserialize(uri: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a tensorizer file or URI; damage is a ModelLoadError naming it."""
    from tensorizer import TensorDeserializer

    remote = uri.startswith(_REMOTE_SCHEMES)
    if not remote and not os.path.isfile(uri):
        raise ModelLoadError(f"tensorizer file {uri} does not exist; write one with `llmplug tensorize MODEL OUT`")
    try:
        with TensorDeserializer(uri, device="cpu", lazy_load=True, verify_hash=True) as deserializer:
            yield from deserializer.items()
    # tensorizer's reader fails on damage with whatever its parsing hits (a short read, struct.error, IndexError in a
    # header, a hash mismatch, an unreachable URI): any error while iterating is the file's (the consumer's own
    # errors are raised in its frame, not here)
    except Exception as error:
        problem = "cannot be read or is corrupted" if remote else "is truncated or corrupted"
        raise ModelLoadError(f"tensorizer file {uri} {problem}: {error}") from error


def tensorize_model(config: "EngineConfig", out_dir: str | Path) -> Path:
    """Serialize the model `config` names (any format llmplug loads) into `out_dir`; returns the tensors file."""
    from tensorizer import TensorSerializer
    from tensorizer.serialization import TensorType

    from llmplug.core.plugins import PluginRegistry
    from llmplug.loaders import build_loader, resolve_load_format

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fmt = resolve_load_format(config.model.model, config.load.format)
    loader: BaseModelLoader = build_loader(PluginRegistry.from_config(config.plugins), fmt, config.load)
    loader.load_hf_config(config.model).save_pretrained(out)
    _save_tokenizer(loader, config.model, out)
    serializer = TensorSerializer(str(out / TENSORS_FILE))
    weights = tqdm(loader.iter_weights(config.model), desc=f"Tensorizing into {out}", unit=" tensors", disable=None)
    for index, (name, tensor) in enumerate(weights):
        serializer.write_tensor(index, name, TensorType.PARAM, tensor.contiguous())
    serializer.close()
    return out / TENSORS_FILE


def _save_tokenizer(loader: BaseModelLoader, model_config: "ModelConfig", out: Path) -> None:
    """Copy the model's tokenizer next to the tensors; a model without one is serialized without it."""
    try:
        tokenizer = loader.load_tokenizer(model_config)
    except ModelLoadError as error:
        log.warning("%s has no loadable tokenizer, so %s gets none: %s", model_config.model, out, error)
        return
    tokenizer.save_pretrained(out)
