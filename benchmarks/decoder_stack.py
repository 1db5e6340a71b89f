"""The C++ stack of all layers (llmplug/layers/decoder/native_stack.py) against the straight-line run it replaces, in
one process, alternating: one stream and a batch, on the default GGUF with its default (int4 decode) and dense.

    python benchmarks/decoder_stack.py [--rounds 4] [--tokens 128] [--batch 8] [--model PATH]

Each round runs every case once with the stack and once without (the order alternating between rounds); reported:
output tok/s, the median of the rounds, each engine's stacked / straight-line ratio, and whether both gave the same
tokens (they must: the stack makes the same kernel calls). Note the load (printed): the machines are shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads()  # before torch is imported

from llmplug import LLM, SamplingParams  # noqa: E402
from llmplug.layers.decoder.native_stack import NativeDecoderStack  # noqa: E402

from prompts import PROMPTS  # noqa: E402 - benchmarks/ is on sys.path when a script runs

STACKED_RUN = NativeDecoderStack.run


def use_stack(on: bool) -> None:
    """Let steps take the C++ stack (on) or always the straight-line run (off)."""
    NativeDecoderStack.run = STACKED_RUN if on else (lambda *args: None)


def tokens_per_second(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF or model dir; default: the embedded SmolLM2 GGUF")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    cases = {"one stream": PROMPTS[:1], f"batch {args.batch}": (PROMPTS * args.batch)[: args.batch]}
    print(f"load before: {os.getloadavg()[0]:.2f}; {args.rounds} rounds x {args.tokens} tokens")
    print("| engine | case | stacked tok/s | straight-line tok/s | stacked / straight-line | same tokens |")
    print("|---|---|---|---|---|---|")
    for engine, kwargs in (("default (int4 decode)", {}), ("dense (`quantization: none`)", {"quantization": "none"})):
        llm = LLM(args.model, **kwargs)
        for case, prompts in cases.items():
            rates: dict[bool, list[float]] = {True: [], False: []}
            tokens: dict[bool, list] = {}
            for on in (True, False):  # warm-up: first touch, the stacks built
                use_stack(on)
                tokens_per_second(llm, prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            for round_ in range(args.rounds):
                for on in ((True, False) if round_ % 2 == 0 else (False, True)):
                    use_stack(on)
                    rate, tokens[on] = tokens_per_second(llm, prompts, params)
                    rates[on].append(rate)
            stacked, plain = statistics.median(rates[True]), statistics.median(rates[False])
            print(f"| {engine} | {case} | {stacked:.1f} | {plain:.1f} | {stacked / plain:.2f}x | "
                  f"{tokens[True] == tokens[False]} |")
        use_stack(True)
        llm.shutdown()
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
