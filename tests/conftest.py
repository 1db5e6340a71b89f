"""Settings of the whole test session."""

import ctypes
import ctypes.util
import functools
import gc
import os
import sys

import pytest

# one line per test module with its wall time and memory, and a summary at the end (issue 34: the suite must fit
# the 24 GiB machine, and CI's log must show which module grew)
pytest_plugins = ["tests.rss_report"]

# Triton kernels run in triton's interpreter (numpy on the host): the tests check them on CPU tensors.
# Triton reads this when a kernel module is imported, so it is set before any test imports one.
os.environ.setdefault("TRITON_INTERPRET", "1")

_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None

# The CPU platform's default KV-cache budget suits one engine per machine: a quarter of the free memory, up to 4 GiB,
# allocated zero-filled (all resident) whatever the model's size. This process holds several engines at once (a
# module's, the servers of a package), so each got up to 4 GiB: most of the 20.8 GiB peak of issue 34. 512 MiB
# still holds 11k tokens of the default model in float32 (one request of its full 8192 tokens); tests that size
# the cache on purpose set `num_blocks` or `kv_cache_memory` and are untouched.
TEST_KV_CACHE_BYTES = 512 * 2**20

# A test that leaves this much more resident memory than it found has likely dropped an engine: models and engines
# hold reference cycles, so without a collection their weights stay until Python's next full collection.
_GROWTH_WORTH_COLLECTING = 256 * 2**20


def _forget_fastapi_endpoints() -> None:
    """Empty FastAPI's process-wide caches keyed by endpoint function (fastapi.dependencies.models, 4096 entries
    each): they hold every app's route closures, and through them each served engine, model and KV cache, long
    after the server and its fixture ended. Only a classification cache: a live app refills it on its next request."""
    models = sys.modules.get("fastapi.dependencies.models")
    for value in vars(models).values() if models is not None else ():
        if isinstance(value, functools._lru_cache_wrapper):
            value.cache_clear()


def _release_memory() -> None:
    """Collect garbage cycles and hand the free pages glibc keeps back to the system."""
    _forget_fastapi_endpoints()
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def _resident_bytes() -> int:
    """This process's resident set (0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="session")
def _small_default_kv_cache():
    """Every engine of the session that does not size its KV cache gets TEST_KV_CACHE_BYTES, not up to 4 GiB."""
    from llmplug.platforms import cpu

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu, "DEFAULT_KV_CACHE_BYTES", TEST_KV_CACHE_BYTES)
        yield


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_module():
    """A module's engines and models are garbage once it ends: collect them, so the suite's memory peak is one
    module's, not the sum of all (2 cores, 24 GiB)."""
    yield
    _release_memory()


@pytest.fixture(autouse=True)
def _release_engines_a_test_dropped():
    """An engine built inside a test (not by a fixture) is garbage when the test ends, but its cycles keep the model
    until a full collection: collect after a test whose memory grew, before the next one builds its own."""
    before = _resident_bytes()
    yield
    if _resident_bytes() - before > _GROWTH_WORTH_COLLECTING:
        _release_memory()


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
