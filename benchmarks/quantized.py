"""Decode and prefill tokens/s of a quantized checkpoint (GPTQ 4-bit or FP8 128x128 blocks) against the same model
dense, in bf16 and float32.

    python benchmarks/quantized.py --format gptq                   # hidden 1024, 4 layers, 2816 intermediate
    python benchmarks/quantized.py --format fp8 --threads 1 --prompt 128 --new 64
    python benchmarks/quantized.py --format fp8 --kernel --threads 1    # fp8_matmul alone, ns a weight

Writes a random Llama-shaped checkpoint (float32) and its quantized copy -- gptq: symmetric round-to-nearest in
groups of `group_size`, packed as AutoGPTQ packs (qweight [K / 8, N], qzeros [G, N / 8] storing zero - 1, scales
fp16 [G, N]); fp8: vLLM's blockwise quantizer (scale = block amax / 448) -- then for each variant loads it with
`llmplug.LLM` and times, after a warm-up, one prompt of `prompt` tokens with one new token (prefill tok/s) and the
same prompt with `new` tokens (decode tok/s: the extra tokens over the extra time); prefix caching is off, so
every repeat prefills the whole prompt. The quantized weights stay packed (llmplug/quantization/). Medians of
`repeats`, in wall clock and in the process's CPU time: on a shared machine run it with --threads 1 and read the
CPU-time columns, which do not count waiting for a core.

--kernel (fp8): llmplug's `fp8_matmul` alone against the engine's dense matmul (bf16: oneDNN on prepacked weights;
float32: F.linear), in CPU-ns per weight and row, on the model's
projection shapes at 1 row (decode) and `prompt` rows (prefill), each weight read from memory (copies of the weights
larger than the caches).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from llmplug import LLM, SamplingParams
from llmplug.testing.tiny import save_tiny_checkpoint, tiny_config

FP8_MAX = 448.0


def pack_along(values: torch.Tensor, dim: int) -> torch.Tensor:
    """4-bit values (0..15) -> int32 words of 8 consecutive values along `dim`, lowest bits first."""
    moved = values.movedim(dim, -1).to(torch.int64)
    words = (moved.reshape(*moved.shape[:-1], -1, 8) << torch.arange(0, 32, 4)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim).contiguous()


def gptq_tensors(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Symmetric 4-bit GPTQ tensors (v1: zeros stored minus one) of a dense [N, K] weight."""
    n, k = weight.shape
    groups = weight.reshape(n, k // group_size, group_size)
    scale = (groups.abs().amax(-1) / 7.5).clamp(min=1e-6).half()  # [N, G]
    q = (groups / scale.float().unsqueeze(-1) + 8).round().clamp(0, 15).reshape(n, k)
    zeros = torch.full((k // group_size, n), 8 - 1)
    return {"qweight": pack_along(q.t(), 0), "qzeros": pack_along(zeros, 1), "scales": scale.t().contiguous(),
            "g_idx": (torch.arange(k) // group_size).to(torch.int32)}


def fp8_tensors(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """vLLM's tests' blockwise fp8 quantizer (padded to whole 128x128 blocks); `group_size` is not used."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // 128) * 128, -(-k // 128) * 128)
    padded[:n, :k] = weight
    view = padded.view(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
    amax = view.abs().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    q = (view * (FP8_MAX / amax)).to(torch.float8_e4m3fn)
    scale = (amax / FP8_MAX).view(view.shape[0], view.shape[2])
    return {"weight": q.view_as(padded)[:n, :k].contiguous(), "weight_scale_inv": scale}


# format -> (its tensors of a dense [N, K] weight, its quantization_config)
FORMATS: dict[str, tuple[Callable[[torch.Tensor, int], dict[str, torch.Tensor]], Callable[[int], dict]]] = {
    "gptq": (gptq_tensors, lambda group: {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True,
                                          "desc_act": False}),
    "fp8": (fp8_tensors, lambda group: {"quant_method": "fp8", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]}),
}


def write_checkpoints(root: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    config = tiny_config(LlamaConfig, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), vocab_size=args.vocab,
                         max_position_embeddings=4096)
    dense = save_tiny_checkpoint(config, root / "dense").path
    quantized = root / args.format
    quantized.mkdir()
    quantize, quantization_config = FORMATS[args.format]
    tensors = load_file(dense / "model.safetensors")
    for name in [n for n in tensors if n.startswith("model.layers.") and n.endswith("_proj.weight")]:
        module = name.removesuffix(".weight")
        for leaf, tensor in quantize(tensors.pop(name).float(), args.group_size).items():
            tensors[f"{module}.{leaf}"] = tensor
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    saved = json.loads((dense / "config.json").read_text())
    saved["quantization_config"] = quantization_config(args.group_size)
    (quantized / "config.json").write_text(json.dumps(saved))
    return dense, quantized


def timed(llm: LLM, prompt: list[int], new: int, repeats: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds of one generate call (the engine's worker runs in this process)."""
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    walls, cpus = [], []
    for _ in range(repeats + 1):  # the first is a warm-up
        wall, cpu = time.perf_counter(), time.process_time()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls[1:]), statistics.median(cpus[1:])


def kernel_times(args: argparse.Namespace) -> None:
    """CPU-ns per weight and row of fp8_matmul (128x128 block scales) and of the engine's dense path for the same
    shape (bf16: oneDNN with the weight prepacked, as `prepack_weights` does; float32: F.linear)."""
    from llmplug.layers.kernels.native import ops
    from llmplug.layers.packed_linear import PrepackedLinearMethod, RowPlannedDenseMethod

    def dense_method(weight: torch.Tensor) -> PrepackedLinearMethod | RowPlannedDenseMethod:
        return PrepackedLinearMethod(weight) if weight.dtype == torch.bfloat16 else RowPlannedDenseMethod(weight, False)

    shapes = {"qkv": (args.hidden + 2 * max(1, args.hidden // 256) * 64, args.hidden),
              "gate_up": (2 * args.intermediate, args.hidden), "down": (args.hidden, args.intermediate)}
    print(f"threads {torch.get_num_threads()}; CPU-ns per weight and row (fp8_matmul vs the engine's dense matmul)")
    print(f"{'shape':<22} {'rows':>5} {'activations':>12} {'fp8':>8} {'dense':>8} {'dense/fp8':>10}")
    for name, (n, k) in shapes.items():
        stored = fp8_tensors(torch.randn(n, k) * 0.02, 128)
        copies = max(2, (256 << 20) // (n * k))  # > the caches even for the 1-byte weights
        weights = [stored["weight"].clone() for _ in range(copies)]
        scale = stored["weight_scale_inv"]
        for rows in (1, args.prompt):
            for dtype in (torch.bfloat16, torch.float32):
                size = torch.empty((), dtype=dtype).element_size()  # as many bytes of dense copies
                dense = [dense_method((w.float() * 0.01).to(dtype)) for w in weights[: max(2, copies // size)]]
                x = torch.randn(rows, k).to(dtype)
                fp8 = per_weight(lambda w: ops().fp8_matmul(x, w, scale), weights, n * k * rows, args.repeats)
                full = per_weight(lambda method: method.matmul(x, None), dense, n * k * rows, args.repeats)
                print(f"{f'{name} [{n} x {k}]':<22} {rows:>5} {str(dtype).removeprefix('torch.'):>12} {fp8:>8.4f} "
                      f"{full:>8.4f} {full / fp8:>9.2f}x", flush=True)


def per_weight(call: Callable[[torch.Tensor], torch.Tensor], weights: list[torch.Tensor], work: int,
               repeats: int) -> float:
    """Median CPU-ns per weight and row of `call` over every weight of `weights` in turn (each from memory)."""
    times = []
    for _ in range(repeats + 1):
        start = time.process_time()
        for weight in weights:
            call(weight)
        times.append((time.process_time() - start) / len(weights))
    return statistics.median(times[1:]) / work * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", choices=sorted(FORMATS), default="gptq")
    parser.add_argument("--group-size", type=int, default=128, help="GPTQ's group size")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="the engine's torch threads (default: its own)")
    parser.add_argument("--kernel", action="store_true", help="time fp8_matmul alone (see above)")
    args = parser.parse_args()
    if args.kernel:
        if args.threads:
            torch.set_num_threads(args.threads)
        kernel_times(args)
        return
    prompt = [(7 * i + 3) % args.vocab for i in range(args.prompt)]
    with tempfile.TemporaryDirectory() as tmp:
        dense, quantized = write_checkpoints(Path(tmp), args)
        variants = [(f"{args.format} (bf16 act.)", quantized, "bfloat16"), ("dense bf16", dense, "bfloat16"),
                    (f"{args.format} (float32 act.)", quantized, "float32"), ("dense float32", dense, "float32")]
        print(f"hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, vocab {args.vocab}, "
              f"prompt {args.prompt}, {args.new} new tokens, threads {args.threads or 'engine default'}")
        print(f"{'variant':<22} {'prefill tok/s':>14} {'decode tok/s':>13} {'prefill tok/CPU-s':>18} "
              f"{'decode tok/CPU-s':>17}")
        for name, path, dtype in variants:
            device = {} if args.threads is None else {"device": {"num_threads": args.threads}}
            llm = LLM(str(path), dtype=dtype, skip_tokenizer_init=True, max_model_len=args.prompt + args.new + 8,
                      enable_prefix_caching=False, **device)
            try:
                prefill = timed(llm, prompt, 1, args.repeats)
                full = timed(llm, prompt, args.new, args.repeats)
            finally:
                llm.shutdown()
            rates = [f"{args.prompt / prefill[i]:>{w1}.1f} {(args.new - 1) / max(full[i] - prefill[i], 1e-9):>{w2}.1f}"
                     for i, (w1, w2) in enumerate(((14, 13), (18, 17)))]
            print(f"{name:<22} {rates[0]} {rates[1]}", flush=True)


if __name__ == "__main__":
    main()
