"""Memory of `llmplug serve` under load: peak RSS with 32 streaming clients, and whether it grows over a soak.

    python benchmarks/serve_soak.py                          # the default model, 32 clients, 10 minutes
    python benchmarks/serve_soak.py --clients 32 --minutes 10 --json out.json

The server runs the default model (the embedded GGUF) as `llmplug serve` does out of the box. Each client
sends streaming chat requests back to back (greedy, up to `--max-tokens`; every fifth one sampled, every
seventh one abandoned after its first chunk, so aborts are part of the load) until the time is up. The
server's resident memory (its process and any children) is sampled every `--interval` seconds. Reported:
RSS once the server is up, the peak, the mean of the first and of the last minute of load, and the growth
between them (a leak shows as a growth that scales with the requests served).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from prompts import PROMPTS  # noqa: E402 - benchmarks/ is on sys.path when a script runs
from serve import free_port, server_command, stop, wait_healthy  # noqa: E402


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and its children."""
    import psutil

    process = psutil.Process(pid)
    total = process.memory_info().rss
    for child in process.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


class RssSampler(threading.Thread):
    """Samples a process's RSS every `interval` seconds: (seconds since start, bytes) pairs."""

    def __init__(self, pid: int, interval: float):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self.done.wait(self.interval):
            self.samples.append((time.monotonic() - start, rss_bytes(self.pid)))


async def load(base_url: str, clients: int, seconds: float, max_tokens: int) -> dict[str, int]:
    """`clients` concurrent streaming chat clients until `seconds` have passed; counts of what happened."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0, timeout=600)
    counts = {"completed": 0, "aborted": 0, "errors": 0}
    deadline = time.monotonic() + seconds

    async def worker(index: int) -> None:
        k = 0
        while time.monotonic() < deadline:
            k += 1
            sampled, abandon = k % 5 == 0, k % 7 == 0
            try:
                stream = await client.chat.completions.create(
                    model="bench", messages=[{"role": "user", "content": f"{PROMPTS[(index + k) % len(PROMPTS)]} ({k})"}],
                    max_tokens=max_tokens, temperature=0.8 if sampled else 0.0, stream=True)
                async for _ in stream:
                    if abandon:
                        break
                await stream.close()
                counts["aborted" if abandon else "completed"] += 1
            except openai.APIError:
                counts["errors"] += 1

    await asyncio.gather(*(worker(i) for i in range(clients)))
    await client.close()
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--json", help="Write the samples and the summary here.")
    args = parser.parse_args()

    from llmplug.core.config import DEFAULT_MODEL
    from llmplug.loaders.default_model import resolve_model_path

    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = server_command("llmplug", resolve_model_path(DEFAULT_MODEL), port, args.clients, "bfloat16")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_healthy(base_url, process)
        idle_rss = rss_bytes(process.pid)
        sampler = RssSampler(process.pid, args.interval)
        sampler.start()
        counts = asyncio.run(load(base_url, args.clients, args.minutes * 60, args.max_tokens))
        sampler.done.set()
        sampler.join()
    finally:
        stop(process)

    samples = sampler.samples
    end = samples[-1][0]
    first = [rss for t, rss in samples if t <= 60]
    last = [rss for t, rss in samples if t >= end - 60]
    mib = 1 / 2**20
    summary = {
        "clients": args.clients, "minutes": args.minutes, **counts,
        "rss_idle_mib": idle_rss * mib, "rss_peak_mib": max(rss for _, rss in samples) * mib,
        "rss_first_minute_mib": statistics.mean(first) * mib, "rss_last_minute_mib": statistics.mean(last) * mib,
    }
    summary["growth_mib"] = summary["rss_last_minute_mib"] - summary["rss_first_minute_mib"]
    for key, value in summary.items():
        print(f"{key:24s} {value:.1f}" if isinstance(value, float) else f"{key:24s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "samples": samples}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
