"""Batch throughput of a mixture-of-experts model: llmplug vs HF transformers, same weights, one run.

    python benchmarks/moe.py                                  # Mixtral: 8 experts, top-2, hidden 512
    python benchmarks/moe.py --family deepseek_v3             # DeepSeek V3: latent attention + its router
    python benchmarks/moe.py --num-prompts 32 --output-len 64 --json out.json
    OMP_NUM_THREADS=1 python benchmarks/moe.py             # the setting of docs/benchmarks.md

Builds the model from a small-but-not-trivial config with transformers' own initialisation, saves it
as safetensors in a temporary folder, and generates from the same random prompts (token ids, 24-88
tokens, seeded) with llmplug, HF's padded `generate` and HF's continuous-batching `generate_batch`
(greedy, `ignore_eos`, bf16). Prints output tokens per second and the ratios; see docs/benchmarks.md.
Seconds are CPU seconds of the process by default (`--clock cpu`: every engine here runs in this
process, its threads included), which a shared machine's other load barely changes; `--clock wall` for
wall-clock time on a quiet machine.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads()  # before torch is imported: same thread settings for every engine measured

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, DeepseekV3Config, MixtralConfig  # noqa: E402

from throughput import bench_hf_generate, bench_hf_generate_batch, bench_llmplug, report  # noqa: E402

COMMON = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
              max_position_embeddings=4096, bos_token_id=None, eos_token_id=None, pad_token_id=None)
PAGE = 64  # tokens per page of HF's continuous-batching cache
FAMILIES = {
    # 8 experts of 1024 features, softmax top-2 renormalised; grouped-query attention
    "mixtral": lambda: MixtralConfig(**COMMON, num_key_value_heads=2, intermediate_size=1024,
                                     num_local_experts=8, num_experts_per_tok=2),
    # latent attention (kv_lora_rank 128) and V3's router: sigmoid, 2 of 4 groups, a shared expert
    "deepseek_v3": lambda: DeepseekV3Config(
        **COMMON, num_key_value_heads=8, intermediate_size=1024, moe_intermediate_size=512, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
        kv_lora_rank=128, q_lora_rank=256, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64,
    ),
}


# transformers 5.24's continuous batching fails on latent attention (its paged cache expects k/v heads:
# "index_copy_(): Source/destination tensor must have same slice shapes"), so only `generate` there
NO_HF_CONTINUOUS_BATCHING = {"deepseek_v3"}


def save_model(family: str, path: str) -> None:
    """The family's config built by transformers (its own random init) and saved as float32 safetensors."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=torch.float32)
    model.save_pretrained(path)


def hf_cache_for(prompts: list[list[int]], output_len: int) -> ContinuousBatchingConfig:
    """HF's paged cache sized for the batch (by default it takes 90 % of free memory: too much on a shared host)."""
    pages = -(-(max(map(len, prompts)) + output_len) // PAGE)
    return ContinuousBatchingConfig(page_size=PAGE, num_blocks=len(prompts) * pages + 1, max_batch_tokens=2048)


def random_prompts(num_prompts: int, vocab_size: int) -> list[list[int]]:
    """Seeded random token ids, 24-88 tokens each."""
    rng = random.Random(0)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(24, 88))] for _ in range(num_prompts)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), default="mixtral")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="CPU seconds of the process, or wall time")
    ap.add_argument("--skip-hf-batch", action="store_true", help="skip HF generate_batch (continuous batching)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    prompts = random_prompts(args.num_prompts, COMMON["vocab_size"])
    rows: dict[str, float] = {}

    def record(name: str, tps: float) -> None:
        rows[name] = tps
        print(f"{name:28s} {tps:8.1f} output tokens per {args.clock} second", flush=True)  # as it goes: a later hang loses nothing

    with tempfile.TemporaryDirectory(prefix="llmplug-moe-") as path:
        save_model(args.family, path)
        print(f"family={args.family} prompts={args.num_prompts} output_len={args.output_len} dtype={args.dtype} "
              f"threads={torch.get_num_threads()}", flush=True)
        record("llmplug batch", bench_llmplug(
            path, prompts, args.output_len, args.dtype, clock=clock, skip_tokenizer_init=True
        ))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        record("hf generate batch", bench_hf_generate(hf, prompts, args.output_len, pad_id=0, clock=clock))
        if not (args.skip_hf_batch or args.family in NO_HF_CONTINUOUS_BATCHING):
            record("hf generate_batch batch", bench_hf_generate_batch(
                hf, prompts, args.output_len, pad_id=0, cb_config=hf_cache_for(prompts, args.output_len), clock=clock
            ))

    ratios = {"llmplug / hf generate": rows["llmplug batch"] / rows["hf generate batch"]}
    if "hf generate_batch batch" in rows:
        ratios["llmplug / hf generate_batch"] = rows["llmplug batch"] / rows["hf generate_batch batch"]
    report(rows, ratios, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
