"""What batch-invariant mode (model.batch_invariant) costs: llmplug with the mode on and off, one run.

    python benchmarks/batch_invariance.py                      # default model, 32 x 64 and 1 x 64, 3 rounds
    python benchmarks/batch_invariance.py --output-len 128 --rounds 5

Greedy, dense, in the platform's preferred dtype (bf16 with native bf16, else float32; `--dtype`), prefix
caching off; the CPU it ran on is printed with the result. Each round measures off, then on, for the batch
and for one stream, so slow phases of a shared machine hit both; rows are medians over the rounds, in
output tokens per CPU second of the process (time.process_time, steadier than wall time when other jobs
share the machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads()  # before torch is imported

from throughput import bench_llmplug, load_tokenizer, make_prompts  # noqa: E402 - benchmarks/ is on sys.path when a script runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory; default: the embedded default model")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default=None, help="default: the CPU platform's preferred dtype")
    args = parser.parse_args()

    from llmplug.core.cpuinfo import cpu_model_name
    from llmplug.platforms.cpu import CpuPlatform

    dtype = args.dtype or CpuPlatform.preferred_dtype()

    from llmplug.core.config import DEFAULT_MODEL
    from llmplug.loaders.default_model import resolve_model_path

    model = resolve_model_path(args.model or DEFAULT_MODEL)
    prompts = make_prompts(load_tokenizer(model), args.num_prompts)
    rows: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for batch in (prompts, prompts[:1]):
            for invariant in (False, True):
                speed = bench_llmplug(model, batch, args.output_len, dtype, clock=time.process_time,
                                      enable_prefix_caching=False, batch_invariant=invariant)
                rows.setdefault(f"{len(batch)} x {args.output_len}, invariant={invariant}", []).append(speed)
    result: dict[str, object] = {"cpu": cpu_model_name(), "dtype": dtype}
    result |= {name: round(statistics.median(values), 3) for name, values in rows.items()}
    for batch in (len(prompts), 1):
        off = result[f"{batch} x {args.output_len}, invariant=False"]
        on = result[f"{batch} x {args.output_len}, invariant=True"]
        result[f"{batch} x {args.output_len}, on / off"] = round(on / off, 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
