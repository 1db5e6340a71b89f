"""Settings of the whole test session."""

import ctypes
import ctypes.util
import gc
import os

import pytest

# one line per test module with its wall time and memory, and a summary at the end (issue 34: the suite must fit
# the 24 GiB machine, and CI's log must show which module grew)
pytest_plugins = ["tests.rss_report"]

# Triton kernels run in triton's interpreter (numpy on the host): the tests check them on CPU tensors.
# Triton reads this when a kernel module is imported, so it is set before any test imports one.
os.environ.setdefault("TRITON_INTERPRET", "1")

_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_module():
    """A module's engines and models are garbage once it ends: collect them and hand the pages glibc keeps
    back to the system, so the suite's memory peak is one module's, not the sum of all (2 cores, 24 GiB)."""
    yield
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


@pytest.fixture(scope="session")
def smollm2_transformers():
    """transformers' own load of the embedded SmolLM2 GGUF file (fp32, eval mode): the reference of the loader's
    weights (tests/loaders) and of the default model's tokens and logits (tests/models). Loaded once per run
    (dequantizing the file in Python takes many seconds); read-only, ~0.6 GiB kept to the end of the run."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmplug.core.config import DEFAULT_MODEL
    from llmplug.loaders.default_model import resolve_model_path

    folder, name = os.path.split(resolve_model_path(DEFAULT_MODEL))
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
