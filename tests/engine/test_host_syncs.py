"""One engine step reads the device once (the sampled token ids) and copies its inputs to the device once.

Counted device-agnostically: a TorchFunctionMode records every call that needs a tensor's values on the host
(`.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool()`/`int()`/`float()` of a tensor, `nonzero`) and every
copy to a device (`.to(device)`, `torch.tensor(..., device=)`), made by llmplug's own code during
`LLM.step()`; on a GPU each read is a host sync. The backend is `triton` (the GPU default), under triton's
interpreter here, whose own host copies are the interpreter's, not llmplug's, and are not counted.
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import llmplug
from llmplug import LLM, SamplingParams
from tests.models.tiny_models import make_tiny

LLMPLUG_DIR = os.path.dirname(llmplug.__file__)
TORCH_DIR = os.path.dirname(torch.__file__)
HOST_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
    torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
}


class SyncCounter(TorchFunctionMode):
    """Counts host reads and device copies by llmplug code, keyed by (kind, file, line)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter = collections.Counter()
        self.copies: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            self._count(self.reads, func)
        elif func is torch.Tensor.to and _names_a_device(args[1:], kwargs):
            self._count(self.copies, func)
        elif func in (torch.tensor, torch.as_tensor) and "device" in kwargs:
            self._count(self.copies, func)
        return func(*args, **kwargs)

    @staticmethod
    def _count(counter: collections.Counter, func) -> None:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
            frame = frame.f_back  # the code that called into torch
        if frame is not None and frame.f_code.co_filename.startswith(LLMPLUG_DIR):
            where = os.path.relpath(frame.f_code.co_filename, LLMPLUG_DIR)
            counter[(func.__name__, where, frame.f_lineno)] += 1


def _names_a_device(args, kwargs) -> bool:
    return "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    tiny = make_tiny("llama", tmp_path_factory.mktemp("llama_syncs"))
    return LLM(str(tiny.path), dtype="float32", skip_tokenizer_init=True, attention_backend="triton")


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=4),
        SamplingParams(temperature=0.8, max_tokens=4),
        SamplingParams(temperature=0.8, max_tokens=4, seed=7),
    ],
    ids=["greedy", "random", "seeded"],
)
def test_each_step_reads_the_device_once_and_copies_its_inputs_once(llm: LLM, params: SamplingParams) -> None:
    for n in (5, 12, 20):  # prompts of different lengths: a prefill step, then decode steps
        llm.add_request({"prompt_token_ids": list(range(1, n + 1))}, params)
    steps = []
    while llm.llm_engine.has_unfinished_requests():
        counter = SyncCounter()
        with counter:
            llm.step()
        steps.append(counter)
    assert len(steps) == 4
    for i, counter in enumerate(steps):
        # the sampled token ids, nothing else
        assert [(kind, where) for kind, where, _ in counter.reads] == [("tolist", "engine/model_runner.py")], i
        assert sum(counter.reads.values()) == 1, (i, counter.reads)
        # the step's flattened inputs; the first step also builds the batch's sampling tensors
        if i > 0:
            assert sum(counter.copies.values()) == 1, (i, counter.copies)


def test_the_counter_sees_a_read_made_by_llmplug_code() -> None:
    from llmplug.layers.kernels.reference import reshape_and_cache_ref

    cache = torch.zeros(2, 2, 4, 1, 2)
    with SyncCounter() as counter:
        reshape_and_cache_ref(torch.ones(3, 2), torch.ones(3, 2), cache[0], cache[1], torch.tensor([0, 5, 6]))
        torch.zeros(2).tolist()  # this test's own read: not llmplug's
    assert [(kind, where) for kind, where, _ in counter.reads] == [("tolist", "layers/kernels/reference.py")]
