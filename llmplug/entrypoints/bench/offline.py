"""`llmplug bench throughput` and `llmplug bench latency`: an offline engine on random prompts (vLLM's
`vllm bench throughput` and `vllm bench latency`, with their flags and their printed lines).

Prompts are random token ids (no special tokens) of exactly `--input-len` tokens; every request generates
exactly `--output-len` tokens (ignore_eos), sampled at temperature 1 as vLLM's benchmarks do.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from llmplug.entrypoints.arg_types import non_negative_int, positive_int
from llmplug.entrypoints.bench.metrics import LATENCY_PERCENTILES, latency_summary, percentile, throughput_summary
from llmplug.entrypoints.engine_args import add_engine_args, config_from_args


def _common_arguments(g: Any, input_len: int, output_len: int) -> None:
    g.add_argument("--input-len", type=positive_int, default=input_len, metavar="N",
                   help=f"Tokens in each prompt (random ids). Default: {input_len}.")
    g.add_argument("--output-len", type=positive_int, default=output_len, metavar="N",
                   help=f"Tokens each request generates (ignore_eos). Default: {output_len}.")
    g.add_argument("--n", type=positive_int, default=1, help="Completions per prompt. Default: 1.")
    g.add_argument("--output-json", metavar="FILE", help="Also write the results to this JSON file.")
    g.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


def add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("benchmark")
    g.add_argument("--dataset-name", choices=["random"], default="random",
                   help="Where prompts come from: random token ids (the only one here). Default: random.")
    g.add_argument("--num-prompts", type=positive_int, default=1000, metavar="N",
                   help="Prompts, all given to the engine at once. Default: 1000.")
    _common_arguments(g, input_len=1024, output_len=128)
    add_engine_args(parser)


def add_latency_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("benchmark")
    g.add_argument("--batch-size", type=positive_int, default=8, metavar="N",
                   help="Prompts in the batch timed at each iteration. Default: 8.")
    g.add_argument("--num-iters-warmup", type=non_negative_int, default=10, metavar="N",
                   help="Untimed iterations first. Default: 10.")
    g.add_argument("--num-iters", type=positive_int, default=30, metavar="N",
                   help="Timed iterations. Default: 30.")
    _common_arguments(g, input_len=32, output_len=128)
    add_engine_args(parser)


def _make_llm(args: argparse.Namespace) -> Any:
    from llmplug import _configure_threads_before_torch

    _configure_threads_before_torch()
    from llmplug.engine.llm import LLM

    return LLM(config=config_from_args(args).config)


def random_prompts(llm: Any, num_prompts: int, input_len: int, seed: int) -> list[dict[str, list[int]]]:
    """`num_prompts` prompts of `input_len` random token ids, none of them special."""
    tokenizer = llm.get_tokenizer()
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    vocab = [i for i in range(llm.llm_engine.processor.vocab_size) if i not in special]
    rng = random.Random(seed)
    return [{"prompt_token_ids": rng.choices(vocab, k=input_len)} for _ in range(num_prompts)]


def _sampling_params(args: argparse.Namespace, seed: int) -> Any:
    from llmplug.core.params import SamplingParams

    return SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len,
                          seed=seed)


def run_throughput(args: argparse.Namespace) -> int:
    """Time one `generate` over every prompt; print vLLM's throughput lines."""
    llm = _make_llm(args)
    try:
        seed = llm.config.model.seed
        prompts = random_prompts(llm, args.num_prompts, args.input_len, seed)
        params = _sampling_params(args, seed)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
        elapsed = time.perf_counter() - start
    finally:
        llm.shutdown()
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    output_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    print(throughput_summary(len(prompts), prompt_tokens, output_tokens, elapsed))
    _write_json(args.output_json, {
        "elapsed_time": elapsed, "num_requests": len(prompts), "total_num_tokens": prompt_tokens + output_tokens,
        "total_output_tokens": output_tokens, "requests_per_second": len(prompts) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed})
    return 0


def run_latency(args: argparse.Namespace) -> int:
    """Time `--num-iters` runs of one batch after `--num-iters-warmup` untimed ones; print vLLM's latency lines."""
    from tqdm import tqdm

    llm = _make_llm(args)
    try:
        seed = llm.config.model.seed
        prompts = random_prompts(llm, args.batch_size, args.input_len, seed)
        params = _sampling_params(args, seed)
        print("Warming up...", file=sys.stderr)
        for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations", disable=args.disable_tqdm):
            llm.generate(prompts, params, use_tqdm=False)
        latencies = []
        for _ in tqdm(range(args.num_iters), desc="Profiling iterations", disable=args.disable_tqdm):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            latencies.append(time.perf_counter() - start)
    finally:
        llm.shutdown()
    print(latency_summary(latencies))
    _write_json(args.output_json, {
        "avg_latency": sum(latencies) / len(latencies), "latencies": latencies,
        "percentiles": {str(q): percentile(latencies, q) for q in LATENCY_PERCENTILES}})
    return 0


def _write_json(path: str | None, results: dict[str, Any]) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as file:
            json.dump(results, file, indent=4)
