"""Decode and prefill tokens/s of a GPTQ 4-bit checkpoint against the same model dense, in bf16 and float32.

    python benchmarks/quantized.py                                  # hidden 1024, 4 layers, 2816 intermediate
    python benchmarks/quantized.py --group-size 32 --prompt 128 --new 64

Writes a random Llama-shaped checkpoint (float32) and its GPTQ copy (symmetric round-to-nearest, groups of
`group_size`, packed as AutoGPTQ packs: qweight [K / 8, N], qzeros [G, N / 8] storing zero - 1, scales fp16
[G, N]), then for each variant loads it with `llmplug.LLM` and times, after a warm-up, one prompt of `prompt`
tokens with one new token (prefill tok/s) and the same prompt with `new` tokens (decode tok/s: the extra tokens
over the extra time). GPTQ layers compute with torch's CPU int4 kernel at every batch size (their weights stay
packed: llmplug/quantization/int_weights.py). Medians of `repeats`; wall clock, so on a shared machine compare
ratios in one run.
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


def write_checkpoints(root: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    config = tiny_config(LlamaConfig, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 256), vocab_size=args.vocab,
                         max_position_embeddings=4096)
    dense = save_tiny_checkpoint(config, root / "dense").path
    gptq = root / "gptq"
    gptq.mkdir()
    tensors = load_file(dense / "model.safetensors")
    for name in [n for n in tensors if n.startswith("model.layers.") and n.endswith("_proj.weight")]:
        module = name.removesuffix(".weight")
        for leaf, tensor in gptq_tensors(tensors.pop(name).float(), args.group_size).items():
            tensors[f"{module}.{leaf}"] = tensor
    save_file(tensors, gptq / "model.safetensors", metadata={"format": "pt"})
    saved = json.loads((dense / "config.json").read_text())
    saved["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": args.group_size, "sym": True,
                                    "desc_act": False}
    (gptq / "config.json").write_text(json.dumps(saved))
    return dense, gptq


def timed(llm: LLM, prompt: list[int], new: int, repeats: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prompt = [(7 * i + 3) % args.vocab for i in range(args.prompt)]
    with tempfile.TemporaryDirectory() as tmp:
        dense, gptq = write_checkpoints(Path(tmp), args)
        variants = [("gptq-4bit (bf16 act.)", gptq, "bfloat16"), ("dense bf16", dense, "bfloat16"),
                    ("gptq-4bit (fp32 act.)", gptq, "float32"), ("dense float32", dense, "float32")]
        print(f"hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, vocab {args.vocab}, "
              f"group {args.group_size}, prompt {args.prompt}, {args.new} new tokens, "
              f"{torch.get_num_threads()} threads")
        print(f"{'variant':<22} {'prefill tok/s':>14} {'decode tok/s':>13}")
        for name, path, dtype in variants:
            llm = LLM(str(path), dtype=dtype, skip_tokenizer_init=True, max_model_len=args.prompt + args.new + 8)
            try:
                prefill = timed(llm, prompt, 1, args.repeats)
                full = timed(llm, prompt, args.new, args.repeats)
            finally:
                llm.shutdown()
            print(f"{name:<22} {args.prompt / prefill:>14.1f} {(args.new - 1) / max(full - prefill, 1e-9):>13.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
