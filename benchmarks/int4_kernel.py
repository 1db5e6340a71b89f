"""llmplug's int4 matmuls (W4A8; bf16 activations in two layouts) vs torch's int4 kernel vs dense packed bf16, on
SmolLM2-135M's linear layers.

    python benchmarks/int4_kernel.py [--rows 1,2,4,8,16,32] [--rounds 5] [--steps 3] [--layers 30] [--threads N]

A step is every linear layer of the model once (qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536]
for each of `--layers` layers, each with its own random weight, then the LM head [49152, 576]) on M rows of bf16
activations; `--layers 0` times the head alone. The weights are quantized as the default GGUF's are: the layers
Q4_1 (float16 d and m, one int4 plane), the head Q8_0 (float16 d, two planes). Compared, in one process, the kernels
alternating within each round: `w4a8` (W4A8.pack, llmplug_cpu::w4a8_matmul: the layers' Q4_1 blocks times int8
activations, 0.625 bytes a weight; the head, which W4A8 does not take, as `native`: what the default model runs),
`native` (NativeInt4.pack, llmplug_cpu::int4_matmul: float16 scales and minimums,
0.625 bytes a weight; the head as int8 codes, 1.0625), `native f32 groups` (the same kernel on the layout before
those: float32 scales and zeros, 0.75 bytes a weight a plane, the head 1.5), `torch int4` (PackedInt4,
`_weight_int4pack_mm_for_cpu`, bf16 scales and zeros) and `dense` (the bf16 weight packed for oneDNN,
`mkldnn._linear_pointwise`, what a dense layer runs). The native kernels compute the same weights; w4a8 those
weights with int8 activations.
Reported: ms per step, the best round of each (a round times `--steps` steps), and the ratios. Timings are noisy on
a shared machine: compare the ratios, and note the load (`uptime`) printed with them.

On a CPU with AMX the native kernels take their AMX path; `LLMPLUG_CPU_AMX=0 python benchmarks/int4_kernel.py ...`
times their AVX-512 path (read once per process, so AMX against AVX-512 is two runs, alternated; the header line
says which ran).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from datetime import datetime, timezone
from typing import Callable

import torch

from llmplug.layers.kernels.amx_linear import AMX_ENV
from llmplug.layers.kernels.int4_matmul import NativeInt4, native_int4_available
from llmplug.layers.kernels.w4a8 import W4A8
from llmplug.layers.quantization import Int4Groups, PackedInt4

HIDDEN, INTERMEDIATE, VOCAB = 576, 1536, 49152
LAYER_SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # [N, K]
HEAD_SHAPE = (VOCAB, HIDDEN)
DTYPE = torch.bfloat16
KERNELS = ("w4a8", "native", "native f32 groups", "torch int4", "dense")
GROUP = 32

Matmul = Callable[[torch.Tensor], torch.Tensor]


def q4_1(weight: torch.Tensor) -> Int4Groups:
    """GGUF Q4_1 groups of a [N, K] weight, as the loader decodes them: w = d (q - 8) + (m + 8 d), d and m float16."""
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // GROUP, GROUP)
    low, high = blocks.amin(-1), blocks.amax(-1)
    d, m = ((high - low) / 15).half().float(), low.half().float()
    q = ((blocks - m[..., None]) / torch.where(d > 0, d, 1)[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Int4Groups(q.reshape(1, n, k), d[None], (m + 8 * d)[None], GROUP)


def q8_0(weight: torch.Tensor) -> Int4Groups:
    """GGUF Q8_0 groups of a [N, K] weight as the loader decodes them: w = d q8 as two int4 planes."""
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // GROUP, GROUP)
    d = (blocks.abs().amax(-1) / 127).half().float()
    biased = ((blocks / torch.where(d > 0, d, 1)[..., None]).round().clamp(-127, 127) + 128).to(torch.uint8)
    q = torch.stack([biased >> 4, biased & 15]).reshape(2, n, k)
    return Int4Groups(q, torch.stack([16 * d, d]), torch.stack([torch.zeros_like(d), 8 * d]), GROUP)


def float32_groups(groups: Int4Groups) -> NativeInt4:
    """The kernel's layout before float16 parameters and int8 codes: int4 planes, float32 scales and zeros."""
    planes, n, k = groups.q.shape
    q = groups.q.permute(1, 0, 2).reshape(n, planes, k // 32, 2, 16)  # [N, P, blocks, half, 16]
    codes = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, planes, k // 2).contiguous()
    scales, zeros = (t.permute(1, 0, 2).contiguous() for t in (groups.scale, groups.zero))  # [N, P, G]
    return NativeInt4(codes, scales, zeros, groups.group_size, DTYPE)


def kernels_for(weight: torch.Tensor, head: bool) -> dict[str, Matmul]:
    """The ways (KERNELS) to compute x @ weight^T for one [N, K] weight (Q8_0 for the head, else Q4_1)."""
    groups = q8_0(weight) if head else q4_1(weight)
    native = NativeInt4.pack(groups, DTYPE)
    w4a8 = W4A8.pack(groups)  # None for the head's Q8_0 planes
    packed_int4 = PackedInt4.pack(groups, DTYPE, torch.device("cpu"))
    dense = torch.ops.mkldnn._reorder_linear_weight(weight.to(DTYPE))
    return {
        "w4a8": (w4a8 or native).matmul,
        "native": native.matmul,
        "native f32 groups": float32_groups(groups).matmul,
        "torch int4": packed_int4.matmul,
        "dense": lambda x: torch.ops.mkldnn._linear_pointwise(x, dense, None, "none", [], ""),
    }


def model_weights(layers: int, generator: torch.Generator) -> list[tuple[dict[str, Matmul], int]]:
    """Every linear layer of the model (`layers` decoder layers, then the head), each with its own weight: its
    kernels and its input width K."""
    shapes = LAYER_SHAPES * layers + [HEAD_SHAPE]
    return [(kernels_for(torch.randn(shape, generator=generator) * 0.02, shape == HEAD_SHAPE), shape[1])
            for shape in shapes]


def step_seconds(plan: list[tuple[Matmul, int]], inputs: dict[int, torch.Tensor], steps: int) -> float:
    """Seconds per step: every layer (its matmul, its input width) once, `steps` times."""
    start = time.perf_counter()
    for _ in range(steps):
        for matmul, k in plan:
            matmul(inputs[k])
    return (time.perf_counter() - start) / steps


def measure(
    rows: int, layers: list[tuple[dict[str, Matmul], int]], rounds: int, steps: int
) -> dict[str, float]:
    """Best ms per step of each kernel at `rows` rows, the kernels alternating (order rotated) in each round."""
    inputs = {k: torch.randn(rows, k).to(DTYPE) for k in (HIDDEN, INTERMEDIATE)}
    names = list(KERNELS)
    plans = {name: [(kernels[name], k) for kernels, k in layers] for name in names}
    best = {name: float("inf") for name in names}
    for name in names:  # warm-up: first-touch, thread pool
        step_seconds(plans[name], inputs, 1)
    for round_ in range(rounds):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            best[name] = min(best[name], step_seconds(plans[name], inputs, steps) * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32", help="comma-separated M values")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed round")
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M has 30)")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not native_int4_available():
        raise SystemExit("llmplug's CPU kernels are not built here (see the log)")
    layers = model_weights(args.layers, torch.Generator().manual_seed(0))
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.get_num_threads()} threads, "
          f"{args.layers} layers + head, bf16, best of {args.rounds} rounds x {args.steps} steps, "
          f"{AMX_ENV}={os.environ.get(AMX_ENV, '')!r}")
    print(f"load before: {uptime}")
    print("| M | w4a8 ms | native ms | native f32 groups ms | torch int4 ms | dense bf16 ms | w4a8 / native | "
          "native / f32 groups | native / torch int4 | native / dense |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rows in (int(m) for m in args.rows.split(",")):
        best = measure(rows, layers, args.rounds, args.steps)
        w4a8, native, float32, torch_int4, dense = (best[name] for name in KERNELS)
        print(f"| {rows} | {w4a8:.2f} | {native:.2f} | {float32:.2f} | {torch_int4:.2f} | {dense:.2f} | "
              f"{w4a8 / native:.2f} | {native / float32:.2f} | {native / torch_int4:.2f} | {native / dense:.2f} |",
              flush=True)
    print(f"load after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
