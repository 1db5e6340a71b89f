"""`llmplug run`, `llmplug generate` and `llmplug chat`: the engine from the terminal.

Kept light at import time (the CLI builds every parser on each call); torch loads inside `run`.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from llmplug.entrypoints.engine_args import add_engine_args, config_from_args

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Explain what a large language model is in two sentences.",
    "Write a haiku about the sea.",
]
# `llmplug run` computes the embedded default model in float32 unless a flag or config file sets the dtype. Its
# greedy answers hold near-ties (the capital question's first token, "The" against "L'", leads by 0.08 nats in
# float32) that bf16 rounding tips one way or the other by the kernels the CPU gets (AMX, AVX-512, AVX2): in bf16
# the README's answers would hold on some CPUs only. float32 rounding differs across kernels by ~1e-6.
DEMO_DTYPE = "float32"


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the SamplingParams fields a terminal user sets."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="Most tokens to generate. Default: 256.")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default).")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--stop", action="append", default=None, help="A stop string (repeatable).")
    g.add_argument("--ignore-eos", action="store_true", help="Keep generating past the end-of-sequence token.")


def sampling_params_from_args(args: argparse.Namespace, seed: int) -> Any:
    """SamplingParams from the sampling flags; the engine seed (--seed) seeds sampling too."""
    from llmplug.core.params import RequestOutputKind, SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, stop=args.stop, ignore_eos=args.ignore_eos, seed=seed,
        output_kind=RequestOutputKind.DELTA if getattr(args, "stream", False) else RequestOutputKind.CUMULATIVE,
    )


def _make_llm(args: argparse.Namespace, config: Any = None) -> Any:
    from llmplug import _configure_threads_before_torch

    _configure_threads_before_torch()
    from llmplug.engine.llm import LLM

    return LLM(config=config or config_from_args(args).config)


def _prompt(llm: Any, text: str, raw: bool) -> Any:
    """Instruct models get the chat template unless --raw asks for plain completion."""
    tokenizer = llm.get_tokenizer()
    if raw or tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        return text
    return llm.chat_prompt([{"role": "user", "content": text}])


# --- llmplug generate ----------------------------------------------------------------------------


def _generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="+", help="One or more prompts.")
    parser.add_argument("--raw", action="store_true", help="Complete the prompt as is, without the chat template.")
    parser.add_argument("--stats", action="store_true", help="Print tokens/s after the completions.")
    add_sampling_args(parser)
    add_engine_args(parser)


def _run_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = sampling_params_from_args(args, llm.config.model.seed)
    prompts = [_prompt(llm, p, args.raw) for p in args.prompt]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for out in outputs:
        print(out.outputs[0].text)
    if args.stats:
        _print_stats(outputs, elapsed)
    return 0


def _print_stats(outputs: list[Any], elapsed: float) -> None:
    num = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"[{len(outputs)} prompts, {num} tokens in {elapsed:.2f} s: {num / elapsed:.1f} output tok/s]",
          file=sys.stderr)


# --- llmplug run (make run) ----------------------------------------------------------------------


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    add_sampling_args(parser)
    add_engine_args(parser)


def _demo_config(args: argparse.Namespace) -> Any:
    """The flags' config, with DEMO_DTYPE for the embedded default model when nothing chose a dtype."""
    from llmplug.core.config import DEFAULT_MODEL

    resolved = config_from_args(args)
    if resolved.sources.get("model.dtype") == "default" and resolved.config.model.model == DEFAULT_MODEL:
        resolved = config_from_args(args, {"dtype": DEMO_DTYPE})
    return resolved.config


def _run_demo(args: argparse.Namespace) -> int:
    llm = _make_llm(args, _demo_config(args))
    print(f"model: {llm.config.model.model}\nplatform: {llm.config.device.platform}  dtype: {llm.config.model.dtype}\n")
    params = sampling_params_from_args(args, llm.config.model.seed)
    prompts = [_prompt(llm, p, raw=False) for p in DEMO_PROMPTS]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for question, out in zip(DEMO_PROMPTS, outputs):
        print(f"Q: {question}\nA: {out.outputs[0].text.strip()}\n")
    _print_stats(outputs, elapsed)
    return 0


# --- llmplug chat --------------------------------------------------------------------------------


def _chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", default=None, help="A system message that starts the conversation.")
    add_sampling_args(parser)
    add_engine_args(parser)


def _run_chat(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    args.stream = True
    params = sampling_params_from_args(args, llm.config.model.seed)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Chatting with the model; Ctrl-D or Ctrl-C to leave.", file=sys.stderr)
    try:
        while True:
            try:
                user = input(">>> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
            if not user.strip():
                continue
            messages.append({"role": "user", "content": user})
            messages.append({"role": "assistant", "content": _stream_answer(llm, messages, params)})
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 0


def _stream_answer(llm: Any, messages: list[dict[str, str]], params: Any) -> str:
    """Print the answer as it is generated; return its full text."""
    request_id = llm.add_request(llm.chat_prompt(messages), params)
    pieces: list[str] = []
    try:
        finished = False
        while not finished:
            for out in llm.step():
                if out.request_id != request_id:
                    continue
                delta = out.outputs[0].text
                pieces.append(delta)
                print(delta, end="", flush=True)
                finished = out.finished
    except KeyboardInterrupt:
        llm.abort(request_id)
        raise
    print()
    return "".join(pieces)
