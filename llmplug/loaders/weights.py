"""Finding a checkpoint's weight files and iterating their tensors without loading them all at once."""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from llmplug.core.errors import ModelLoadError

__all__ = [
    "find_weight_files",
    "open_safetensors",
    "pt_weights_iterator",
    "safetensors_weights_iterator",
    "weights_iterator",
]

SAFETENSORS_INDEX = "model.safetensors.index.json"
PT_INDEX = "pytorch_model.bin.index.json"
PT_SUFFIXES = (".bin", ".pt", ".pth")


def _indexed_files(folder: Path, index_name: str) -> list[Path] | None:
    """The shard files an index json names (None without an index); every one must exist."""
    index = folder / index_name
    if not index.is_file():
        return None
    weight_map = json.loads(index.read_text())["weight_map"]
    files = [folder / name for name in sorted(set(weight_map.values()))]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise ModelLoadError(f"{index} names shard files that are missing: {absent}")
    return files


def _safetensors_files(folder: Path) -> list[Path]:
    """Shards named by the index, else every .safetensors file (Mistral's extra consolidated copy excluded)."""
    indexed = _indexed_files(folder, SAFETENSORS_INDEX)
    if indexed is not None:
        return indexed
    files = sorted(folder.glob("*.safetensors"))
    hf_files = [f for f in files if not f.name.startswith("consolidated")]
    return hf_files or files


def _pt_files(folder: Path) -> list[Path]:
    """Shards named by the index, else every .bin / .pt / .pth file."""
    indexed = _indexed_files(folder, PT_INDEX)
    if indexed is not None:
        return indexed
    return sorted(f for f in folder.iterdir() if f.suffix in PT_SUFFIXES and f.is_file())


def find_weight_files(path: str | Path, fmt: str = "auto") -> tuple[list[Path], str]:
    """The weight files of a checkpoint dir (or single file) and their kind, "safetensors" or "pt".

    fmt "safetensors" / "pt" insists on that kind; anything else prefers safetensors when both exist.
    """
    path = Path(path)
    if path.is_file():
        kind = "safetensors" if path.suffix == ".safetensors" else "pt"
        return [path], kind
    kinds = ("safetensors",) if fmt == "safetensors" else ("pt",) if fmt == "pt" else ("safetensors", "pt")
    for kind in kinds:
        files = _safetensors_files(path) if kind == "safetensors" else _pt_files(path)
        if files:
            return files, kind
    wanted = " or ".join(f"*.{k}" if k == "safetensors" else "*.bin/*.pt" for k in kinds)
    raise ModelLoadError(f"no weight files ({wanted}) in {path}; load.format={fmt!r}")


def safetensors_weights_iterator(
    files: Iterable[Path], keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of the files (those `keep` accepts), each file memory-mapped (safe_open)."""
    from safetensors import SafetensorError

    for file in files:
        try:
            with open_safetensors(file) as f:
                for name in f.keys():
                    if keep is None or keep(name):
                        yield name, f.get_tensor(name)
        except SafetensorError as error:
            raise _unreadable_safetensors(file, error) from error


def open_safetensors(file: Path):  # noqa: ANN201 - safetensors' safe_open handle has no public type
    """safe_open(file) on the CPU; a truncated or corrupted file is a ModelLoadError naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as error:
        raise _unreadable_safetensors(file, error) from error


def _unreadable_safetensors(file: Path, error: Exception) -> ModelLoadError:
    return ModelLoadError(f"{file} is not a readable safetensors file (truncated or corrupted?): {error}")


def pt_weights_iterator(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of torch-saved state dicts (weights_only: no code is run)."""
    for file in files:
        state = _load_pt_state(file)
        yield from state.items()
        del state


def _load_pt_state(file: Path) -> dict[str, torch.Tensor]:
    """A torch-saved {name: tensor} dict, memory-mapped when saved in the zip format (torch >= 1.6)."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except pickle.UnpicklingError as error:
        raise ModelLoadError(
            f"{file} holds more than tensors, or is no torch checkpoint: torch.load(weights_only=True) refused "
            f"it, and llmplug never unpickles code; convert it to safetensors. torch said: {error}"
        ) from error
    except (RuntimeError, EOFError, OSError) as error:
        raise ModelLoadError(f"{file} is not a readable torch checkpoint (truncated or corrupted?): {error}") from error
    if not isinstance(state, dict):
        raise ModelLoadError(f"{file} holds a {type(state).__name__}, not a {{name: tensor}} state dict")
    stray = next(((k, v) for k, v in state.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))), None)
    if stray is not None:
        raise ModelLoadError(
            f"{file} is not a flat {{name: tensor}} state dict: entry {stray[0]!r} holds a {type(stray[1]).__name__}; "
            "save the model's state_dict() itself"
        )
    return state


def weights_iterator(files: list[Path], kind: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The iterator for files of `kind` ("safetensors" or "pt")."""
    return safetensors_weights_iterator(files) if kind == "safetensors" else pt_weights_iterator(files)
