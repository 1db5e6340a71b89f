"""Tensor and pipeline parallelism against one worker: the same model, prompts and output lengths,
greedy, in one run (llmplug only).

    python benchmarks/parallel.py --model DIR                      # TP=1, TP=2, PP=2
    python benchmarks/parallel.py --model DIR --layouts 1x1 2x1 --num-prompts 16 --output-len 64

A layout is TPxPP. Prompts are random token ids (no tokenizer needed, so any checkpoint directory
works). Reports output tokens/s for a batch of prompts and for one stream, and the ratio to the first
layout. On a CPU the workers split the cores, so expect parallelism to cost rather than
gain there: the numbers measure the overhead of the collectives and the step broadcast.
"""

from __future__ import annotations

import argparse
import json
import time

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads()  # before torch is imported

import random  # noqa: E402


def run_layout(
    model: str, tp: int, pp: int, prompts: list[list[int]], output_len: int, dtype: str
) -> dict[str, float]:
    """Output tokens/s of a batch and of one stream for one TPxPP layout."""
    from llmplug import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              max_num_seqs=max(len(prompts), 1), skip_tokenizer_init=True)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        return {"batch": _tokens_per_s(llm, prompts, params), "stream": _tokens_per_s(llm, prompts[:1], params)}
    finally:
        llm.shutdown()


def _tokens_per_s(llm, prompts: list[dict], params) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory (heads divisible by the TP sizes)")
    parser.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "1x2"], help="TPxPP, the first is the baseline")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(32, 128))] for _ in range(args.num_prompts)]
    results = {}
    for layout in args.layouts:
        tp, pp = (int(n) for n in layout.split("x"))
        results[layout] = run_layout(args.model, tp, pp, prompts, args.output_len, args.dtype)
    base = results[args.layouts[0]]
    for layout, r in results.items():
        print(f"TPxPP {layout}: batch {r['batch']:.1f} tok/s ({r['batch'] / base['batch']:.2f}x), "
              f"stream {r['stream']:.1f} tok/s ({r['stream'] / base['stream']:.2f}x)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
