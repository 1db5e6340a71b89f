"""Disaggregated prefill/decode vs one engine under a mixed load, same model, one run.

    python benchmarks/disagg.py                      # the embedded SmolLM2 (exported once), 8 + 8 clients
    python benchmarks/disagg.py --long-clients 4 --short-clients 12 --rounds 3

`one`: one `llmplug serve` on every core. `pd`: a prefill engine (`kv_role: kv_producer`) on the first half of
the cores and a decode engine (`kv_role: kv_consumer`) on the other half, sharing a `disk_offload` directory in
/dev/shm, behind `llmplug proxy` (docs/kv_offload.md). The mixed load runs at once: `--long-clients` clients send
long prompts (~1,000 tokens) asking for a few tokens, `--short-clients` clients send short prompts asking for
`--max-tokens` tokens; each client sends `--rounds` streaming chat requests back to back, every prompt new (no
prefix-cache help across requests). Reported per setup and per kind of client: time to first token and
inter-token latency (median, p90), output tok/s, and whether every greedy answer equals the other setup's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prompts import PROMPTS  # noqa: E402 - benchmarks/ is on sys.path when a script runs
from serve import export_default_model, free_port, stop, wait_healthy  # noqa: E402

LONG_CONTEXT = " ".join(PROMPTS) * 4  # ~1,000 tokens of the model's tokenizer


def serve_command(model: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "llmplug.entrypoints.cli", "serve", model, "--port", str(port),
            "--served-model-name", "bench", "--dtype", "bfloat16", "--log-level", "warning", *extra]


def start(command: list[str], cores: set[int] | None) -> subprocess.Popen:
    """A server process, pinned to `cores` (all when None)."""
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pin)


async def one_request(client, prompt: str, max_tokens: int) -> tuple[float, list[float], str]:
    start_time = time.perf_counter()
    stream = await client.chat.completions.create(model="bench", messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=max_tokens, temperature=0, stream=True)
    times, parts = [], []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            parts.append(chunk.choices[0].delta.content)
    return times[0] - start_time, [b - a for a, b in zip(times, times[1:])], "".join(parts)


async def warm_up(base_url: str) -> None:
    """One long and one short request through the setup: first steps pay for lazy start-up work."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0, timeout=1800)
    await one_request(client, f"(warm-up) {LONG_CONTEXT}", 2)
    await one_request(client, PROMPTS[0], 8)
    await client.close()


async def mixed_load(base_url: str, args: argparse.Namespace) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0, timeout=1800)
    results: dict[str, list[tuple[float, list[float], str]]] = {"long": [], "short": []}
    answers: dict[str, str] = {}

    async def worker(kind: str, index: int) -> None:
        for k in range(args.rounds):
            if kind == "long":
                prompt = f"(reader {index}, round {k}) {LONG_CONTEXT}\nIn one word, what was this about?"
                max_tokens = 4
            else:
                prompt = f"{PROMPTS[(index + k) % len(PROMPTS)]} (client {index}, round {k})"
                max_tokens = args.max_tokens
            result = await one_request(client, prompt, max_tokens)
            results[kind].append(result)
            answers[prompt] = result[2]

    start_time = time.perf_counter()
    await asyncio.gather(*(worker("long", i) for i in range(args.long_clients)),
                         *(worker("short", i) for i in range(args.short_clients)))
    duration = time.perf_counter() - start_time
    await client.close()
    report = {"duration_s": duration}
    for kind, rows in results.items():
        ttfts = sorted(r[0] * 1000 for r in rows)
        itls = sorted(gap * 1000 for r in rows for gap in r[1])
        report[kind] = {"requests": len(rows), "ttft_median_ms": statistics.median(ttfts),
                        "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))],
                        "itl_median_ms": statistics.median(itls) if itls else None,
                        "itl_p90_ms": itls[int(0.9 * (len(itls) - 1))] if itls else None}
    report["answers"] = answers
    return report


def run_setup(setup: str, model: str, args: argparse.Namespace) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    processes, port = [], free_port()
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as kv_dir:
        try:
            if setup == "one":
                processes.append(start(serve_command(model, port), None))
            else:
                prefill_port, decode_port = free_port(), free_port()
                shared = ["--kv-connector", "disk_offload", "--kv-offloading-path", kv_dir,
                          "--num-threads", str(half)]
                processes.append(start(serve_command(model, prefill_port, *shared, "--kv-role", "kv_producer"),
                                       set(cores[:half])))
                processes.append(start(serve_command(model, decode_port, *shared, "--kv-role", "kv_consumer"),
                                       set(cores[half:]) or set(cores)))
                for process, p in zip(processes, (prefill_port, decode_port)):
                    wait_healthy(f"http://127.0.0.1:{p}", process)
                processes.append(start([sys.executable, "-m", "llmplug.entrypoints.cli", "proxy", "--prefill",
                                        f"http://127.0.0.1:{prefill_port}", "--decode",
                                        f"http://127.0.0.1:{decode_port}", "--port", str(port)], None))
            base_url = f"http://127.0.0.1:{port}"
            wait_healthy(base_url, processes[-1])
            asyncio.run(warm_up(base_url))
            return asyncio.run(mixed_load(base_url, args))
        finally:
            for process in processes:
                stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the embedded SmolLM2, exported once)")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "llmplug-bench"))
    parser.add_argument("--long-clients", type=int, default=8)
    parser.add_argument("--short-clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    model = args.model or str(export_default_model(Path(args.cache_dir)))
    reports = {setup: run_setup(setup, model, args) for setup in ("one", "pd")}
    same = reports["one"].pop("answers") == reports["pd"].pop("answers")
    print(json.dumps({"setups": reports, "identical_answers": same}, indent=2))


if __name__ == "__main__":
    main()
