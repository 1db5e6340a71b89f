"""The engine's per-step host cost against the context length: a tiny model (so the forward is a small part of
a step) decoding 32 requests whose contexts share a long prefix (so prefix caching makes the prefill cheap
and every request's block table is as long as its context).

    python benchmarks/step_overhead.py                                   # contexts 256, 2048, 8192; uniproc
    python benchmarks/step_overhead.py --contexts 512 4096 --executor multiproc  # the step pickled to a worker process

Reports, per context: decode step time (after the requests are admitted), and the time per step in the scheduler (`Scheduler.schedule`) and
in the runner's input preparation (`ModelRunner._update_states` + `prepare_inputs` + the block tables'
gather). Run it on two checkouts (PYTHONPATH=...) to compare designs: before the persistent block tables,
the scheduler copied and sent every request's whole table each step and the runner rebuilt the array.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import tempfile
import time

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads()  # before torch is imported

TIMED = {  # module -> (class, methods) whose time a step spends
    "llmplug.engine.scheduler": ("Scheduler", ("schedule",)),
    "llmplug.engine.model_runner": ("ModelRunner", ("_update_states", "prepare_inputs")),
    "llmplug.engine.block_table": ("BlockTable", ("gather",)),  # absent before the persistent tables
}


def time_methods(totals: collections.Counter) -> None:
    """Add each TIMED method's seconds to `totals` (runs in the process that calls them: uniproc only)."""
    import importlib

    for module_name, (cls_name, methods) in TIMED.items():
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except ImportError:
            continue
        for name in methods:
            setattr(cls, name, _timed(getattr(cls, name), f"{cls_name}.{name}", totals))


def _timed(method, key: str, totals: collections.Counter):
    @functools.wraps(method)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start
    return timed


def tiny_llama(folder: str, max_positions: int) -> str:
    """A random 2-layer Llama (hidden 64) saved in `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def run(model: str, context: int, num_requests: int, output_len: int, executor: str,
        totals: collections.Counter) -> dict[str, float]:
    """Decode step time at `context` tokens, and the TIMED methods' share of it (from `totals`)."""
    from llmplug import LLM, SamplingParams

    prefix = [(7 * i) % 500 + 3 for i in range(context - 8)]
    prompts = [{"prompt_token_ids": prefix + [(i + j) % 500 + 3 for j in range(8)]} for i in range(num_requests)]
    llm = LLM(model=model, skip_tokenizer_init=True, max_model_len=context + output_len + 16, dtype="float32",
              max_num_seqs=num_requests, max_num_batched_tokens=max(2048, num_requests * 16),
              distributed_executor_backend=executor, enable_prefix_caching=True)
    llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)  # computes and caches the prefix
    engine, params = llm.llm_engine, SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    engine.step()  # admits them (hashing each prompt for the cache lookup) and computes the uncached tails
    totals.clear()
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():  # decode steps only
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    result = {"context": context, "step_ms": 1e3 * elapsed / steps}
    result.update({f"{key}_ms": 1e3 * seconds / steps for key, seconds in sorted(totals.items())})
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 8192])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--executor", default="uniproc", choices=["uniproc", "multiproc"])
    args = parser.parse_args()
    totals: collections.Counter = collections.Counter()
    time_methods(totals)
    with tempfile.TemporaryDirectory() as folder:
        model = tiny_llama(folder, max(args.contexts) + args.output_len + 16)
        for context in args.contexts:
            result = run(model, context, args.num_requests, args.output_len, args.executor, totals)
            print(json.dumps({key: round(value, 3) for key, value in result.items()}), flush=True)


if __name__ == "__main__":
    main()
