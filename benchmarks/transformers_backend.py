"""The transformers backend's batch throughput: llmplug running a transformers model through its paged
attention (model.model_impl=transformers) vs transformers' own padded `generate`, greedy, in one run.

    python benchmarks/transformers_backend.py                     # a random BitNet, 8 layers x 512 wide
    python benchmarks/transformers_backend.py --num-prompts 32 --output-len 64 --cpu-clock

The model is built with random weights (no download): an architecture llmplug has no native plugin for,
so the backend is what runs it. Both engines get the same prompts (random token ids of 16-64 tokens), the
same thread settings and a warm-up; reports output tokens/s of each and the ratio. The machine may be
shared: --cpu-clock times CPU seconds of this process instead of wall time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads()  # before torch is imported: same thread settings for both engines

import torch  # noqa: E402

from throughput import bench_hf_generate, bench_llmplug  # noqa: E402 - benchmarks/ is on sys.path


def save_model(path: str, layers: int, width: int, vocab: int):
    """A random BitNet causal LM of `layers` x `width` saved at `path`; returns the transformers model."""
    from transformers import AutoModelForCausalLM, BitNetConfig

    config = BitNetConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=width * 3, num_hidden_layers=layers,
        num_attention_heads=width // 64, num_key_value_heads=width // 128, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--cpu-clock", action="store_true", help="time CPU seconds of this process")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    clock = time.process_time if args.cpu_clock else time.perf_counter
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, args.vocab, (16 + (i * 13) % 49,), generator=generator).tolist()
               for i in range(args.num_prompts)]
    with tempfile.TemporaryDirectory() as path:
        hf = save_model(path, args.layers, args.width, args.vocab)
        rows = {
            "llmplug (transformers backend)": bench_llmplug(path, prompts, args.output_len, "float32", clock=clock,
                                                            model_impl="transformers", skip_tokenizer_init=True),
            "transformers generate": bench_hf_generate(hf, prompts, args.output_len, pad_id=0, clock=clock),
        }
    ratio = rows["llmplug (transformers backend)"] / rows["transformers generate"]
    for name, value in rows.items():
        print(f"{name:34s} {value:8.1f} tok/s")
    print(f"{'backend / generate':34s} {ratio:8.2f}x")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"args": vars(args), "tok_per_s": rows, "ratio": ratio}, file, indent=2)


if __name__ == "__main__":
    main()
