"""llmplug's AMX dense kernel (`llmplug_cpu::amx_linear`) vs oneDNN's one call, on SmolLM2-135M's four projection
shapes, at prefill and decode row counts.

    python benchmarks/amx_linear.py [--rows 16,32,64,256,1450] [--rounds 5]

Each shape ([N, K]: qkv [960, 576], o [576, 576], gate_up [3072, 576], down [576, 1536]) has its own random bf16
weight, packed once for each kernel (`pack_weight`; oneDNN's `_reorder_linear_weight`). A round times every shape
in turn, the two kernels alternating; reported per M: the best round's ms of each shape, the model's 30 layers'
sum (the four shapes x 30) and its TFLOP/s. oneDNN's one call is not batch invariant (its sum order follows M); it
is here as the speed to reach. Needs a CPU and build with AMX-BF16 (`llmplug collect-env`); timings are noisy on
a shared machine, so compare runs made back to back.
"""

from __future__ import annotations

import argparse
import time

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads()  # before torch is imported: the OpenMP wait policy is read at import

import torch  # noqa: E402

from llmplug.layers.kernels.amx_linear import amx_linear, amx_linear_enabled, pack_weight  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # [N, K]
LAYERS = 30


def best_ms(matmul, x: torch.Tensor, rounds: int) -> float:
    """The best of `rounds` rounds of ms per call (a round: enough calls for ~2,000 rows)."""
    calls = max(3, 2000 // x.shape[0])
    matmul(x)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            matmul(x)
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,32,64,256,1450", help="comma-separated M values")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not amx_linear_enabled():
        raise SystemExit("llmplug's AMX kernels do not run here (no AMX-BF16, LLMPLUG_CPU_AMX=0 or an ISA cap)")
    gen = torch.Generator().manual_seed(0)
    weights = {name: (torch.randn(shape, generator=gen) * 0.02).bfloat16() for name, shape in SHAPES.items()}
    kernels = {}
    for name, weight in weights.items():
        packed, onednn = pack_weight(weight), torch.ops.mkldnn._reorder_linear_weight(weight)
        kernels[name] = {
            "amx_linear": lambda x, p=packed, n=weight.shape[0]: amx_linear(x, p, None, n),
            "oneDNN": lambda x, w=onednn: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        }
    print(f"{torch.get_num_threads()} threads, bf16, best of {args.rounds} rounds, ms")
    print("| M | kernel | " + " | ".join(SHAPES) + " | 30 layers | TFLOP/s |")
    print("|---|---|" + "---|" * (len(SHAPES) + 2))
    for rows in (int(m) for m in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {k for _, k in SHAPES.values()}}
        for kernel in ("amx_linear", "oneDNN"):
            ms = {name: best_ms(kernels[name][kernel], inputs[SHAPES[name][1]], args.rounds) for name in SHAPES}
            total = sum(ms.values()) * LAYERS
            flops = 2 * rows * sum(n * k for n, k in SHAPES.values()) * LAYERS
            print(f"| {rows} | {kernel} | " + " | ".join(f"{v:.3f}" for v in ms.values()) +
                  f" | {total:.2f} | {flops / total / 1e9:.2f} |", flush=True)


if __name__ == "__main__":
    main()
