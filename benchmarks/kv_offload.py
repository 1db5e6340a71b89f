"""Time to first token of a long shared prompt whose blocks were evicted from the paged KV cache: recomputed (no
connector), reloaded from the CPU tier (cpu_offload), and reloaded from the disk tier by a restarted engine
(disk_offload); a local prefix-cache hit as the floor.

    python benchmarks/kv_offload.py                        # default model, a 1024-token prompt, 3 rounds
    python benchmarks/kv_offload.py --model DIR --prompt-len 1024 --rounds 3 --json out.json

Each round takes a new random prompt. `recompute` and `cpu tier`: an engine computes it once, two filler prompts
of the same length evict its blocks (the paged cache holds the prompt and a few blocks more), then the prompt is
asked again. `disk tier, restarted`: one engine computes it and shuts down, a new engine on the same directory
asks again. `local prefix hit`: the prompt asked again at once. Every engine first runs one short unrelated request
(its first-step costs are no row's). TTFT is the wall time of a one-token request; medians over the rounds, and each row's ratio to `recompute` (docs/benchmarks.md, docs/kv_offload.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads()  # before torch is imported

import torch  # noqa: E402

from llmplug import LLM, SamplingParams  # noqa: E402

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of `prompt`, and its cached tokens (local or through a connector)."""
    start = time.perf_counter()
    [out] = llm.generate([{"prompt_token_ids": prompt}], ONE_TOKEN, use_tqdm=False)
    return time.perf_counter() - start, out.num_cached_tokens


def warm_up(llm: LLM, vocab: int) -> LLM:
    """Run one short request, so no row pays an engine's first-step costs (kernel selection, weight prepacking)."""
    ttft(llm, list(range(100, min(vocab, 164))))
    return llm


def evicted_ttft(llm: LLM, prompt: list[int], fillers: list[list[int]]) -> tuple[float, int]:
    """TTFT of `prompt` after computing it and letting `fillers` evict its blocks."""
    ttft(llm, prompt)
    for filler in fillers:
        ttft(llm, filler)
    return ttft(llm, prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or short name; default: the embedded model")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    num_blocks = args.prompt_len // args.block_size + 8  # the prompt and a few blocks: a filler evicts it
    engine = {"block_size": args.block_size, "num_gpu_blocks_override": num_blocks,
              "max_model_len": args.prompt_len + 16, "max_num_batched_tokens": args.prompt_len + 16}
    if args.model:
        engine["model"] = args.model
    disk_dir = tempfile.mkdtemp(prefix="kv_offload_bench_")
    disk = {"kv_connector": "disk_offload", "kv_offloading_path": disk_dir}
    base = LLM(**engine)
    vocab = base.llm_engine.engine_core.model_info["vocab_size"]
    warm_up(base, vocab)
    cpu = warm_up(LLM(**engine, kv_transfer_config={"kv_connector": "cpu_offload", "kv_offloading_size": 2.0}), vocab)
    g = torch.Generator().manual_seed(0)
    rows: dict[str, list[float]] = {"recompute": [], "cpu tier": [], "disk tier, restarted": [],
                                    "local prefix hit": []}
    cached: dict[str, int] = {}
    for _ in range(args.rounds):
        prompt, *fillers = (torch.randint(100, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(3))
        rows["recompute"].append(evicted_ttft(base, prompt, fillers)[0])
        seconds, cached["cpu tier"] = evicted_ttft(cpu, prompt, fillers)
        rows["cpu tier"].append(seconds)
        seconds, cached["local prefix hit"] = ttft(cpu, prompt)
        rows["local prefix hit"].append(seconds)
        writer = LLM(**engine, kv_transfer_config=disk)
        ttft(writer, prompt)
        writer.shutdown()
        reader = warm_up(LLM(**engine, kv_transfer_config=disk), vocab)
        seconds, cached["disk tier, restarted"] = ttft(reader, prompt)
        rows["disk tier, restarted"].append(seconds)
        reader.shutdown()
    medians = {name: statistics.median(times) for name, times in rows.items()}
    print(f"prompt {args.prompt_len} tokens, block size {args.block_size}, {args.rounds} rounds (median TTFT)")
    print(f"{'row':<24}{'TTFT ms':>10}{'cached':>8}{'/ recompute':>13}")
    for name, seconds in medians.items():
        print(f"{name:<24}{seconds * 1e3:>10.1f}{cached.get(name, 0):>8}{seconds / medians['recompute']:>12.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ttft_s": rows, "median_s": medians, "cached_tokens": cached}, f, indent=1)


if __name__ == "__main__":
    main()
