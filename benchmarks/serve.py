"""Serving latency and throughput: `llmplug serve` vs `transformers serve --continuous-batching` and llama.cpp's
`llama-server`, same model, one run.

    python benchmarks/serve.py                                  # the embedded SmolLM2, exported once to safetensors
    python benchmarks/serve.py --model DIR --concurrency 1 8 32 --requests-per-client 2 --max-tokens 64

Each engine runs as its own server process on 127.0.0.1, one after the other. For each concurrency C,
C clients each send `--requests-per-client` streaming chat requests back to back (greedy, `max_tokens`
tokens at most). Reported per engine and C: requests/s, output tokens/s, time to first token (TTFT) and
inter-token latency (ITL, the gaps between streamed chunks), median and p99, and llmplug/transformers
ratios (throughput: higher is better for llmplug when > 1; latency: lower is better when < 1).
Three llmplug rows: `llmplug` (the default engine on the dense export), `llmplug-int8` (`--quantization int8`)
and, on request, `llmplug-int4` (the GGUF itself with the defaults, `--quantization auto`: its own 4-bit blocks
for generated tokens, prompts dense, as llama-server reads them). Data parallelism, on request: `llmplug-dp2` (`--data-parallel-size 2`: two replicas,
each pinned to half of the cores with one thread per core) against `llmplug` (one engine, all cores), with the
ratio table and whether their greedy answers are identical:

    python benchmarks/serve.py --engines llmplug llmplug-dp2 --concurrency 32 64
Output tokens are counted by re-tokenizing each answer with the model's tokenizer, the same way for both.

transformers cannot serve the GGUF file itself, so the default model is first exported (dequantized)
to a safetensors directory that llmplug and transformers load; `llama-server` runs the GGUF itself (its
own 4-bit blocks), with one slot per client and torch's thread count. `make bench` builds it once (next to
this Python, from the llama.cpp that `llama-cpp-python` vendors); without it the llama-server rows are skipped. `--json FILE` writes the results; `--plot FILE.png`
draws them (needs matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prompts import PROMPTS  # noqa: E402 - benchmarks/ is on sys.path when a script runs


@dataclass
class RequestResult:
    ttft: float
    itls: list[float]
    text: str
    prompt: str = ""


@dataclass
class LevelResult:
    engine: str
    concurrency: int
    num_requests: int
    duration_s: float
    output_tokens: int
    requests_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    ttft_median_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    itl_median_ms: float = 0.0
    itl_p99_ms: float = 0.0
    errors: list[str] = field(default_factory=list)
    answers: dict[str, str] = field(default_factory=dict)  # prompt -> greedy answer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# --- the model ------------------------------------------------------------------------------------


def export_default_model(cache_dir: Path) -> Path:
    """The embedded GGUF dequantized into a safetensors directory (once), for both servers."""
    target = cache_dir / "SmolLM2-135M-Instruct-hf"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM

    from llmplug.loaders.default_model import resolve_model_path
    from llmplug.loaders.gguf import load_gguf_tokenizer

    gguf = resolve_model_path("SmolLM2-135M-Instruct")
    loaded = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    config = loaded.config
    config.architectures = [type(loaded).__name__]
    if hasattr(config, "quantization_config"):  # the GGUF marker: transformers refuses to save such a model
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)  # a plain model holding the dequantized weights
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(target)
    load_gguf_tokenizer(gguf).save_pretrained(target)
    return target


# --- the servers ----------------------------------------------------------------------------------


def llama_server_binary() -> str | None:
    """The `llama-server` that `make bench` built next to this Python, else one on PATH, else None."""
    beside = Path(sys.executable).parent / "llama-server"
    return str(beside) if beside.is_file() else shutil.which("llama-server")


# llmplug's rows: the default engine on the dense export, int8 weights and activations, and the GGUF itself with
# the defaults: its own int4 blocks for generated tokens (docs/quantization.md)
LLMPLUG_ENGINES: dict[str, list[str]] = {
    "llmplug": [], "llmplug-int8": ["--quantization", "int8"], "llmplug-int4": ["--quantization", "auto"],
    "llmplug-dp2": ["--data-parallel-size", "2"],
}
GGUF_ENGINES = ("llama-server", "llmplug-int4")  # they serve the embedded GGUF itself, not the dense export


def llama_server_cpu_args() -> list[str]:
    """On a CPU with AMX, `--no-repack`: the llama.cpp that `make bench` builds (with `-march=native`, so its AMX
    buffer type) segfaulted while repacking the GGUF's weights at load on an Intel Xeon with AMX, every time
    (2026-12-07); without the repack it loads and serves, with its AVX-512 kernels."""
    from llmplug.core.cpuinfo import cpu_flags

    return ["--no-repack"] if "amx_int8" in cpu_flags() else []


def server_command(engine: str, model: str, port: int, max_seqs: int, dtype: str) -> list[str]:
    if engine == "llama-server":  # `model` is the GGUF; each slot holds one client's 2,048-token context
        from llmplug.platforms.cpu_threads import available_cpu_count

        threads = str(available_cpu_count())
        return [llama_server_binary(), "-m", model, "--host", "127.0.0.1", "--port", str(port),
                "--parallel", str(max_seqs), "--ctx-size", str(2048 * max_seqs), "--threads", threads,
                "--threads-batch", threads, "--alias", "bench", *llama_server_cpu_args()]
    if engine in LLMPLUG_ENGINES:
        return [sys.executable, "-m", "llmplug.entrypoints.cli", "serve", model, "--port", str(port),
                "--served-model-name", "bench", "--max-num-seqs", str(max_seqs), "--dtype", dtype,
                "--log-level", "warning", *LLMPLUG_ENGINES[engine]]
    binary = os.path.join(os.path.dirname(sys.executable), "transformers")
    return [binary, "serve", model, "--continuous-batching", "--port", str(port), "--device", "cpu",
            "--dtype", dtype, "--log-level", "warning"]


def wait_healthy(base_url: str, process: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:  # not listening yet (URLError is an OSError)
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy in time")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --- the clients ----------------------------------------------------------------------------------


async def one_request(client, model: str, prompt: str, max_tokens: int) -> RequestResult:
    start = time.perf_counter()
    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=max_tokens, temperature=0, stream=True)
    times, parts = [], []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            parts.append(chunk.choices[0].delta.content)
    if not times:
        raise RuntimeError("the stream carried no text")
    return RequestResult(times[0] - start, [b - a for a, b in zip(times, times[1:])], "".join(parts), prompt)


async def run_level(base_url: str, model: str, concurrency: int, per_client: int, max_tokens: int,
                    tokenizer, engine: str) -> LevelResult:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0, timeout=1800)
    results: list[RequestResult] = []
    errors: list[str] = []

    async def worker(index: int) -> None:
        for k in range(per_client):
            prompt = f"{PROMPTS[(index + k) % len(PROMPTS)]} (client {index}, request {k})"
            try:
                results.append(await one_request(client, model, prompt, max_tokens))
            except Exception as exc:  # noqa: BLE001 - reported with the results
                errors.append(repr(exc))

    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    duration = time.perf_counter() - start
    await client.close()
    tokens = sum(len(tokenizer.encode(r.text, add_special_tokens=False)) for r in results)
    ttfts = [r.ttft * 1000 for r in results]
    itls = [gap * 1000 for r in results for gap in r.itls]
    return LevelResult(
        engine=engine, concurrency=concurrency, num_requests=len(results), duration_s=duration,
        output_tokens=tokens, requests_per_s=len(results) / duration, output_tokens_per_s=tokens / duration,
        ttft_median_ms=statistics.median(ttfts) if ttfts else float("nan"), ttft_p99_ms=percentile(ttfts, 0.99),
        itl_median_ms=statistics.median(itls) if itls else float("nan"), itl_p99_ms=percentile(itls, 0.99),
        errors=errors, answers={r.prompt: r.text for r in results},
    )


def bench_engine(engine: str, model: str, args: argparse.Namespace, tokenizer) -> list[LevelResult]:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = server_command(engine, model, port, max(args.concurrency), args.dtype)
    print(f"[{engine}] starting: {' '.join(command)}", file=sys.stderr)
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL if not args.verbose else None,
                               stderr=subprocess.STDOUT if not args.verbose else None)
    served = model if engine == "transformers" else "bench"
    try:
        wait_healthy(base_url, process)
        asyncio.run(run_level(base_url, served, 1, 1, 8, tokenizer, engine))  # warm-up
        levels = []
        for concurrency in args.concurrency:
            level = asyncio.run(run_level(base_url, served, concurrency, args.requests_per_client, args.max_tokens,
                                          tokenizer, engine))
            print(f"[{engine}] C={concurrency}: {level.requests_per_s:.2f} req/s, "
                  f"{level.output_tokens_per_s:.1f} tok/s, TTFT {level.ttft_median_ms:.0f} ms, "
                  f"ITL {level.itl_median_ms:.1f} ms, errors {len(level.errors)}", file=sys.stderr)
            levels.append(level)
        return levels
    finally:
        stop(process)


# --- the report -----------------------------------------------------------------------------------


def table(results: dict[str, list[LevelResult]]) -> str:
    rows = ["| engine | clients | req/s | output tok/s | TTFT median ms | TTFT p99 ms | ITL median ms | ITL p99 ms |",
            "|---|---|---|---|---|---|---|---|"]
    for engine, levels in results.items():
        for r in levels:
            rows.append(f"| {engine} | {r.concurrency} | {r.requests_per_s:.2f} | {r.output_tokens_per_s:.1f} | "
                        f"{r.ttft_median_ms:.0f} | {r.ttft_p99_ms:.0f} | {r.itl_median_ms:.1f} | {r.itl_p99_ms:.1f} |")
    for mine, peer in ((mine, peer) for mine in LLMPLUG_ENGINES for peer in ("transformers", "llama-server")):
        if {mine, peer} <= set(results):
            rows += ["", f"| clients | {mine} / {peer}: req/s | tok/s | TTFT median | ITL median |",
                     "|---|---|---|---|---|"]
            for ours, theirs in zip(results[mine], results[peer]):
                rows.append(f"| {ours.concurrency} | {ours.requests_per_s / theirs.requests_per_s:.2f}x | "
                            f"{ours.output_tokens_per_s / theirs.output_tokens_per_s:.2f}x | "
                            f"{ours.ttft_median_ms / theirs.ttft_median_ms:.2f}x | "
                            f"{ours.itl_median_ms / theirs.itl_median_ms:.2f}x |")
    if {"llmplug-dp2", "llmplug"} <= set(results):
        rows += ["", "| clients | llmplug-dp2 / llmplug: req/s | tok/s | TTFT median | ITL median | identical answers |",
                 "|---|---|---|---|---|---|"]
        for dp, one in zip(results["llmplug-dp2"], results["llmplug"]):
            same = sum(dp.answers.get(prompt) == text for prompt, text in one.answers.items())
            rows.append(f"| {dp.concurrency} | {dp.requests_per_s / one.requests_per_s:.2f}x | "
                        f"{dp.output_tokens_per_s / one.output_tokens_per_s:.2f}x | "
                        f"{dp.ttft_median_ms / one.ttft_median_ms:.2f}x | {dp.itl_median_ms / one.itl_median_ms:.2f}x | "
                        f"{same} of {len(one.answers)} |")
    return "\n".join(rows)


def plot(results: dict[str, list[LevelResult]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for engine, levels in results.items():
        xs = [r.concurrency for r in levels]
        axes[0].plot(xs, [r.output_tokens_per_s for r in levels], marker="o", label=engine)
        axes[1].plot(xs, [r.ttft_median_ms for r in levels], marker="o", label=engine)
        axes[2].plot(xs, [r.itl_median_ms for r in levels], marker="o", label=engine)
    for ax, title in zip(axes, ("output tokens/s", "TTFT median (ms)", "ITL median (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="Model directory both servers load. Default: the embedded SmolLM2, "
                                        "exported to safetensors under --cache-dir.")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "llmplug-bench"))
    parser.add_argument("--engines", nargs="+", default=["llmplug", "llmplug-int8", "transformers", "llama-server"],
                        choices=[*LLMPLUG_ENGINES, "transformers", "llama-server"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--json", help="Write the results here.")
    parser.add_argument("--plot", help="Draw throughput and latency against concurrency into this PNG.")
    parser.add_argument("--verbose", action="store_true", help="Show the servers' own output.")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from llmplug.core.config import DEFAULT_MODEL
    from llmplug.loaders.default_model import resolve_model_path

    model = args.model or str(export_default_model(Path(args.cache_dir)))
    tokenizer = AutoTokenizer.from_pretrained(model)
    engines = list(args.engines)
    if "llama-server" in engines and (args.model or llama_server_binary() is None):
        print("[llama-server] skipped: it needs `make bench` (which builds it) and runs the embedded GGUF only", file=sys.stderr)
        engines.remove("llama-server")
    if "llmplug-int4" in engines and args.model:
        print("[llmplug-int4] skipped: it runs the embedded GGUF's own 4-bit blocks only", file=sys.stderr)
        engines.remove("llmplug-int4")
    models = {engine: resolve_model_path(DEFAULT_MODEL) for engine in GGUF_ENGINES}
    results = {engine: bench_engine(engine, models.get(engine, model), args, tokenizer) for engine in engines}
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({e: [asdict(r) for r in rs] for e, rs in results.items()}, indent=2))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
