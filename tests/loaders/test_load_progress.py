"""Every loader reports through LoadProgress: a tqdm bar, and one log line with the tensors, bytes and time."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import gguf
import pytest
import torch

from llmplug.core.config import EngineConfig, LoadConfig, ModelConfig
from llmplug.loaders.base import LoadProgress
from llmplug.loaders.default import DefaultLoader
from llmplug.loaders.dummy import DummyLoader
from llmplug.loaders.gguf import GGUFLoader
from llmplug.plugins.models.llama import LlamaForCausalLM
from tests.loaders.gguf_writer_utils import make_tiny_model, write_model_gguf
from tests.loaders.test_default_dummy import tiny_config, tiny_state_dict, write_checkpoint


class Terminal(io.StringIO):
    """A text stream that says it is a terminal, so tqdm draws its bar there."""

    def isatty(self) -> bool:
        return True


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def load_record(caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    """The one 'loaded ...' record of the load that just ran."""
    [record] = [r for r in caplog.records if r.name == "llmplug.loaders" and hasattr(r, "num_bytes")]
    return record


def test_track_counts_tensors_and_bytes_draws_the_bar_and_logs_them(caplog):
    pairs = [("a", torch.zeros(3, 4)), ("b", torch.zeros(5, dtype=torch.float16)), ("c", torch.zeros(2, 2))]
    terminal = Terminal()
    with caplog.at_level(logging.INFO, "llmplug.loaders"):
        with LoadProgress("toy", total=3, file=terminal) as progress:
            assert list(progress.track(pairs)) == pairs
    record = load_record(caplog)
    assert (record.num_tensors, record.num_bytes) == (3, 48 + 10 + 16)
    assert record.seconds >= 0 and "loaded toy: 3 tensors" in record.getMessage()
    assert "Loading toy" in terminal.getvalue() and "3/3" in terminal.getvalue()


def test_a_failed_load_logs_no_success_and_closes_its_bar(caplog):
    with caplog.at_level(logging.INFO, "llmplug.loaders"), pytest.raises(RuntimeError, match="disk"):
        with LoadProgress("toy", file=Terminal()) as progress:
            progress.advance(8)
            raise RuntimeError("disk gone")
    assert not [r for r in caplog.records if hasattr(r, "num_bytes")]


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_default_loader_reports_every_tensor_of_the_checkpoint(kind, tmp_path, caplog):
    config = tiny_config()
    state = tiny_state_dict(config)
    path = write_checkpoint(tmp_path, state, config, kind=kind)
    engine_config = EngineConfig(model=ModelConfig(model=str(path), dtype="float32"))
    with caplog.at_level(logging.INFO, "llmplug.loaders"):
        DefaultLoader(LoadConfig()).load_model(engine_config, model_class=LlamaForCausalLM)
    record = load_record(caplog)
    assert (record.num_tensors, record.num_bytes) == (len(state), nbytes(state.values()))
    assert record.getMessage().startswith(f"loaded {path.name}:")


def test_dummy_loader_reports_every_parameter_it_fills(tmp_path, caplog):
    tiny_config().save_pretrained(tmp_path)
    engine_config = EngineConfig(
        model=ModelConfig(model=str(tmp_path), dtype="bfloat16"), load=LoadConfig(format="dummy")
    )
    with caplog.at_level(logging.INFO, "llmplug.loaders"):
        model = DummyLoader(engine_config.load).load_model(engine_config, model_class=LlamaForCausalLM)
    params = list(model.parameters())
    assert (load_record(caplog).num_tensors, load_record(caplog).num_bytes) == (len(params), nbytes(params))


def test_gguf_loader_reports_every_tensor_of_the_file(tmp_path, caplog):
    path = write_model_gguf(tmp_path / "tiny.gguf", make_tiny_model(), gguf.GGMLQuantizationType.F32)
    engine_config = EngineConfig(model=ModelConfig(model=str(path), dtype="float32"), load=LoadConfig(format="gguf"))
    with caplog.at_level(logging.INFO, "llmplug.loaders"):
        GGUFLoader(engine_config.load).load_model(engine_config, model_class=LlamaForCausalLM)
    tensors = gguf.GGUFReader(str(path)).tensors
    record = load_record(caplog)
    assert (record.num_tensors, record.num_bytes) == (len(tensors), sum(int(t.n_bytes) for t in tensors))
    assert Path(path).name in record.getMessage()
