"""`llmplug bench serve`: streaming completions against a running server, vLLM's `vllm bench serve`.

Prompts are random token ids (`--dataset-name random`: `--random-input-len` tokens, none special) sent as
/v1/completions token-id prompts, each asking for exactly `--random-output-len` tokens (ignore_eos, greedy).
Requests start at `--request-rate` per second (Poisson arrivals; inf: all at once), at most
`--max-concurrency` in flight. Each is timed as the client sees it: time to first token (TTFT), time per
output token after the first (TPOT), the gaps between streamed chunks (ITL) and the end-to-end latency.
Generated tokens are the server's own count (`stream_options.include_usage`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

from llmplug.entrypoints.arg_types import positive_int
from llmplug.entrypoints.bench.metrics import RequestTiming, serving_summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", metavar="URL", help="The server, e.g. http://127.0.0.1:8000. Default: from "
                                                     "--host and --port.")
    g.add_argument("--host", default="127.0.0.1", help="Default: 127.0.0.1.")
    g.add_argument("--port", type=int, default=8000, help="Default: 8000.")
    g.add_argument("--model", metavar="NAME", help="The `model` of each request. Default: the server's first "
                                                   "in /v1/models.")
    g.add_argument("--tokenizer", metavar="PATH",
                   help="Tokenizer whose vocabulary the random prompts are drawn from: a model folder, .gguf or "
                        "embedded model name. Default: --model.")
    g.add_argument("--api-key", metavar="KEY", help="Sent as 'Authorization: Bearer KEY'. Default: "
                                                    "LLMPLUG_API_KEY or none.")
    g = parser.add_argument_group("load")
    g.add_argument("--dataset-name", choices=["random"], default="random",
                   help="Where prompts come from: random token ids (the only one here). Default: random.")
    g.add_argument("--num-prompts", type=positive_int, default=1000, metavar="N", help="Requests. Default: 1000.")
    g.add_argument("--random-input-len", type=positive_int, default=1024, metavar="N",
                   help="Tokens in each prompt. Default: 1024.")
    g.add_argument("--random-output-len", type=positive_int, default=128, metavar="N",
                   help="Tokens each request generates. Default: 128.")
    g.add_argument("--request-rate", type=float, default=float("inf"), metavar="RPS",
                   help="Requests started per second (Poisson arrivals); inf: all at once. Default: inf.")
    g.add_argument("--max-concurrency", type=positive_int, default=None, metavar="N",
                   help="Most requests in flight at once. Default: no limit.")
    g.add_argument("--seed", type=int, default=0, help="Seeds the prompts and the arrivals. Default: 0.")
    g.add_argument("--save-result", metavar="FILE", help="Also write the results to this JSON file.")
    g.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")


def run(args: argparse.Namespace) -> int:
    """Benchmark the server; print vLLM's serving summary."""
    import os

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    api_key = args.api_key or os.environ.get("LLMPLUG_API_KEY") or "none"
    model = args.model or _first_model(base_url, api_key)
    prompts = random_prompts(_load_tokenizer(args.tokenizer or model), args.num_prompts, args.random_input_len,
                             args.seed)
    results, duration = asyncio.run(_benchmark(base_url, api_key, model, args, prompts))
    print(serving_summary(results, duration, args.max_concurrency, args.request_rate))
    failed = [r.error for r in results if r.error is not None]
    if failed:
        print(f"first failure: {failed[0]}", file=sys.stderr)
    if args.save_result:
        _save(args.save_result, results, duration, args)
    return 0 if not failed else 1


def _first_model(base_url: str, api_key: str) -> str:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0)
    return client.models.list().data[0].id


def _load_tokenizer(name: str) -> Any:
    """A transformers tokenizer from a model folder, a .gguf file or an embedded model name."""
    from pathlib import Path

    if not Path(name).is_dir():
        from llmplug.loaders.default_model import resolve_model_path
        from llmplug.loaders.gguf import load_gguf_tokenizer

        path = name if name.endswith(".gguf") else resolve_model_path(name)
        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def random_prompts(tokenizer: Any, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """`num_prompts` lists of `input_len` random token ids, none of them special."""
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    rng = random.Random(seed)
    return [rng.choices(vocab, k=input_len) for _ in range(num_prompts)]


async def _benchmark(base_url: str, api_key: str, model: str, args: argparse.Namespace,
                     prompts: list[list[int]]) -> tuple[list[RequestTiming], float]:
    import openai
    from tqdm import tqdm

    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=3600)
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
    bar = tqdm(total=len(prompts), disable=args.disable_tqdm)
    rng = random.Random(args.seed)

    async def one(prompt: list[int]) -> RequestTiming:
        async with limit:
            timing = await stream_completion(client, model, prompt, args.random_output_len)
        bar.update(1)
        return timing

    tasks = []
    start = time.perf_counter()
    for prompt in prompts:
        tasks.append(asyncio.ensure_future(one(prompt)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    await client.close()
    return list(results), duration


async def stream_completion(client: Any, model: str, prompt: list[int], max_tokens: int) -> RequestTiming:
    """One streamed completion, timed; a failure is recorded in the timing, not raised."""
    timing = RequestTiming(prompt_len=len(prompt))
    start = last = time.perf_counter()
    chunks = 0
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if chunks == 0:
                    timing.ttft = now - start
                else:
                    timing.itl.append(now - last)
                chunks, last = chunks + 1, now
            if chunk.usage is not None:
                timing.output_tokens = chunk.usage.completion_tokens
        timing.latency = last - start
        timing.output_tokens = timing.output_tokens or chunks
    except Exception as exc:  # noqa: BLE001 - a failed request is counted and reported, the others go on
        timing.error = repr(exc)
    return timing


def _save(path: str, results: list[RequestTiming], duration: float, args: argparse.Namespace) -> None:
    ok = [r for r in results if r.error is None]
    data = {"duration": duration, "completed": len(ok), "num_prompts": len(results),
            "request_rate": str(args.request_rate), "max_concurrency": args.max_concurrency,
            "total_input_tokens": sum(r.prompt_len for r in ok),
            "total_output_tokens": sum(r.output_tokens for r in ok),
            "ttfts": [r.ttft for r in ok], "itls": [r.itl for r in ok], "output_lens": [r.output_tokens for r in ok],
            "errors": [r.error for r in results if r.error is not None]}
    with open(path, "w", encoding="utf-8") as file:
        json.dump(data, file, indent=4)
