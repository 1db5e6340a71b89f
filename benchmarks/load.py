"""Model loading: load time of the same model with every weight loader, in one run.

    python benchmarks/load.py                      # the embedded SmolLM2-135M, bf16, 3 loads per loader
    python benchmarks/load.py --model DIR --repeats 5 --json out.json

The model (default: the embedded GGUF, converted once to a safetensors checkpoint in a temporary
directory) is written in each loader's format first — `llmplug tensorize` for tensorizer — and then
loaded with `load_model` (build the model, read and place every weight, post-process), timed per
loader. `dummy` reads nothing and `bitsandbytes` also quantizes (nf4), so they time other work than the
readers; `bitsandbytes_prequantized` reads the same model saved nf4-quantized by transformers; `gguf`
reads the original Q4_1 file (dequantizing it), so it runs only with the default model.
Loaders that need another setup (sharded_state) are listed as skipped when they are not registered.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads()  # before torch is imported

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from llmplug.core.config import DEFAULT_MODEL, EngineConfig, LoadConfig, ModelConfig  # noqa: E402
from llmplug.core.plugins import get_registry  # noqa: E402
from llmplug.loaders.default_model import resolve_model_path  # noqa: E402
from llmplug.loaders.tensorizer import tensorize_model  # noqa: E402

# (row label, load.format, extra LoadConfig fields)
LOADERS = [
    ("default", "default", {}),
    ("dummy", "dummy", {}),
    ("gguf", "gguf", {}),
    ("runai_streamer", "runai_streamer", {}),
    ("tensorizer", "tensorizer", {}),
    ("bitsandbytes", "bitsandbytes", {"bnb_quant_type": "nf4"}),
    ("bitsandbytes_prequantized", "bitsandbytes", {}),
    ("sharded_state", "sharded_state", {}),
]


def engine_config(model: str, fmt: str, dtype: str, **load_fields) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=model, dtype=dtype), load=LoadConfig(format=fmt, **load_fields))


def gguf_to_safetensors(gguf_file: str, out: Path, dtype: str) -> Path:
    """The GGUF model as an HF safetensors checkpoint (config.json + model.safetensors) in `out`."""
    config = engine_config(gguf_file, "gguf", dtype)
    loader = get_registry().load("llmplug.loaders", "gguf")(config.load)
    loader.load_hf_config(config.model).save_pretrained(out)
    tensors = {name: tensor.contiguous() for name, tensor in loader.iter_weights(config.model)}
    save_file(tensors, str(out / "model.safetensors"))
    return out


def save_bnb_quantized(checkpoint: str, out: Path, dtype: str) -> Path:
    """`checkpoint` quantized to nf4 by transformers with bitsandbytes and saved, as users get such files."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch_dtype = getattr(torch, dtype)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch_dtype)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=config, dtype=torch_dtype)
    model.save_pretrained(out)
    return out


def time_loads(model: str, fmt: str, dtype: str, repeats: int, **load_fields) -> list[float]:
    """Seconds of `repeats` complete loads with loader `fmt`."""
    config = engine_config(model, fmt, dtype, **load_fields)
    loader_cls = get_registry().load("llmplug.loaders", fmt)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model_obj = loader_cls(config.load).load_model(config)
        times.append(time.perf_counter() - start)
        del model_obj
    return times


def prepare(args: argparse.Namespace, work: Path) -> dict[str, str]:
    """The model path each row reads (absent: the row is skipped)."""
    source = resolve_model_path(args.model)
    is_gguf = source.endswith(".gguf")
    checkpoint = str(gguf_to_safetensors(source, work / "hf", args.dtype)) if is_gguf else source
    tensorized = work / "tensorized"
    tensorize_model(engine_config(checkpoint, "default", args.dtype), tensorized)
    paths = {label: checkpoint for label, _, _ in LOADERS}
    paths["tensorizer"] = str(tensorized)
    paths["bitsandbytes_prequantized"] = str(save_bnb_quantized(checkpoint, work / "bnb", args.dtype))
    paths["sharded_state"] = save_sharded(checkpoint, work / "sharded", args.dtype)
    if is_gguf:
        paths["gguf"] = source
    else:
        del paths["gguf"]
    return paths


def save_sharded(checkpoint: str, out: Path, dtype: str) -> str:
    """The checkpoint saved by `llmplug save-sharded` (one rank: TP=1), for the sharded_state row."""
    command = [sys.executable, "-m", "llmplug.entrypoints.cli", "save-sharded", checkpoint, str(out), "--dtype", dtype,
               "--skip-tokenizer-init"]
    subprocess.run(command, check=True, capture_output=True)
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="HF safetensors directory or .gguf (default: embedded)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="FILE", help="Also write the results as JSON.")
    args = parser.parse_args()
    registered = set(get_registry().names("llmplug.loaders"))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = prepare(args, Path(tmp))
        for label, fmt, fields in LOADERS:
            if fmt not in registered or label not in paths:
                print(f"{label:>25}: skipped ({'not registered' if fmt not in registered else 'no such file'})")
                continue
            times = time_loads(paths[label], fmt, args.dtype, args.repeats, **fields)
            median = statistics.median(times)
            results[label] = {"median_s": median, "min_s": min(times), "times_s": times}
            print(f"{label:>25}: median {median:.2f} s, min {min(times):.2f} s over {len(times)} loads")
    default = results.get("default", {}).get("median_s")
    if default:
        for label, row in results.items():
            print(f"{label:>25}: {row['median_s'] / default:.2f}x the default loader's time")
    if args.json:
        report = {"dtype": args.dtype, "torch": torch.__version__, "results": results}
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
