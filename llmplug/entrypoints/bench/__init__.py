"""`llmplug bench serve|throughput|latency`: vLLM's `vllm bench` commands, printing the summaries vLLM prints.

- `serve`: streaming requests of random token ids against a running server (`llmplug serve` or any OpenAI
  compatible one), at a request rate and a concurrency: TTFT, TPOT, ITL and throughput (`serve.py`);
- `throughput`: an offline engine answering `--num-prompts` random prompts at once (`offline.py`);
- `latency`: an offline engine answering one batch of `--batch-size` prompts, `--num-iters` times (`offline.py`).

Kept light at import time (the CLI builds every parser on each call): the engine loads inside `run`.
benchmarks/ holds the scripts that compare llmplug with other engines in one run; these commands measure
one engine (or one server) as vLLM's do, so their numbers read like vLLM's.
"""

from __future__ import annotations

import argparse

from llmplug.entrypoints.bench import offline, serve

# name -> (help, add_arguments, run)
BENCHMARKS = {
    "serve": ("Benchmark a running server: streaming requests at a rate and concurrency; TTFT, TPOT, ITL.",
              serve.add_arguments, serve.run),
    "throughput": ("Benchmark offline throughput: an engine answering --num-prompts random prompts.",
                   offline.add_throughput_arguments, offline.run_throughput),
    "latency": ("Benchmark the latency of one batch (--batch-size prompts) on an offline engine.",
                offline.add_latency_arguments, offline.run_latency),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benchmarks = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, (text, add, _) in BENCHMARKS.items():
        add(benchmarks.add_parser(name, help=text, description=text, allow_abbrev=False))


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the command names."""
    return BENCHMARKS[args.benchmark][2](args)
