"""Batch throughput with four LoRA adapters mixed in the batch, against the base model alone.

    python benchmarks/lora.py                      # default model (SmolLM2 GGUF), 32 prompts x 64 tokens, rank 16
    python benchmarks/lora.py --model DIR --num-prompts 32 --output-len 64 --rank 16 --json out.json

Three rows over the same prompts (greedy, ignore_eos), measured interleaved in one process for
`--rounds` rounds (median reported, per wall second and per CPU second of the process): `base` (an
engine with LoRA off), `lora-enabled, no adapter` (a
second engine with slots allocated, no request uses one: the cost of the hook alone) and `4 adapters
mixed` (that engine, request i with adapter i % 4, so every step holds all four). The
adapters are random PEFT folders of rank `--rank` on every linear layer (q, k, v, o, gate, up, down),
written here from the model's config. Ratios are what to compare (docs/benchmarks.md); the machine is noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads()  # before torch is imported

import torch  # noqa: E402

from throughput import make_prompts  # noqa: E402 - benchmarks/ is on sys.path when a script runs

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(config, folder: Path, rank: int, seed: int) -> None:
    """A random PEFT LoRA folder of `rank` on every linear layer of a Llama-shaped `config`."""
    from safetensors.torch import save_file

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * head_dim
    shapes = {  # module -> (in, out)
        "q_proj": (hidden, config.num_attention_heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (config.num_attention_heads * head_dim, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (fan_in, fan_out) in shapes.items():
            sub = "self_attn" if module in MODULES[:4] else "mlp"
            name = f"base_model.model.model.layers.{layer}.{sub}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.01
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    config_json = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES)}
    (folder / "adapter_config.json").write_text(json.dumps(config_json))


def timed(llm, prompts: list[list[int]], output_len: int, loras: list) -> tuple[float, float]:
    """(output tokens per wall second, per CPU second of this process) of one batch of all prompts (request i
    with loras[i % len(loras)]); the engine steps in this process, so its CPU time is the engine's work."""
    from llmplug import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))]
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=per_prompt, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / wall, tokens / cpu


def engine(model: str, dtype: str, num_prompts: int, **kwargs):
    from llmplug import LLM

    # a context of 1024 keeps the KV cache small (the default 8192 x 32 sequences takes ~6 GB on a shared host)
    return LLM(model=model, dtype=dtype, max_num_seqs=max(num_prompts, 1), max_model_len=1024, **kwargs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model dir or .gguf; default: the embedded SmolLM2")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; the median is reported")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    from transformers import AutoConfig, AutoTokenizer

    from llmplug.core.config import DEFAULT_MODEL
    from llmplug.loaders.default_model import resolve_model_path
    from llmplug.lora import LoRARequest

    model = resolve_model_path(args.model or DEFAULT_MODEL)
    gguf = {"gguf_file": os.path.basename(model)} if model.endswith(".gguf") else {}
    where = os.path.dirname(model) if gguf else model
    config, tok = AutoConfig.from_pretrained(where, **gguf), AutoTokenizer.from_pretrained(where, **gguf)
    prompts = make_prompts(tok, args.num_prompts)
    print(f"model={model} prompts={args.num_prompts} output_len={args.output_len} rank={args.rank} "
          f"dtype={args.dtype} threads={torch.get_num_threads()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        loras = []
        for i in range(4):
            write_adapter(config, Path(tmp) / f"a{i}", args.rank, seed=i)
            loras.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        plain = engine(model, args.dtype, args.num_prompts)
        lora = engine(model, args.dtype, args.num_prompts, enable_lora=True, max_loras=4, max_lora_rank=args.rank)
        runs = {"base": (plain, [None]), "lora-enabled, no adapter": (lora, [None]), "4 adapters mixed": (lora, loras)}
        for llm, per_prompt in runs.values():  # warm-up; loads the adapters into their slots
            timed(llm, prompts[:4], 4, per_prompt)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        for _ in range(args.rounds):  # interleaved, so drifting load on a shared host hits every row alike
            for name, (llm, per_prompt) in runs.items():
                samples[name].append(timed(llm, prompts, args.output_len, per_prompt))
                print(f"  {name}: {samples[name][-1][0]:.1f} tok/s wall, {samples[name][-1][1]:.1f} tok/CPU-s",
                      flush=True)
        plain.shutdown()
        lora.shutdown()
    result = {}
    for clock, i in (("wall", 0), ("cpu", 1)):
        rows = {name: statistics.median(v[i] for v in values) for name, values in samples.items()}
        result[f"tok_per_{clock}_s"] = rows
        for name, tps in rows.items():
            runs_text = ", ".join(f"{v[i]:.1f}" for v in samples[name])
            print(f"{clock:>4} {name:>26}: {tps:7.1f} tok/s  ({tps / rows['base']:.2f}x base; runs: {runs_text})",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
