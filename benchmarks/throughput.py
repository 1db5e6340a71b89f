"""Offline throughput: llmplug vs HF transformers (padded `generate` and continuous-batching
`generate_batch`) and llama.cpp on the same model, prompts and output lengths, greedy, in one run.

    python benchmarks/throughput.py                       # the embedded default model (GGUF)
    python benchmarks/throughput.py --model DIR --num-prompts 32 --output-len 128

Reports output tokens/s of each engine for a batch of prompts and for one stream, prefill tokens/s
(the batch's prompt tokens, one output token each; prefix cache off; llmplug's and HF's rows the median of
--prefill-repeats calls: one call is ~0.2-0.5 s, which a shared host's noise moves by ~20 %), and the ratios;
llmplug with its defaults (for a GGUF of exact int4 blocks, as the default model: generated tokens in int4,
prompts dense), with dense weights (`quantization: none`, GGUF only) and with `quantization: int8`
(docs/quantization.md). With --compile
also llmplug with `device.compile` (compiled in the warm-up, not timed); with --cpu-clock every row is
timed in CPU seconds of the process, steadier when other jobs share the machine.

When the model is a GGUF and `llama-cpp-python` is installed (`pip install -e '.[bench-peers]'`, which
builds llama.cpp once; `make bench` does it), llama.cpp runs the same file with the same thread count:
its single stream and its prefill (one prompt at a time: the Python binding runs one sequence; its
batched serving is measured by `benchmarks/serve.py` against `llama-server`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads()  # before torch is imported: same thread settings for every engine measured

import torch  # noqa: E402

from prompts import PROMPTS  # noqa: E402 - benchmarks/ is on sys.path when a script runs


def make_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    """Chat-formatted prompts of realistic, slightly different lengths."""
    out = []
    for i in range(num_prompts):
        msg = [{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} (variant {i})"}]
        text = tokenizer.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


# Each bench_* returns output tokens per second of `clock`: wall time by default; benchmarks/moe.py passes
# time.process_time (CPU seconds of this process, steadier on a shared machine)


def bench_llmplug(model: str, prompts: list[list[int]], output_len: int, dtype: str,
                  quantization: str = "auto", clock=time.perf_counter, repeats: int = 1, **engine) -> float:
    """Output tokens/s of one `generate` of the prompts (with output_len 1, prompt tokens/s), the median of
    `repeats` calls after a warm-up."""
    from llmplug import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_num_seqs=max(len(prompts), 1), quantization=quantization, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    # warm-up: the same prompts for one token, so every measured row finds its kernels and memory as a
    # running server does (HF's prefill row is warmed the same way)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1), use_tqdm=False)
    times = []
    for _ in range(repeats):
        start = clock()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        times.append(clock() - start)
    elapsed = statistics.median(times)
    llm.shutdown()
    if output_len == 1:  # a prefill measure: the prompts' tokens are the work
        return sum(map(len, prompts)) / elapsed
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def load_tokenizer(model: str):
    """The transformers tokenizer of a model dir or of a .gguf file."""
    from transformers import AutoTokenizer

    if model.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(model), gguf_file=os.path.basename(model))
    return AutoTokenizer.from_pretrained(model)


def load_hf(model: str, dtype: str):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": getattr(torch, dtype)}
    if model.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(model), gguf_file=os.path.basename(model), **kwargs)
    return AutoModelForCausalLM.from_pretrained(model, **kwargs)


def bench_hf_generate(hf, prompts: list[list[int]], output_len: int, pad_id: int, clock=time.perf_counter) -> float:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    ids, mask = ids.to(hf.device), mask.to(hf.device)
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=pad_id)
    with torch.inference_mode():
        hf.generate(ids[:1, -8:], attention_mask=mask[:1, -8:], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        start = clock()
        out = hf.generate(ids, attention_mask=mask, **kw)
    elapsed = clock() - start
    return (out.shape[1] - width) * len(prompts) / elapsed


def bench_hf_generate_batch(hf, prompts: list[list[int]], output_len: int, pad_id: int, cb_config=None,
                            clock=time.perf_counter) -> float:
    """HF's continuous batching; `cb_config` (a ContinuousBatchingConfig) sizes its cache, else 90 % of free memory."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                           pad_token_id=pad_id, eos_token_id=None)
    with torch.inference_mode():
        start = clock()
        results = hf.generate_batch(
            inputs=prompts, generation_config=cfg, continuous_batching_config=cb_config, progress_bar=False
        )
    elapsed = clock() - start
    return sum(len(r.generated_tokens) for r in results.values()) / elapsed


def bench_hf_prefill(hf, prompts: list[list[int]], pad_id: int, clock=time.perf_counter, repeats: int = 1) -> float:
    """Prompt tokens/s of one padded forward over the batch (what `generate` does before its first token), the
    median of `repeats` forwards after a warm-up."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts]).to(hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]).to(hf.device)
    with torch.inference_mode():
        hf(ids, attention_mask=mask, logits_to_keep=1)  # warm-up: the same forward
        times = []
        for _ in range(repeats):
            start = clock()
            hf(ids, attention_mask=mask, logits_to_keep=1)
            times.append(clock() - start)
    return sum(map(len, prompts)) / statistics.median(times)


def load_llama_cpp(gguf: str):
    """llama.cpp (llama-cpp-python) on the same GGUF with torch's thread count; None without the peers extra."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    threads = torch.get_num_threads()
    return Llama(model_path=gguf, n_ctx=4096, n_batch=512, n_threads=threads, n_threads_batch=threads,
                 verbose=False)


def bench_llama_cpp(llm, prompts: list[list[int]], output_len: int, clock=time.perf_counter) -> float:
    """llama.cpp's output tokens/s generating each prompt in turn (greedy, EOS ignored); with output_len 1,
    its prompt tokens/s."""
    llm.reset()
    llm.eval(prompts[0][:8])  # warm-up
    start = clock()
    for prompt in prompts:
        llm.reset()
        if output_len == 1:
            llm.eval(prompt)
            continue
        for produced, _ in enumerate(llm.generate(prompt, temp=0.0, reset=True), start=1):
            if produced == output_len:
                break
    elapsed = clock() - start
    return sum(map(len, prompts)) / elapsed if output_len == 1 else output_len * len(prompts) / elapsed


def report(rows: dict[str, float], ratios: dict[str, float], args: argparse.Namespace) -> None:
    """Print the ratios; write the arguments, throughputs and ratios to `args.json` when given."""
    for name, r in ratios.items():
        print(f"{name:40s} {r:6.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tok_per_s": rows, "ratios": ratios}, f, indent=2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model dir or .gguf; default: the embedded SmolLM2")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefill-repeats", type=int, default=5,
                    help="time each prefill row (llmplug's and HF's) as the median of this many calls")
    ap.add_argument("--skip-hf-batch", action="store_true", help="skip HF generate_batch (continuous batching)")
    ap.add_argument("--compile", action="store_true", help="also time llmplug with device.compile (torch.compile)")
    ap.add_argument("--cpu-clock", action="store_true",
                    help="time every row in CPU seconds of this process (steadier on a shared machine)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    from llmplug.core.config import DEFAULT_MODEL
    from llmplug.loaders.default_model import resolve_model_path

    model = resolve_model_path(args.model or DEFAULT_MODEL)
    hf = load_hf(model, args.dtype).eval()
    tok = load_tokenizer(model)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    batch = make_prompts(tok, args.num_prompts)
    single = batch[:1]

    print(f"model={model} prompts={args.num_prompts} output_len={args.output_len} dtype={args.dtype} "
          f"threads={torch.get_num_threads()}", flush=True)
    rows = {}

    def record(name: str, tps: float) -> None:
        rows[name] = tps
        print(f"{name:28s} {tps:8.1f} tok/s", flush=True)  # as it goes: a later hang loses nothing

    clock = time.process_time if args.cpu_clock else time.perf_counter
    variants = {"llmplug": {}, "llmplug int8": {"quantization": "int8"}}
    if model.endswith(".gguf"):  # the default decodes the GGUF's own 4-bit blocks: dense beside it
        variants["llmplug dense"] = {"quantization": "none"}
    variants |= {"llmplug compiled": {"device.compile": True}} if args.compile else {}
    for name, engine in variants.items():
        engine = {**engine, "enable_prefix_caching": False, "clock": clock}  # the aims are stated cache off
        # prefill: prompt tokens per second of a step that only prefills (one output token each)
        record(f"{name} prefill", bench_llmplug(model, batch, 1, args.dtype, repeats=args.prefill_repeats, **engine))
        record(f"{name} batch", bench_llmplug(model, batch, args.output_len, args.dtype, **engine))
        record(f"{name} single", bench_llmplug(model, single, args.output_len, args.dtype, **engine))
    llama_cpp = load_llama_cpp(model) if model.endswith(".gguf") else None
    if llama_cpp is not None:
        record("llama.cpp prefill", bench_llama_cpp(llama_cpp, batch, 1, clock=clock))
        record("llama.cpp single", bench_llama_cpp(llama_cpp, single, args.output_len, clock=clock))
        del llama_cpp
    record("hf prefill", bench_hf_prefill(hf, batch, pad_id, clock=clock, repeats=args.prefill_repeats))
    record("hf generate batch", bench_hf_generate(hf, batch, args.output_len, pad_id, clock=clock))
    record("hf generate single", bench_hf_generate(hf, single, args.output_len, pad_id, clock=clock))
    if not args.skip_hf_batch:
        record("hf generate_batch batch", bench_hf_generate_batch(hf, batch, args.output_len, pad_id, clock=clock))

    ratios = {
        "batch: llmplug / hf generate": rows["llmplug batch"] / rows["hf generate batch"],
        "single: llmplug / hf generate": rows["llmplug single"] / rows["hf generate single"],
        "prefill: llmplug / hf": rows["llmplug prefill"] / rows["hf prefill"],
    }
    for kind, hf_row in (("batch", "hf generate batch"), ("single", "hf generate single"), ("prefill", "hf prefill")):
        ratios[f"{kind} int8: llmplug / hf"] = rows[f"llmplug int8 {kind}"] / rows[hf_row]
    if "llama.cpp single" in rows:
        ratios["single int8: llmplug / llama.cpp"] = rows["llmplug int8 single"] / rows["llama.cpp single"]
        ratios["prefill int8: llmplug / llama.cpp"] = rows["llmplug int8 prefill"] / rows["llama.cpp prefill"]
        ratios["single: llmplug / llama.cpp"] = rows["llmplug single"] / rows["llama.cpp single"]
        if "llmplug dense single" in rows:
            ratios["single dense: llmplug / llama.cpp"] = rows["llmplug dense single"] / rows["llama.cpp single"]
        ratios["prefill: llmplug / llama.cpp"] = rows["llmplug prefill"] / rows["llama.cpp prefill"]
    if args.compile:
        for kind in ("prefill", "batch", "single"):
            ratios[f"{kind}: compiled / eager"] = rows[f"llmplug compiled {kind}"] / rows[f"llmplug {kind}"]
    if "hf generate_batch batch" in rows:
        ratios["batch: llmplug / hf generate_batch"] = rows["llmplug batch"] / rows["hf generate_batch batch"]
    report(rows, ratios, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
