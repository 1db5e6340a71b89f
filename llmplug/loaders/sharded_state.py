"""ShardedStateLoader (`load.format: sharded_state`): each rank reads only its own, already-sharded weights.

`llmplug save-sharded MODEL OUT --tensor-parallel-size N` runs `save_sharded_state` in every worker of
an engine that loaded MODEL: rank r writes `model-rank-{r}-part-{i}.safetensors` with its parameters
under llmplug's own names (fused and already sliced), and rank 0 adds the model's config and
`sharded_state.json` (the tensor- and pipeline-parallel sizes). Loading builds the model for the
same layout and copies each tensor into its parameter: no weight_loader, no resharding, and no rank
opens another rank's files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch

from llmplug.communicators.parallel_state import get_pp_group, get_tp_group, get_world_group
from llmplug.core.errors import ConfigError, ModelLoadError
from llmplug.layers.weight_utils import check_shape
from llmplug.loaders.base import BaseModelLoader, LoadProgress
from llmplug.loaders.weights import safetensors_weights_iterator

if TYPE_CHECKING:
    from llmplug.core.config import ModelConfig

__all__ = ["LAYOUT_FILE", "ShardedStateLoader", "rank_files", "save_sharded_state"]

LAYOUT_FILE = "sharded_state.json"
MAX_PART_BYTES = 2 * 2**30


def rank_files(folder: Path, rank: int) -> list[Path]:
    """The weight files of `rank` in a sharded-state folder, in order."""
    return sorted(folder.glob(f"model-rank-{rank}-part-*.safetensors"), key=lambda f: int(f.stem.rsplit("-", 1)[1]))


def save_sharded_state(worker: Any, out: str) -> list[str]:
    """Write this worker's parameters (and, on rank 0, the config and layout) into `out`; returns its file names.

    Called in every worker through `collective_rpc(save_sharded_state, (out,))`.
    """
    from safetensors.torch import save_file

    folder, rank = Path(out), get_world_group().rank
    folder.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        worker.model_runner.hf_config.save_pretrained(folder)
        layout = {"tensor_parallel_size": get_tp_group().world_size, "pipeline_parallel_size": get_pp_group().world_size}
        (folder / LAYOUT_FILE).write_text(json.dumps(layout))
    names = []
    for i, part in enumerate(_parts(worker.model_runner.model.named_parameters())):
        names.append(f"model-rank-{rank}-part-{i}.safetensors")
        save_file({name: tensor.detach().contiguous() for name, tensor in part}, str(folder / names[-1]))
    return names


def _parts(params: Iterable[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """Parameters grouped into files of at most MAX_PART_BYTES (a larger tensor gets a file of its own)."""
    parts: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in params:  # named_parameters lists a tied weight once
        nbytes = tensor.numel() * tensor.element_size()
        if parts[-1] and size + nbytes > MAX_PART_BYTES:
            parts.append([])
            size = 0
        parts[-1].append((name, tensor))
        size += nbytes
    return parts


class ShardedStateLoader(BaseModelLoader):
    """Loads the files `save_sharded_state` wrote for this process's rank."""

    def iter_weights(self, model_config: "ModelConfig") -> Iterable[tuple[str, torch.Tensor]]:
        """This rank's tensors, under the names of the model's parameters."""
        folder = Path(self.model_path(model_config.model))
        files = rank_files(folder, get_world_group().rank)
        if not files:
            raise ModelLoadError(f"{folder} has no weight files of rank {get_world_group().rank} (model-rank-*-part-*)")
        return safetensors_weights_iterator(files)

    def load_weights(self, model: torch.nn.Module, model_config: "ModelConfig", progress: LoadProgress) -> None:
        """Copy each saved tensor into the parameter of that name; every parameter must get one."""
        _check_layout(Path(self.model_path(model_config.model)))
        params = dict(model.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, tensor in progress.track(self.iter_weights(model_config)):
                if name not in params:
                    raise ModelLoadError(f"saved tensor {name!r} is no parameter of {type(model).__name__}")
                check_shape(params[name], tensor, name)
                params[name].copy_(tensor)
                loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ModelLoadError(f"the saved sharded state has no tensors for {missing}; save it again")


def _check_layout(folder: Path) -> None:
    """ConfigError unless the folder was saved for this engine's tensor- and pipeline-parallel sizes."""
    try:
        saved = json.loads((folder / LAYOUT_FILE).read_text())
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{folder / LAYOUT_FILE} cannot be read ({error}); is this a sharded-state folder?") from None
    here = {"tensor_parallel_size": get_tp_group().world_size, "pipeline_parallel_size": get_pp_group().world_size}
    if saved != here:
        raise ConfigError(
            f"{folder} holds weights sharded for {saved}, but this engine runs {here}: start it with the saved "
            f"sizes, or save again with `llmplug save-sharded MODEL OUT --tensor-parallel-size "
            f"{here['tensor_parallel_size']}`"
        )
