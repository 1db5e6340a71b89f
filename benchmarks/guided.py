"""Guided decoding: grammar compile time and per-step overhead of each backend, at batch 1 and 32, in one run.

    python benchmarks/guided.py                          # the embedded default model's tokenizer (SmolLM2)
    python benchmarks/guided.py --batch 1 32 --json out.json

For each installed backend of `llmplug.guided_decoding`: the time to build its tokenizer data (once
per engine), to compile a JSON schema and a regex (cold: a fresh backend, no cache), and the per-step
overhead of guided decoding over a fixed valid JSON answer: filling the bitmask rows, applying the
batch's bitmask to [batch, vocab] float32 logits in the sampler, and advancing every matcher by its
token. An unconstrained batch pays none of it. All backends run in the same process, one after another.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads()  # before torch is imported, as the engine does

import torch  # noqa: E402

from llmplug.core.config import LoadConfig, ModelConfig  # noqa: E402
from llmplug.core.params import GuidedDecodingParams  # noqa: E402
from llmplug.core.plugins import get_registry  # noqa: E402
from llmplug.engine.guided_decoding import AUTO_ORDER, GROUP  # noqa: E402
from llmplug.engine.sampler import apply_token_bitmask  # noqa: E402
from llmplug.loaders import resolve_load_format  # noqa: E402
from llmplug.loaders.default_model import resolve_model_path  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "languages", "active"],
    "additionalProperties": False,
}
ANSWER = '{"name":"Ada Lovelace","age":36,"languages":["English","French"],"active":true}'
REGEX = r"[A-Z][a-z]+ [A-Z][a-z]+, born (18|19)[0-9]{2}"


def seconds(fn: Callable[[], Any]) -> tuple[Any, float]:
    """fn's result and how long it took."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def step_overhead_ms(compiled: Any, tokens: list[int], batch: int, vocab_size: int) -> dict[str, float]:
    """Mean per-step milliseconds of filling, applying and accepting for `batch` matchers along `tokens`."""
    matchers = [compiled.matcher() for _ in range(batch)]
    bitmask = torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    logits = torch.randn(batch, vocab_size)
    fill = apply = accept = 0.0
    for token in tokens:
        _, t = seconds(lambda: [m.fill_bitmask(bitmask, row) for row, m in enumerate(matchers)])
        fill += t
        _, t = seconds(lambda: apply_token_bitmask(logits, bitmask))
        apply += t
        _, t = seconds(lambda: [m.accept_token(token) for m in matchers])
        accept += t
    n = len(tokens) / 1000
    return {"fill_ms": fill / n, "apply_ms": apply / n, "accept_ms": accept / n, "total_ms": (fill + apply + accept) / n}


def bench_backend(name: str, tokenizer: Any, vocab_size: int, eos: int, batches: list[int]) -> dict[str, Any]:
    """Every measurement of one backend."""
    backend = get_registry().load(GROUP, name)(tokenizer, vocab_size, eos)
    _, data_s = seconds(lambda: backend.tokenizer_data)
    schema = GuidedDecodingParams(json=SCHEMA, whitespace_flexible=False)
    compiled, schema_s = seconds(lambda: backend.compile(schema))
    _, regex_s = seconds(lambda: backend.compile(GuidedDecodingParams(regex=REGEX, whitespace_flexible=False)))
    tokens = tokenizer.encode(ANSWER, add_special_tokens=False) + [eos]
    steps = {batch: step_overhead_ms(compiled, tokens, batch, vocab_size) for batch in batches}
    return {"tokenizer_data_s": data_s, "compile_schema_ms": schema_s * 1000, "compile_regex_ms": regex_s * 1000,
            "num_steps": len(tokens), "steps": steps}


def report(results: dict[str, dict[str, Any]], batches: list[int]) -> str:
    """A markdown table of the results."""
    head = "| backend | tokenizer data (s) | compile schema (ms) | compile regex (ms) | " + " | ".join(
        f"step overhead, batch {b} (ms: fill + apply + accept = total)" for b in batches) + " |"
    lines = [head, "|" + "---|" * (4 + len(batches))]
    for name, r in results.items():
        cells = [f"{s['fill_ms']:.3f} + {s['apply_ms']:.3f} + {s['accept_ms']:.3f} = **{s['total_ms']:.2f}**"
                 for s in (r["steps"][b] for b in batches)]
        lines.append(f"| {name} | {r['tokenizer_data_s']:.2f} | {r['compile_schema_ms']:.1f} | "
                     f"{r['compile_regex_ms']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_tokenizer(name: str) -> tuple[Any, int]:
    """The model's own tokenizer and the width of its logits, as the engine loads them."""
    model_config = ModelConfig(model=resolve_model_path(name))
    loader = get_registry().load("llmplug.loaders", resolve_load_format(model_config.model, "auto"))(LoadConfig())
    return loader.load_tokenizer(model_config), loader.load_hf_config(model_config).vocab_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="model whose tokenizer is used")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--backends", nargs="+", default=None, help="default: every installed one")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    tokenizer, vocab_size = load_tokenizer(args.model)
    names = args.backends or [n for n in AUTO_ORDER if n in get_registry().names(GROUP)]
    results = {name: bench_backend(name, tokenizer, vocab_size, tokenizer.eos_token_id, args.batch) for name in names}
    print(f"model {args.model}, vocabulary {vocab_size}, {results[names[0]]['num_steps']} steps, "
          f"torch threads {torch.get_num_threads()}")
    print(report(results, args.batch))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
