"""Image prefill: llmplug vs transformers on the same vision-language checkpoint, pictures and prompts, in one run.

    python benchmarks/multimodal.py                 # LLaVA 1.5 layout: CLIP ViT-B/16 at 224 px, SmolLM2-135M's decoder
    python benchmarks/multimodal.py --batch 16 --repeats 5

The checkpoint is random but of realistic size: a CLIP ViT-B/16 tower (12 layers, 768 wide, 196 image tokens per
picture), LLaVA's two-layer projector and SmolLM2-135M's decoder shape (30 layers, 576 wide) with its tokenizer
(from the embedded GGUF), all float32. Every call gets pictures never seen before (a new seed per call), so
neither engine's caches help. Two measures, their timed calls alternating between the engines:

- time to first token of one request (a picture and a question, one generated token);
- prefill throughput of a batch: `--batch` requests, each with its own picture, one generated token each
  (transformers: one padded `generate` call; llmplug: one `LLM.generate` call), in prompt tokens per second.

Reports the median wall and CPU time of each and the ratios.
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
from PIL import Image  # noqa: E402

QUESTION = "USER: <image>\nWhat is in this picture? ASSISTANT:"


def build_checkpoint(path: Path) -> None:
    """A random LLaVA 1.5 checkpoint of realistic shape, with its processor, saved in `path`."""
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    from llmplug.loaders.default_model import resolve_model_path

    gguf = Path(resolve_model_path("SmolLM2-135M-Instruct"))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    vision = CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              image_size=224, patch_size=16, projection_dim=512)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                       tie_word_embeddings=True)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    LlavaForConditionalGeneration(config).eval().save_pretrained(path)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=16,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1).save_pretrained(path)


def pictures(n: int, seed: int) -> list[Image.Image]:
    """`n` pictures of 320x240 random blocks, different for every seed."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, 12, 16, 3), dtype=np.uint8)
    return [Image.fromarray(b).resize((320, 240), Image.NEAREST) for b in blocks]


def timed(fns: dict[str, Callable[[int], int]], repeats: int) -> dict[str, dict[str, float]]:
    """Each fn's median wall and CPU seconds over `repeats` calls (after one warm-up), alternating between the fns;
    a fn takes the call's seed and returns the prompt tokens it ran."""
    seeds = iter(range(1, 10_000))
    for fn in fns.values():
        fn(next(seeds))
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    tokens: dict[str, int] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            tokens[name] = fn(next(seeds))
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return {name: {"wall_s": statistics.median(wall[name]), "cpu_s": statistics.median(cpu[name]),
                   "prompt_tokens": tokens[name]} for name in fns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="requests (pictures) in the throughput batch")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from llmplug import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder)
        build_checkpoint(path)
        processor = AutoProcessor.from_pretrained(path)
        processor.tokenizer.padding_side = "left"
        hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        llm = LLM(str(path), dtype="float32", max_model_len=1024, max_num_batched_tokens=4096)
        params = SamplingParams(temperature=0.0, max_tokens=1)

        def run_hf(n: int) -> Callable[[int], int]:
            def call(seed: int) -> int:
                inputs = processor(text=[QUESTION] * n, images=pictures(n, seed), return_tensors="pt", padding=True)
                with torch.inference_mode():
                    hf.generate(**inputs, max_new_tokens=1, do_sample=False)
                return int(inputs["attention_mask"].sum())
            return call

        def run_llmplug(n: int) -> Callable[[int], int]:
            def call(seed: int) -> int:
                requests = [{"prompt": QUESTION, "multi_modal_data": {"image": image}} for image in pictures(n, seed)]
                outputs = llm.generate(requests, params, use_tqdm=False)
                return sum(len(out.prompt_token_ids) for out in outputs)
            return call

        ttft = timed({"transformers": run_hf(1), "llmplug": run_llmplug(1)}, args.repeats)
        batch = timed({"transformers": run_hf(args.batch), "llmplug": run_llmplug(args.batch)}, args.repeats)
        llm.shutdown()
    for result in batch.values():
        result["prompt_tok_per_s"] = result["prompt_tokens"] / result["wall_s"]
    print(json.dumps({
        "threads": torch.get_num_threads(),
        "ttft": ttft | {"speedup": ttft["transformers"]["wall_s"] / ttft["llmplug"]["wall_s"]},
        "batch": batch | {"batch": args.batch,
                          "speedup": batch["llmplug"]["prompt_tok_per_s"] / batch["transformers"]["prompt_tok_per_s"]},
    }, indent=2))


if __name__ == "__main__":
    main()
