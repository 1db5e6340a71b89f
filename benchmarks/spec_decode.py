"""Speculative decoding, single stream: n-gram prompt lookup on a task that repeats its prompt (editing code
that is in the prompt), against plain decoding — llmplug's and HF transformers' (`prompt_lookup_num_tokens`)
side by side, greedy, in one run.

    python benchmarks/spec_decode.py                      # the embedded default model (GGUF)
    python benchmarks/spec_decode.py --model DIR --num-speculative-tokens 4 --output-len 256

Reports output tokens/s of each, the speedups, and llmplug's acceptance rate and mean accepted length.
"""

from __future__ import annotations

import argparse
import json
import sys
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


def bench_llmplug(model: str, prompt: list[int], output_len: int, dtype: str,
                  speculative_config: dict | None) -> tuple[float, list[int], dict]:
    from llmplug import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_num_seqs=1, speculative_config=speculative_config or {})
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)  # the same length every run
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    elapsed = time.perf_counter() - start
    stats = llm.stats()
    llm.shutdown()
    return len(out.token_ids) / elapsed, list(out.token_ids), stats


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
    ngram = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
             "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    results: dict = {"model": model, "prompt_tokens": len(prompt), "output_len": args.output_len}
    plain, plain_tokens, _ = bench_llmplug(model, prompt, args.output_len, args.dtype, None)
    spec, spec_tokens, stats = bench_llmplug(model, prompt, args.output_len, args.dtype, ngram)
    results["llmplug"] = {
        "plain_tok_s": plain, "ngram_tok_s": spec, "speedup": spec / plain, "same_tokens": plain_tokens == spec_tokens,
        "output_tokens": len(spec_tokens), "acceptance_rate": stats["spec_decode_acceptance_rate"],
        "mean_accepted_length": stats["spec_decode_mean_accepted_length"],
    }
    if not args.no_hf:
        hf = load_hf(model, args.dtype)
        hf_plain, hf_plain_tokens = bench_hf(hf, prompt, args.output_len, None)
        hf_spec, hf_spec_tokens = bench_hf(hf, prompt, args.output_len, args.num_speculative_tokens)
        results["hf"] = {"plain_tok_s": hf_plain, "prompt_lookup_tok_s": hf_spec, "speedup": hf_spec / hf_plain,
                         "same_tokens": hf_plain_tokens == hf_spec_tokens}
        results["llmplug_ngram_over_hf_prompt_lookup"] = spec / hf_spec
    print(json.dumps(results, indent=2))
    print("answer:", tokenizer.decode(spec_tokens)[:400], file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
