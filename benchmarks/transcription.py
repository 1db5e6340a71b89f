"""Transcription speed: llmplug vs transformers' ASR pipeline on the same Whisper checkpoint and clips, in one run.

    python benchmarks/transcription.py                  # whisper-tiny's shape, 16 clips of 5-30 s, 64 tokens each
    python benchmarks/transcription.py --size base --repeats 3

The checkpoint is random but of a real Whisper's shape (`--size`: tiny or base; 80 mel bins, 1500 encoder states,
a 51,865-token vocabulary: a byte-level BPE with Whisper's special tokens, padded with added tokens), float32.
16 clips of tones and noise, 5 to 30 s (`--clips`), are transcribed at once: transformers' `pipeline(
"automatic-speech-recognition", batch_size=16)` (its feature extractor, one padded `generate` per batch) against
one `LLM.generate` call of 16 encoder-decoder prompts. Both generate exactly `--tokens` tokens per clip (min and max
new tokens; llmplug: `ignore_eos`), greedy, so the work is the same whatever the random weights say. Timed calls
alternate between the engines after one warm-up each; same threads.

Reports the median wall and CPU seconds and the real-time factor (wall seconds per second of audio; below 1 is
faster than real time) of each, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads()  # before torch is imported: same thread settings for both engines

import numpy as np  # noqa: E402
import torch  # noqa: E402

RATE = 16000
VOCAB = 51865  # whisper tiny ... large-v2's
SIZES = {"tiny": (384, 4, 6, 1536), "base": (512, 6, 8, 2048)}  # d_model, layers (each side), heads, ffn
SPECIAL = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|translate|>", "<|notimestamps|>"]
DECODER_PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


def build_tokenizer():
    """A byte-level BPE with Whisper's special tokens, padded with added tokens to Whisper's vocabulary size."""
    from llmplug.testing.whisper import tiny_whisper_tokenizer

    tokenizer = tiny_whisper_tokenizer(SPECIAL)
    tokenizer.add_tokens([f"<|w{i}|>" for i in range(VOCAB - len(tokenizer))])
    return tokenizer


def build_checkpoint(path: Path, size: str) -> None:
    """A random Whisper of `size`'s shape with its processor, saved in `path`."""
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration, WhisperProcessor

    tokenizer = build_tokenizer()
    d_model, layers, heads, ffn = SIZES[size]
    eot, sot = tokenizer.convert_tokens_to_ids(SPECIAL[:2])
    config = WhisperConfig(vocab_size=len(tokenizer), d_model=d_model, encoder_layers=layers, decoder_layers=layers,
                           encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                           decoder_ffn_dim=ffn, eos_token_id=eot, bos_token_id=eot, pad_token_id=eot,
                           decoder_start_token_id=sot, suppress_tokens=None, begin_suppress_tokens=None)
    torch.manual_seed(0)
    WhisperForConditionalGeneration(config).eval().save_pretrained(path)
    WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=tokenizer).save_pretrained(path)


def clips(n: int, seed: int) -> list[np.ndarray]:
    """`n` clips of 5 to 30 s, tones and noise, different for every seed."""
    rng = np.random.default_rng(seed)
    out = []
    for i, seconds in enumerate(np.linspace(5.0, 30.0, n)):
        t = np.arange(int(seconds * RATE)) / RATE
        tone = 0.4 * np.sin(2 * np.pi * rng.uniform(100, 1000) * t)
        out.append((tone if i % 2 else rng.uniform(-0.3, 0.3, t.size)).astype(np.float32))
    return out


def timed(fns: dict[str, Callable[[int], None]], repeats: int) -> dict[str, dict[str, float]]:
    """Each fn's median wall and CPU seconds over `repeats` calls (after one warm-up), alternating between the fns;
    a fn takes the call's seed."""
    seeds = iter(range(1, 10_000))
    for fn in fns.values():
        fn(next(seeds))
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            seed = next(seeds)
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            fn(seed)
            wall[name].append(time.perf_counter() - start_wall)
            cpu[name].append(time.process_time() - start_cpu)
    return {name: {"wall_s": statistics.median(wall[name]), "cpu_s": statistics.median(cpu[name])} for name in fns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--clips", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from transformers import WhisperForConditionalGeneration, WhisperProcessor, pipeline

    from llmplug import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder)
        build_checkpoint(path, args.size)
        processor = WhisperProcessor.from_pretrained(path)
        hf = WhisperForConditionalGeneration.from_pretrained(path).eval()
        asr = pipeline("automatic-speech-recognition", model=hf, tokenizer=processor.tokenizer,
                       feature_extractor=processor.feature_extractor, device="cpu")
        # greedy: the pipeline otherwise runs a beam search for Whisper
        kwargs = {"max_new_tokens": args.tokens, "min_new_tokens": args.tokens, "num_beams": 1, "do_sample": False}
        llm = LLM(str(path), dtype="float32", max_num_seqs=args.clips)
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

        def transformers_pipeline(seed: int) -> None:
            with torch.inference_mode():
                asr(clips(args.clips, seed), batch_size=args.clips, generate_kwargs=kwargs)

        def llmplug_engine(seed: int) -> None:
            prompts = [{"prompt": DECODER_PROMPT, "multi_modal_data": {"audio": (clip, RATE)}}
                       for clip in clips(args.clips, seed)]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == args.tokens for o in outputs)

        results = timed({"transformers": transformers_pipeline, "llmplug": llmplug_engine}, args.repeats)
        audio_seconds = sum(len(c) for c in clips(args.clips, 0)) / RATE
        for result in results.values():
            result["rtf"] = result["wall_s"] / audio_seconds
        report = {"size": args.size, "clips": args.clips, "audio_s": round(audio_seconds, 1), "tokens": args.tokens,
                  "threads": torch.get_num_threads(), **results,
                  "speedup": results["transformers"]["wall_s"] / results["llmplug"]["wall_s"],
                  "cpu_ratio": results["llmplug"]["cpu_s"] / results["transformers"]["cpu_s"]}
        print(json.dumps(report, indent=2))
        llm.shutdown()


if __name__ == "__main__":
    main()
