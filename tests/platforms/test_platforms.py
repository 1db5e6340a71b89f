"""Platforms: detection on this CPU-only machine, choosing by name or priority, dtype and device answers.

The accelerator platforms are asked for real: on a machine without them they must say they are not
available and what was detected. Third-party platforms are real distributions (a .dist-info with
entry points) written into a temporary site directory.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from llmplug.core.config import EngineConfig
from llmplug.core.errors import ConfigError, PluginLoadError
from llmplug.core.plugins import PluginRegistry
from llmplug.layers.packed_linear import prepack_supported
from llmplug.core.protocols import Platform
from llmplug.platforms import BasePlatform, detect_platforms, resolve_platform
from llmplug.platforms.cpu import CpuPlatform
from llmplug.platforms.cpu_threads import available_cpu_count
from llmplug.platforms.cuda import CudaPlatform
from llmplug.platforms.rocm import RocmPlatform
from llmplug.platforms.tpu import TpuPlatform
from llmplug.platforms.xpu import XpuPlatform

IN_TREE = {"cpu": CpuPlatform, "cuda": CudaPlatform, "rocm": RocmPlatform, "tpu": TpuPlatform, "xpu": XpuPlatform}
ACCELERATORS = ["cuda", "rocm", "tpu", "xpu"]
TOY_PLATFORM = Path(__file__).resolve().parents[1] / "plugins" / "toy_platform" / "llmplug_example_toy_platform.py"


def _cpu_flags() -> set[str]:
    """The CPU's feature flags, read here independently of the platform code."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = [line for line in text.splitlines() if line.startswith(("flags", "Features"))]
    return {flag for line in lines for flag in line.split(":")[1].split()}


# --- registration and detection --------------------------------------------------------------------------


def test_every_in_tree_platform_is_registered_and_implements_the_protocol():
    registry = PluginRegistry()
    assert set(IN_TREE) <= set(registry.names("llmplug.platforms"))
    for name, platform in IN_TREE.items():
        assert registry.load("llmplug.platforms", name) is platform
        assert isinstance(platform, Platform) and platform.name == name


def test_auto_chooses_cpu_on_a_machine_without_accelerators():
    assert resolve_platform("auto") is CpuPlatform
    assert resolve_platform("cpu") is CpuPlatform
    assert CpuPlatform.is_available() and CpuPlatform.unavailable_reason() is None


@pytest.mark.parametrize("name", ACCELERATORS)
def test_accelerator_platforms_are_unavailable_here_and_say_what_was_detected(name):
    platform = IN_TREE[name]
    reason = platform.unavailable_reason()
    assert not platform.is_available()
    expected = "torch_xla" if name == "tpu" else f"torch {torch.__version__}"
    assert reason and expected in reason


def test_cpu_only_torch_build_is_named_as_the_reason():
    if torch.version.cuda is not None or torch.version.hip is not None:
        pytest.skip("this torch is built with a GPU runtime")
    assert CudaPlatform.unavailable_reason() == f"torch {torch.__version__} was built without CUDA"
    assert RocmPlatform.unavailable_reason() == f"torch {torch.__version__} was built without ROCm (HIP)"


def test_detect_platforms_reports_every_registered_platform():
    report = detect_platforms()
    assert report["cpu"] is None
    assert all(report[name] for name in ACCELERATORS)


def test_naming_an_unavailable_platform_is_a_config_error_saying_what_was_detected():
    with pytest.raises(ConfigError) as error:
        resolve_platform("cuda")
    message = str(error.value)
    assert "device.platform='cuda'" in message
    assert CudaPlatform.unavailable_reason() in message
    assert "tpu: torch_xla is not installed" in message
    assert message.endswith("one of: cpu.")


def test_an_unknown_platform_name_lists_the_registered_ones():
    with pytest.raises(ConfigError) as error:
        resolve_platform("cudaa")
    message = str(error.value)
    assert "device.platform='cudaa'" in message and "Did you mean 'cuda'?" in message
    assert "cpu, cuda, rocm, tpu, xpu" in message


def test_listing_and_choosing_platform_modules_imports_no_torch():
    code = """
        import json, sys
        from llmplug.core.plugins import get_registry
        import llmplug.platforms
        names = get_registry().names("llmplug.platforms")
        for name in names:
            get_registry().load("llmplug.platforms", name)
        print(json.dumps({"names": names, "torch": "torch" in sys.modules}))
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert set(IN_TREE) <= set(result["names"]) and result["torch"] is False


# --- dtypes and config -------------------------------------------------------------------------------------


def test_cpu_prefers_bfloat16_exactly_when_the_cpu_has_native_bf16(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    native = bool({"avx512_bf16", "amx_bf16", "bf16"} & _cpu_flags())
    assert CpuPlatform.preferred_dtype() == ("bfloat16" if native else "float32")


@pytest.mark.parametrize("cap", ["AVX2", "AVX512_CORE", "avx512_core_vnni"])
def test_an_isa_cap_below_bf16_makes_float32_preferred(monkeypatch, cap):
    """Under ONEDNN_MAX_CPU_ISA without bf16 instructions oneDNN emulates bf16 (several times slower than float32
    on 2 AVX2 cores), whatever the CPU has."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert CpuPlatform.preferred_dtype() == "float32"


@pytest.mark.parametrize("cap", ["AVX2", "AVX512_CORE"])
def test_an_isa_cap_below_bf16_leaves_bf16_weights_unpacked(monkeypatch, cap):
    """Emulating bf16, oneDNN's packed kernel sums in another order than F.linear's (found on 1536 x 576 at odd row
    counts on a Zen 4 and at 33 rows of 96 x 64 on CI's CPU), so a packed weight would change the tokens."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    prepack_supported.cache_clear()
    try:
        assert not prepack_supported("cpu", torch.bfloat16)
    finally:
        prepack_supported.cache_clear()


def test_auto_dtype_resolves_to_the_platforms_preferred_dtype():
    config = EngineConfig()
    CpuPlatform.check_and_update_config(config)
    assert config.model.dtype == CpuPlatform.preferred_dtype()
    if "avx512_bf16" in _cpu_flags():  # this development machine
        assert config.model.dtype == "bfloat16"


def test_an_explicit_supported_dtype_is_kept():
    config = EngineConfig(model={"dtype": "float16"})
    CpuPlatform.check_and_update_config(config)
    assert config.model.dtype == "float16"


def test_an_unsupported_dtype_is_a_config_error_naming_the_field_and_the_supported_dtypes():
    # TPUs have no float16; this check needs no TPU, only the platform's dtype table
    with pytest.raises(ConfigError) as error:
        TpuPlatform.check_and_update_config(EngineConfig(model={"dtype": "float16"}))
    message = str(error.value)
    assert "model.dtype='float16'" in message and "'tpu'" in message
    assert "supported here: bfloat16, float32" in message


def test_config_gets_the_default_attention_backend_unless_one_was_requested():
    config = EngineConfig()
    CpuPlatform.check_and_update_config(config)
    assert config.device.attention_backend == "torch_sdpa"
    config = EngineConfig(device={"attention_backend": "my_paged"})
    CpuPlatform.check_and_update_config(config)
    assert config.device.attention_backend == "my_paged"


def test_gpu_platforms_choose_the_triton_backend_and_the_cpu_keeps_torch_sdpa(monkeypatch):
    # config-time answers: they need no GPU, only the platform classes and whether triton is installed
    assert CudaPlatform.get_attention_backend(None, None, "bfloat16") == "triton"
    assert RocmPlatform.get_attention_backend(None, 128, "float16") == "triton"
    assert CudaPlatform.get_attention_backend("torch_sdpa", 64, "bfloat16") == "torch_sdpa"
    for platform in (CpuPlatform, TpuPlatform, XpuPlatform):
        assert platform.get_attention_backend(None, 64, "float32") == "torch_sdpa"
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    assert CudaPlatform.get_attention_backend(None, None, "bfloat16") == "torch_sdpa"  # without triton


def test_cpu_threads_default_to_the_cores_split_among_the_workers():
    config = EngineConfig(parallel={"tensor_parallel_size": 2})
    CpuPlatform.check_and_update_config(config)
    assert config.device.num_threads == max(1, available_cpu_count() // 2)
    config = EngineConfig(device={"num_threads": 7})
    CpuPlatform.check_and_update_config(config)
    assert config.device.num_threads == 7


def test_platform_answers_about_backends_by_capability():
    assert (CpuPlatform.distributed_backend, CpuPlatform.get_communicator()) == ("gloo", "cpu")
    assert (CudaPlatform.distributed_backend, RocmPlatform.distributed_backend) == ("nccl", "nccl")
    assert (TpuPlatform.distributed_backend, XpuPlatform.distributed_backend) == ("xla", "xccl")
    assert CpuPlatform.get_attention_backend("flash", 64, torch.bfloat16) == "flash"
    assert CpuPlatform.supports_dtype("bfloat16") and not TpuPlatform.supports_dtype("float16")


# --- devices, memory, seeding -------------------------------------------------------------------------------


def test_cpu_memory_queries_return_positive_byte_counts():
    total, free = CpuPlatform.total_memory(), CpuPlatform.available_memory()
    assert isinstance(total, int) and isinstance(free, int)
    assert 0 < free <= total
    assert 0 <= CpuPlatform.memory_for_kv_cache(0.9) <= free


def test_every_worker_on_the_cpu_uses_the_one_cpu_device():
    assert CpuPlatform.device_count() == 1
    assert [CpuPlatform.visible_device_index(rank) for rank in range(4)] == [0, 0, 0, 0]
    assert CpuPlatform.device(CpuPlatform.visible_device_index(3)) == torch.device("cpu")
    assert torch.zeros(1, device=CpuPlatform.device(0)).device == CpuPlatform.device(0)
    CpuPlatform.set_device(0)  # no-ops on the CPU, but the engine calls them on every platform
    CpuPlatform.synchronize()
    CpuPlatform.empty_cache()


def test_a_worker_picks_its_device_among_those_it_sees():
    class FourVisibleDevices(BasePlatform):
        """A platform whose process sees four devices (the index logic needs no hardware)."""

        @classmethod
        def device_count(cls) -> int:
            return 4

    assert [FourVisibleDevices.visible_device_index(rank) for rank in range(6)] == [0, 1, 2, 3, 0, 1]


def test_a_platform_that_sees_no_device_refuses_to_pick_one():
    with pytest.raises(ConfigError, match="'cuda' sees no device"):
        CudaPlatform.visible_device_index(0)


def test_seed_everything_makes_python_numpy_and_torch_reproducible():
    def draw() -> tuple:
        return random.random(), float(np.random.rand()), torch.rand(3)

    CpuPlatform.seed_everything(1234)
    first = draw()
    CpuPlatform.seed_everything(1234)
    second = draw()
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])


# --- third-party platforms ------------------------------------------------------------------------------------


def _install_distribution(site: Path, name: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """Write an installed distribution into `site`: its modules plus a .dist-info with its entry points."""
    for module, source in modules.items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = "".join(f"{key} = {value}\n" for key, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[llmplug.platforms]\n{lines}")


@pytest.fixture
def third_party_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Three platform distributions on sys.path: one whose import fails, a preferred CPU variant, the toy."""
    monkeypatch.delenv("LLMPLUG_PLUGINS", raising=False)
    _install_distribution(
        tmp_path, "broken-platform", {"broken": "broken_platform:BrokenPlatform"},
        {"broken_platform": "import a_driver_that_is_not_installed\n"},
    )
    _install_distribution(
        tmp_path, "fast-cpu-platform", {"fastcpu": "fast_cpu_platform:FastCpuPlatform"},
        {"fast_cpu_platform": """
            from llmplug.platforms.cpu import CpuPlatform

            class FastCpuPlatform(CpuPlatform):
                name = "fastcpu"
                priority = 10  # above the in-tree CPU: auto prefers it when installed
        """},
    )
    _install_distribution(
        tmp_path, "toy-platform", {"toy": "llmplug_example_toy_platform:ToyPlatform"},
        {"llmplug_example_toy_platform": TOY_PLATFORM.read_text()},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_auto_skips_a_platform_whose_import_fails_and_prefers_the_highest_priority(third_party_site, caplog):
    registry = PluginRegistry()
    chosen = resolve_platform("auto", registry)
    assert chosen.name == "fastcpu" and issubclass(chosen, CpuPlatform)
    assert any("platform 'broken' skipped" in record.message for record in caplog.records)
    with pytest.raises(PluginLoadError, match="a_driver_that_is_not_installed"):
        resolve_platform("broken", registry)


def test_a_platform_that_implements_only_the_protocol_gets_the_base_defaults(third_party_site):
    toy = resolve_platform("toy", PluginRegistry())
    assert issubclass(toy, BasePlatform) and toy.name == "toy"
    config = EngineConfig()
    toy.check_and_update_config(config)  # its own method: float32
    assert config.model.dtype == "float32"
    assert toy.visible_device_index(5) == 0 and toy.preferred_dtype() == "float32"  # BasePlatform's
