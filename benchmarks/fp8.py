"""Decode and prefill tokens/s of an fp8 checkpoint (128x128 blocks) against the same model dense in bf16 and float32.

    python benchmarks/fp8.py                                   # hidden 1024, 4 layers, 2816 intermediate
    python benchmarks/fp8.py --hidden 2048 --layers 2 --intermediate 5632 --prompt 256 --new 32

Writes a random Llama-shaped checkpoint (float32), its fp8 copy (vLLM's blockwise quantizer: scale = block amax /
448), then for each variant loads it with `llmplug.LLM` and times, after a warm-up, one prompt of `prompt` tokens
with one new token (prefill tok/s) and the same prompt with `new` tokens (decode tok/s: the extra tokens over the
extra time). fp8 runs in bf16 and in float32 activations (its weights stay fp8; each call dequantizes them, see
llmplug/quantization/fp8.py). Medians of `repeats`, in wall clock and in the process's CPU time: on a shared
machine run it with --threads 1 and read the CPU-time columns, which do not count waiting for a core (with more
threads each torch op's parallel region waits for every thread to get a core, and fp8's ~8 ops per tile of 1M
weights pay that far more often than a dense layer's one packed matmul).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from llmplug import LLM, SamplingParams
from llmplug.testing.tiny import save_tiny_checkpoint, tiny_config

FP8_MAX = 448.0


def per_block_cast_to_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's tests' blockwise quantizer (padded to whole 128x128 blocks)."""
    n, k = w.shape
    padded = torch.zeros(-(-n // 128) * 128, -(-k // 128) * 128)
    padded[:n, :k] = w
    view = padded.view(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
    amax = view.abs().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    q = (view * (FP8_MAX / amax)).to(torch.float8_e4m3fn)
    return q.view_as(padded)[:n, :k].contiguous(), (amax / FP8_MAX).view(view.shape[0], view.shape[2])


def write_checkpoints(root: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    config = tiny_config(LlamaConfig, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), vocab_size=args.vocab,
                         max_position_embeddings=4096)
    dense = save_tiny_checkpoint(config, root / "dense").path
    fp8 = root / "fp8"
    fp8.mkdir()
    tensors = load_file(dense / "model.safetensors")
    for name in [n for n in tensors if n.startswith("model.layers.") and n.endswith("_proj.weight")]:
        q, scale = per_block_cast_to_fp8(tensors.pop(name).float())
        tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = q, scale
    save_file(tensors, fp8 / "model.safetensors", metadata={"format": "pt"})
    saved = json.loads((dense / "config.json").read_text())
    saved["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps(saved))
    return dense, fp8


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="the engine's torch threads (default: its own)")
    args = parser.parse_args()
    prompt = [(7 * i + 3) % args.vocab for i in range(args.prompt)]
    with tempfile.TemporaryDirectory() as tmp:
        dense, fp8 = write_checkpoints(Path(tmp), args)
        variants = [("fp8 (bf16 act.)", fp8, "bfloat16"), ("dense bf16", dense, "bfloat16"),
                    ("fp8 (float32 act.)", fp8, "float32"), ("dense float32", dense, "float32")]
        print(f"hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, vocab {args.vocab}, "
              f"prompt {args.prompt}, {args.new} new tokens, threads {args.threads or 'engine default'}")
        print(f"{'variant':<20} {'prefill tok/s':>14} {'decode tok/s':>13} {'prefill tok/CPU-s':>18} "
              f"{'decode tok/CPU-s':>17}")
        for name, path, dtype in variants:
            device = {} if args.threads is None else {"device": {"num_threads": args.threads}}
            llm = LLM(str(path), dtype=dtype, skip_tokenizer_init=True, max_model_len=args.prompt + args.new + 8,
                      **device)
            try:
                prefill = timed(llm, prompt, 1, args.repeats)
                full = timed(llm, prompt, args.new, args.repeats)
            finally:
                llm.shutdown()
            rates = [f"{args.prompt / prefill[i]:>{w1}.1f} {(args.new - 1) / max(full[i] - prefill[i], 1e-9):>{w2}.1f}"
                     for i, (w1, w2) in enumerate(((14, 13), (18, 17)))]
            print(f"{name:<20} {rates[0]} {rates[1]}", flush=True)


if __name__ == "__main__":
    main()
