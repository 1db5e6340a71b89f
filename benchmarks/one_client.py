"""One served client against offline single-stream generation, same model, one run, alternating rounds.

    python benchmarks/one_client.py                          # the default model (SmolLM2-135M GGUF), 256 tokens, 5 rounds
    python benchmarks/one_client.py --rounds 8 --max-tokens 128 --json out.json
    python benchmarks/one_client.py --serve-args "--num-threads 1"  # the server with engine flags of its own

Each round runs, in a rotating order, the same greedy chat answer (EOS ignored) three ways:
- `offline`: `LLM.chat` in this process (the default `LLM()`);
- `stream`: one client of `llmplug serve` (a process of its own, with the `--serve-args` flags, none by default)
  through the real `openai` client, chat completions with `stream=True`;
- `whole`: the same request with `stream=False`.
Reported per way: median output tokens/s (tokens over the request's wall time, prefill included, as a client sees
it), ms per token and, for the stream, the median gap between chunks (ITL); then each served way's ratio to
offline, computed per round (the rounds alternate, so a change of the machine's load hits all three alike). The
three answers must be the same text: the script exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

QUESTION = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    """`llmplug serve` on 127.0.0.1:port, ready (its /health answers)."""
    llmplug = Path(sys.executable).with_name("llmplug")
    command = [str(llmplug), "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra]
    server = subprocess.Popen(command, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"llmplug serve exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError("llmplug serve did not become ready")


def stop_server(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


def run_offline(llm, params) -> dict:
    start = time.perf_counter()
    completion = llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "tokens": len(completion.token_ids), "text": completion.text}


def run_stream(client, model: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    chunks = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts, arrivals, tokens = [], [], 0
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            texts.append(chunk.choices[0].delta.content)
            arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    elapsed = time.perf_counter() - start
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"seconds": elapsed, "tokens": tokens, "text": "".join(texts), "itl": statistics.median(gaps)}


def run_whole(client, model: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=max_tokens,
                                           extra_body={"ignore_eos": True})
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "tokens": reply.usage.completion_tokens, "text": reply.choices[0].message.content}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--json", help="write the per-round results here")
    parser.add_argument("--serve-args", default="",
                        help="flags for `llmplug serve`, one string (e.g. \"--num-threads 1\")")
    args = parser.parse_args()

    import openai

    from llmplug import LLM, SamplingParams
    from llmplug.core.config import DEFAULT_MODEL

    port = free_port()
    server = start_server(port, shlex.split(args.serve_args))
    try:
        llm = LLM()
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        ways = {
            "offline": lambda: run_offline(llm, params),
            "stream": lambda: run_stream(client, DEFAULT_MODEL, args.max_tokens),
            "whole": lambda: run_whole(client, DEFAULT_MODEL, args.max_tokens),
        }
        for run in ways.values():  # warm-up, not counted
            run()
        rounds: list[dict[str, dict]] = []
        names = list(ways)
        for r in range(args.rounds):
            order = names[r % 3:] + names[:r % 3]
            rounds.append({name: ways[name]() for name in order})
            print(f"round {r + 1}: " + ", ".join(
                f"{n} {rounds[-1][n]['tokens'] / rounds[-1][n]['seconds']:.1f} tok/s" for n in names), flush=True)
    finally:
        stop_server(server)

    texts = {name: {result[name]["text"] for result in rounds} for name in names}
    same = all(len(t) == 1 for t in texts.values()) and len({next(iter(t)) for t in texts.values()}) == 1
    print(f"\nload: {os.getloadavg()[0]:.2f} (1-min average after the run), {args.rounds} rounds, "
          f"{args.max_tokens} tokens, the same answer three ways: {same}")
    print(f"{'way':<8} {'tok/s':>8} {'ms/token':>9} {'ITL ms':>7} {'vs offline':>11}")
    for name in names:
        rates = [result[name]["tokens"] / result[name]["seconds"] for result in rounds]
        ratios = [result[name]["tokens"] / result[name]["seconds"] * result["offline"]["seconds"]
                  / result["offline"]["tokens"] for result in rounds]
        itl = statistics.median(result[name]["itl"] for result in rounds) * 1e3 if name == "stream" else None
        print(f"{name:<8} {statistics.median(rates):>8.1f} {1e3 / statistics.median(rates):>9.2f} "
              f"{'' if itl is None else f'{itl:.2f}':>7} {statistics.median(ratios):>10.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
