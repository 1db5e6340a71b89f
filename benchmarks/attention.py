"""Decode-step time of a SmolLM2-135M-shaped model (random bf16 weights) through the paged cache.

    python benchmarks/attention.py                          # batch 1 and 32, 256 tokens of context
    python benchmarks/attention.py --context 2048 --window 256 --batch 1 8

Prefills `batch` random prompts of `context` tokens, then times `steps` decode steps of the whole
batch (metadata build + model forward, as the model runner does) and, separately, the attention calls
alone (every layer's `Attention` in further decode steps). `--window W` gives every layer a sliding window
of W tokens (the model is SmolLM2's shape as a Mistral config, the same generic decoder as Llama). Prints the median milliseconds per step, wall clock and CPU time of the process: on a
shared machine, CPU time with one thread (OMP_NUM_THREADS=1) is the steadier measure, since it does not
count the time the process waits for a core. To compare two checkouts, run the script from each in
turn (`PYTHONPATH=<other checkout> python benchmarks/attention.py`) and compare ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads()  # before torch is imported

import torch  # noqa: E402
from transformers import MistralConfig  # noqa: E402

import llmplug  # noqa: E402
from llmplug.layers.attention import attention_layers, bind_kv_cache  # noqa: E402
from llmplug.layers.attention.torch_sdpa import TorchSDPABackend  # noqa: E402
from llmplug.layers.forward_context import CommonAttentionMetadata, forward_context  # noqa: E402
from llmplug.layers.quantization import LinearOptions, process_weights_after_loading  # noqa: E402
from llmplug.plugins.models.llama import MistralForCausalLM  # noqa: E402

BLOCK = 16
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)


def build_model(window: int | None) -> torch.nn.Module:
    """The model with random weights: SmolLM2's shape as a Mistral config, so that it may have a window."""
    torch.set_default_dtype(torch.bfloat16)
    model = MistralForCausalLM(config=MistralConfig(**SMOLLM2, sliding_window=window)).eval()
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    process_weights_after_loading(model, LinearOptions(int4=False))  # oneDNN-packed bf16, as the loader does
    return model


def metadata(seq_lens: list[int], num_new: list[int], tables: list[list[int]]) -> CommonAttentionMetadata:
    """One step computing the last num_new[i] of seq_lens[i] tokens of each request."""
    starts = [s - n for s, n in zip(seq_lens, num_new)]
    slots = [t[p // BLOCK] * BLOCK + p % BLOCK for t, a, s in zip(tables, starts, seq_lens) for p in range(a, s)]
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.cumsum(torch.tensor(num_new), 0).tolist()]),
        seq_lens=torch.tensor(seq_lens), num_computed_tokens=torch.tensor(starts),
        block_tables=torch.tensor(tables), slot_mapping=torch.tensor(slots),
        positions=torch.tensor([p for a, s in zip(starts, seq_lens) for p in range(a, s)]),
        block_size=BLOCK, num_reqs=len(seq_lens), num_tokens=sum(num_new), max_query_len=max(num_new),
        max_seq_len=max(seq_lens), query_lens_list=tuple(num_new), seq_lens_list=tuple(seq_lens),
    )


class Timer:
    """Wall-clock and process CPU seconds of the timed blocks."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def __enter__(self) -> None:
        self._start = (time.perf_counter(), time.process_time())

    def __exit__(self, *exc) -> None:
        self.wall.append(time.perf_counter() - self._start[0])
        self.cpu.append(time.process_time() - self._start[1])

    def median_ms(self) -> tuple[float, float]:
        """(wall, CPU) median milliseconds, the first two (warm-up) blocks left out."""
        return 1e3 * statistics.median(self.wall[2:]), 1e3 * statistics.median(self.cpu[2:])


def bench(model: torch.nn.Module, batch: int, context: int, steps: int) -> tuple[Timer, Timer]:
    """Timings of whole decode steps and of the attention calls alone."""
    blocks_per_req = -(-(context + 2 * steps + 8) // BLOCK)
    layers = attention_layers(model)
    # an engine's cache holds far more than one batch: 8x leaves the decode mirror room (decode_mirror.py)
    num_blocks = 8 * batch * blocks_per_req
    shape = TorchSDPABackend.kv_cache_shape(num_blocks, BLOCK, layers[0].num_kv_heads, layers[0].head_dim)
    bind_kv_cache(model, [torch.zeros(shape, dtype=torch.bfloat16) for _ in layers], TorchSDPABackend)
    tables = [list(range(r * blocks_per_req, (r + 1) * blocks_per_req)) for r in range(batch)]
    ids = torch.randint(0, SMOLLM2["vocab_size"], (batch * context,))
    heads, kv_heads, d = layers[0].num_heads, layers[0].num_kv_heads, layers[0].head_dim
    whole, attention = Timer(), Timer()
    with torch.inference_mode():
        common = metadata([context] * batch, [context] * batch, tables)
        with forward_context(TorchSDPABackend.build_metadata(common)):
            model(ids, common.positions)
        for seq in range(context + 1, context + 1 + steps):
            with whole:
                common = metadata([seq] * batch, [1] * batch, tables)
                with forward_context(TorchSDPABackend.build_metadata(common)):
                    model(ids[:batch], common.positions)
        # the following steps run the attention layers alone, on the q, k, v of a fused projection
        for seq in range(context + 1 + steps, context + 1 + 2 * steps):
            qkv = torch.randn(batch, (heads + 2 * kv_heads) * d, dtype=torch.bfloat16)
            q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
            with attention:
                common = metadata([seq] * batch, [1] * batch, tables)
                with forward_context(TorchSDPABackend.build_metadata(common)):
                    for layer in layers:
                        layer(q, k, v)
    return whole, attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    model = build_model(args.window)
    print(f"llmplug from {llmplug.__file__}; threads {torch.get_num_threads()}; window {args.window}")
    for batch in args.batch:
        whole, attention = bench(model, batch, args.context, args.steps)
        (step_wall, step_cpu), (attn_wall, attn_cpu) = whole.median_ms(), attention.median_ms()
        print(f"batch {batch:3d} context {args.context}: decode step {step_wall:7.2f} ms (cpu {step_cpu:7.2f}), "
              f"attention {attn_wall:6.2f} ms (cpu {attn_cpu:6.2f})")


if __name__ == "__main__":
    main()
