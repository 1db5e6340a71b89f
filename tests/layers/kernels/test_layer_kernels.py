"""The layers take their Triton kernel path when `use_triton` says so (forced here with
LLMPLUG_TRITON_KERNELS=1 under the interpreter) and then compute what their torch path computes."""

from __future__ import annotations

import pytest
import torch

from llmplug.engine.sampler import apply_token_bitmask
from llmplug.layers.activation import SiluAndMul
from llmplug.layers.kernels import KERNELS_ENV, use_triton
from llmplug.layers.layernorm import RMSNorm
from llmplug.layers.moe import FusedExperts, MoEConfig, RouterConfig
from llmplug.layers.rotary import RotaryCosSin, RotaryPositions, get_rope


def both_paths(monkeypatch: pytest.MonkeyPatch, fn):
    """fn() on the torch path, then on the kernel path."""
    results = []
    for mode in ("0", "1"):
        monkeypatch.setenv(KERNELS_ENV, mode)
        results.append(fn())
    return results


def test_auto_mode_uses_kernels_on_gpu_tensors_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert not use_triton(torch.zeros(1))  # a CPU tensor: torch path
    monkeypatch.setenv(KERNELS_ENV, "1")
    assert use_triton(torch.zeros(1))


def test_rms_norm_with_and_without_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(48, eps=1e-5)
    norm.weight.data = torch.rand(48, generator=gen) + 0.5
    x, residual = torch.randn(6, 48, generator=gen), torch.randn(6, 48, generator=gen)
    plain_torch, plain_kernel = both_paths(monkeypatch, lambda: norm(x.clone()))
    torch.testing.assert_close(plain_kernel, plain_torch, rtol=0, atol=1e-5)
    (out_t, sum_t), (out_k, sum_k) = both_paths(monkeypatch, lambda: norm(x.clone(), residual))
    torch.testing.assert_close(out_k, out_t, rtol=0, atol=1e-5)
    torch.testing.assert_close(sum_k, sum_t, rtol=0, atol=1e-6)


def test_silu_and_mul(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1))
    on_torch, on_kernel = both_paths(monkeypatch, lambda: SiluAndMul()(x.clone()))
    torch.testing.assert_close(on_kernel, on_torch, rtol=0, atol=1e-6)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "interleaved"])
def test_rotary_step_rotates_q_and_k_alike(monkeypatch: pytest.MonkeyPatch, neox: bool) -> None:
    rope = get_rope(32, 32, 128, 10000.0, is_neox_style=neox)
    gen = torch.Generator().manual_seed(2)
    positions = torch.randint(0, 128, (7,), generator=gen)
    qk = torch.randn(7, 6, 32, generator=gen)

    def rotate():
        step = rope.cos_sin(positions, qk.dtype)
        return type(step), step.apply_(qk.clone())

    (kind_t, on_torch), (kind_k, on_kernel) = both_paths(monkeypatch, rotate)
    assert (kind_t, kind_k) == (RotaryCosSin, RotaryPositions)
    torch.testing.assert_close(on_kernel, on_torch, rtol=0, atol=1e-5)


def test_sampler_bitmask(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1
    logits = torch.randn(3, 120, generator=gen)

    def apply():
        out = logits.clone()
        apply_token_bitmask(out, bitmask)
        return out

    on_torch, on_kernel = both_paths(monkeypatch, apply)
    assert torch.equal(on_kernel, on_torch)


def test_moe_experts_group_tokens_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(4)
    experts = FusedExperts(MoEConfig(RouterConfig(8, 2), 16), hidden_size=32)
    experts.gate_up_proj.data.normal_(generator=gen)
    experts.down_proj.data.normal_(generator=gen)
    x = torch.randn(70, 32, generator=gen)  # 140 assignments: three kernel chunks
    ids = torch.rand(70, 6, generator=gen).argsort(dim=1)[:, :2]  # experts 6 and 7 get no token
    weights = torch.rand(70, 2, generator=gen)
    on_torch, on_kernel = both_paths(monkeypatch, lambda: experts(x, weights, ids))
    torch.testing.assert_close(on_kernel, on_torch, rtol=1e-5, atol=1e-5)  # SiLU-and-mul's kernel also runs
