"""Embedding throughput: llmplug's `LLM.embed` vs sentence-transformers' `encode` on the same model and
sentences, in one run.

    python benchmarks/embed.py                          # the embedded all-MiniLM-L6-v2, 64 sentences
    python benchmarks/embed.py --num-sentences 256 --repeats 5

Two workloads: `similar` (the chat prompts, 13-20 tokens each) and `varied` (4 to 64 words, as a
corpus of mixed sentences and passages). Both engines get the same sentences (texts in, normalized
float32 vectors out, tokenization included), the same torch thread count and a warm-up call; their
timed calls alternate. Reports sentences/s of each and the ratio, the CPU time of each
call (steadier than wall time on a busy machine) and the lowest cosine similarity between the two
engines' vectors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads()  # before torch is imported: same thread settings for both engines

import numpy as np  # noqa: E402
import torch  # noqa: E402

from prompts import PROMPTS  # noqa: E402 - benchmarks/ is on sys.path when a script runs


def sentences(n: int, workload: str) -> list[str]:
    """`n` different sentences: the chat prompts (similar lengths) or 4 to 64 words of them (varied)."""
    if workload == "similar":
        return [f"{PROMPTS[i % len(PROMPTS)]} (variant {i})" for i in range(n)]
    words = " ".join(PROMPTS).split()
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(4 + (i * 37) % 61)) for i in range(n)]


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, float, object]]:
    """Each fn's median wall time and median CPU time (this process, all threads) over `repeats` calls, after
    one warm-up each, and its last result. The calls alternate between the fns, so a busy spell on a shared
    machine slows both alike; CPU time does not count waiting for a core."""
    results = {name: fn() for name, fn in fns.items()}
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            results[name] = fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name]), results[name]) for name in fns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-MiniLM-L6-v2", help="sentence-transformers folder or short name")
    parser.add_argument("--num-sentences", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="sentence-transformers' batch size")
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    from llmplug import LLM
    from llmplug.loaders.default_model import resolve_model_path

    path = resolve_model_path(args.model)
    llm = LLM(path, dtype="float32")
    st = SentenceTransformer(path, device="cpu")
    results = [compare(llm, st, sentences(args.num_sentences, workload), args) | {"workload": workload}
               for workload in ("similar", "varied")]
    llm.shutdown()
    print(json.dumps({"model": args.model, "sentences": args.num_sentences, "threads": torch.get_num_threads(),
                      "results": results}, indent=2))


def compare(llm, st, texts: list[str], args: argparse.Namespace) -> dict:
    """Both engines on `texts`: sentences/s, the ratio and the lowest cosine similarity of their vectors."""
    with torch.inference_mode():  # sentence-transformers' encode runs under it too
        timings = interleaved({
            "llmplug": lambda: llm.embed(texts, use_tqdm=False),
            "sentence_transformers": lambda: st.encode(texts, batch_size=args.batch_size, convert_to_numpy=True),
        }, args.repeats)
    (llmplug_s, llmplug_cpu, ours), (st_s, st_cpu, theirs) = timings["llmplug"], timings["sentence_transformers"]
    ours = np.array([out.outputs.embedding for out in ours])
    cosine = float(((ours * theirs).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(theirs, axis=-1))).min())
    lengths = [len(ids) for ids in st.tokenizer(texts)["input_ids"]]
    return {
        "tokens": sum(lengths),
        "padded_tokens": len(texts) * max(lengths),  # what one padded batch computes
        "llmplug_sentences_per_s": round(len(texts) / llmplug_s, 1),
        "sentence_transformers_sentences_per_s": round(len(texts) / st_s, 1),
        "ratio_llmplug_over_sentence_transformers": round(st_s / llmplug_s, 2),
        "cpu_s_llmplug": round(llmplug_cpu, 3),
        "cpu_s_sentence_transformers": round(st_cpu, 3),
        "cpu_ratio_sentence_transformers_over_llmplug": round(st_cpu / llmplug_cpu, 2),
        "min_cosine": round(cosine, 6),
    }


if __name__ == "__main__":
    main()
