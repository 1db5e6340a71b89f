"""Embedding throughput: llmplug's `LLM.embed` vs sentence-transformers' `encode` on the same model and
sentences, in one run.

    python benchmarks/embed.py                          # the embedded all-MiniLM-L6-v2, 64 sentences
    python benchmarks/embed.py --num-sentences 256 --repeats 5

Both engines get the same sentences (texts in, normalized float32 vectors out, tokenization included),
the same torch thread count and a warm-up call; their timed calls alternate. Reports sentences/s of each and the ratio, and the
lowest cosine similarity between the two engines' vectors.
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


def sentences(n: int) -> list[str]:
    """`n` different sentences of realistic, varied lengths."""
    return [f"{PROMPTS[i % len(PROMPTS)]} (variant {i})" for i in range(n)]


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, object]]:
    """Each fn's median wall time over `repeats` calls (after one warm-up each) and its last result; the
    calls alternate between the fns, so a busy spell on a shared machine slows both alike."""
    results = {name: fn() for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(times[name]), results[name]) for name in fns}


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

    texts = sentences(args.num_sentences)
    path = resolve_model_path(args.model)
    llm = LLM(path, dtype="float32")
    st = SentenceTransformer(path, device="cpu")
    with torch.inference_mode():  # sentence-transformers' encode runs under it too
        timings = interleaved({
            "llmplug": lambda: llm.embed(texts, use_tqdm=False),
            "sentence_transformers": lambda: st.encode(texts, batch_size=args.batch_size, convert_to_numpy=True),
        }, args.repeats)
    llm.shutdown()
    (llmplug_s, ours), (st_s, theirs) = timings["llmplug"], timings["sentence_transformers"]
    ours = np.array([out.outputs.embedding for out in ours])
    cosine = float(((ours * theirs).sum(-1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(theirs, axis=-1))).min())
    result = {
        "model": args.model,
        "sentences": args.num_sentences,
        "threads": torch.get_num_threads(),
        "llmplug_sentences_per_s": round(args.num_sentences / llmplug_s, 1),
        "sentence_transformers_sentences_per_s": round(args.num_sentences / st_s, 1),
        "ratio_llmplug_over_sentence_transformers": round(st_s / llmplug_s, 2),
        "min_cosine": round(cosine, 6),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
