"""Resident memory of `llmplug serve` (the default model, no model argument) at idle and under 32 streaming clients.

    python benchmarks/serve_memory.py                                    # the default KV cache
    python benchmarks/serve_memory.py --label 4GiB -- --kv-cache-memory 4294967296   # extra `serve` flags after --

The server starts as `llmplug serve` with nothing but a port (plus the flags after `--`). Once /health answers
and a few seconds have passed, its resident memory (the process and its children) is read: idle RSS. Then
`--clients` AsyncOpenAI clients each stream one chat request at once (greedy, `ignore_eos`, 64 to 128 output tokens
spread over the clients) while RSS is sampled every 0.2 s: peak RSS. Reported in one table row: idle and peak
RSS, the KV cache as the server logged it (blocks and MiB), and output tokens/s over the load.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prompts import PROMPTS  # noqa: E402 - benchmarks/ is on sys.path when a script runs
from serve import free_port, stop, wait_healthy  # noqa: E402
from serve_soak import RssSampler, rss_bytes  # noqa: E402

KV_LOG_LINE = re.compile(r"KV cache: (\d+) blocks of (\d+) tokens \(([\d.]+) MiB\)")
MiB = 2**20


def output_tokens(index: int, clients: int, low: int, high: int) -> int:
    """Client `index`'s max_tokens: evenly from `low` to `high` across the clients."""
    return low + (high - low) * index // max(1, clients - 1)


async def load(base_url: str, model: str, clients: int, low: int, high: int) -> int:
    """`clients` concurrent streaming chat requests; the output tokens they received (from each stream's usage)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0, timeout=600)

    async def one(index: int) -> int:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}],
            max_tokens=output_tokens(index, clients, low, high), temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        tokens = 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    try:
        return sum(await asyncio.gather(*(one(i) for i in range(clients))))
    finally:
        await client.close()


def served_model(base_url: str) -> str:
    """The name the server answers to (the default model's)."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as response:
        return json.load(response)["data"][0]["id"]


def kv_cache_from_log(log: str) -> tuple[int, float]:
    """(blocks, MiB) from the server's "KV cache: N blocks of B tokens (X MiB)" line; (0, 0.0) if absent."""
    match = KV_LOG_LINE.search(log)
    return (int(match[1]), float(match[3])) if match else (0, 0.0)


def measure(server_args: list[str], clients: int, low: int, high: int, settle: float) -> dict[str, float]:
    """Start the server, read its idle RSS, run the load while sampling RSS; the row's numbers."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "llmplug.entrypoints.cli", "serve", "--port", str(port), *server_args]
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(base_url, process)
            time.sleep(settle)
            idle = rss_bytes(process.pid)
            model = served_model(base_url)
            sampler = RssSampler(process.pid, 0.2)
            sampler.start()
            start = time.perf_counter()
            tokens = asyncio.run(load(base_url, model, clients, low, high))
            seconds = time.perf_counter() - start
            sampler.done.set()
            sampler.join()
            after = rss_bytes(process.pid)
        finally:
            stop(process)
        log.seek(0)
        blocks, kv_mib = kv_cache_from_log(log.read())
    peak = max([after, *(rss for _, rss in sampler.samples)])
    return {"idle_mib": idle / MiB, "peak_mib": peak / MiB, "kv_blocks": blocks, "kv_mib": kv_mib,
            "tokens": tokens, "tokens_per_s": tokens / seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--settle", type=float, default=5.0, help="Seconds between /health and the idle reading.")
    parser.add_argument("--label", default="default", help="The row's name in the table.")
    parser.add_argument("server_args", nargs="*", help="Extra `llmplug serve` flags (after --).")
    args = parser.parse_args()

    row = measure(args.server_args, args.clients, args.min_tokens, args.max_tokens, args.settle)
    print(f"| KV cache | blocks | KV-cache MiB | idle RSS MiB | peak RSS MiB ({args.clients} clients) | output tokens "
          "| tokens/s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.label} | {row['kv_blocks']} | {row['kv_mib']:.0f} | {row['idle_mib']:.0f} | {row['peak_mib']:.0f} "
          f"| {row['tokens']} | {row['tokens_per_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
