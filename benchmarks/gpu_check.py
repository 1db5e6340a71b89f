"""One-shot GPU check: llmplug's Triton kernels and `triton` attention backend on a real GPU, in one go.

    python benchmarks/gpu_check.py                  # on a machine with one CUDA or ROCm GPU (aims at < 10 min)
    python benchmarks/gpu_check.py --json out.json  # also write every result
    python benchmarks/gpu_check.py --cpu-smoke      # reduced sizes on the CPU under TRITON_INTERPRET=1

1. kernels: each Triton kernel against its plain-torch reference (`llmplug/layers/kernels/reference.py`)
   on the device, float32 and bfloat16 (MoE token grouping: integer ids, once), with the time of the
   kernel and of the torch code it replaces;
2. end to end with the triton backend: greedy tokens of the default model (SmolLM2 GGUF, dequantized)
   and of a tiny random Qwen3 (GQA 4, q/k norm) equal transformers' on the same device (float32),
   and the KV-cache size the memory profile chose;
3. throughput: the default model in bfloat16, llmplug vs transformers' padded `generate`, same prompts
   (the tiny Qwen3 in --cpu-smoke);
4. a summary; the exit status is 0 only when every check passed.

`--cpu-smoke` runs every section with tiny sizes on the CPU (the kernels in triton's interpreter; the
layers keep their torch path there, as the platform chooses) to prove the script itself works; its
timings mean nothing.
Record a GPU run's output in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU under triton's interpreter")
    ap.add_argument("--json", help="also write the results to this file")
    return ap.parse_args()


ARGS = parse_args()
if ARGS.cpu_smoke:  # before triton is imported: its decorator reads this once per kernel module
    os.environ["TRITON_INTERPRET"] = "1"

import throughput  # noqa: E402 - benchmarks/ is on sys.path when a script runs (sets CPU threads, imports torch)
import torch  # noqa: E402

# per mode: kernel shapes, end-to-end sizes, throughput sizes
SIZES = {
    "gpu": dict(tokens=4096, heads=32, kv_heads=8, head_dim=128, block_size=16, decode_batch=64, context=2048,
                vocab=128_256, hidden=4096, dtypes=("float32", "bfloat16"), timing_iters=20,
                parity_prompts=8, parity_tokens=32, prompt_tail=None, bench_prompts=64, bench_tokens=128),
    "smoke": dict(tokens=40, heads=8, kv_heads=2, head_dim=32, block_size=16, decode_batch=3, context=40,
                  vocab=300, hidden=64, dtypes=("float32",), timing_iters=1,
                  parity_prompts=1, parity_tokens=2, prompt_tail=6, bench_prompts=2, bench_tokens=3),
}


@dataclass
class Check:
    """One line of the summary."""

    section: str
    name: str
    ok: bool
    detail: str


RESULTS: list[Check] = []
START = time.perf_counter()


def record(section: str, name: str, ok: bool, detail: str) -> None:
    RESULTS.append(Check(section, name, ok, detail))
    elapsed = time.perf_counter() - START
    print(f"[{'PASS' if ok else 'FAIL'} at {elapsed:.0f} s] {section}: {name}: {detail}", flush=True)


def guarded(section: str, fn: Callable[[], None]) -> None:
    """Run a section; an exception fails it (with its traceback) and the next section still runs."""
    try:
        fn()
    except Exception as error:  # a check script reports every failure instead of stopping at the first
        traceback.print_exc()
        record(section, "ran", False, f"{type(error).__name__}: {error}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Mean milliseconds of fn() after one warm-up call."""
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters * 1e3


# ---- 1. kernels -------------------------------------------------------------------------------------


def paged_batch(s: dict, device, dtype, gen):
    """A mixed step (two prompts, a chunk with context, decodes) over a shuffled paged cache."""
    bs, d = s["block_size"], s["head_dim"]
    q_lens = [s["tokens"] // 2, s["tokens"] // 4, s["tokens"] // 8] + [1] * s["decode_batch"]
    seq_lens = [q_lens[0], q_lens[1], q_lens[2] + s["context"] // 2] + [s["context"]] * s["decode_batch"]
    blocks = [-(-n // bs) for n in seq_lens]
    order = torch.randperm(sum(blocks), generator=gen)
    tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int64)
    used = 0
    for r, n in enumerate(blocks):
        tables[r, :n], used = order[used : used + n], used + n
    cache_shape = (sum(blocks), bs, s["kv_heads"], d)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    return dict(q=rand(sum(q_lens), s["heads"], d), key_cache=rand(*cache_shape), value_cache=rand(*cache_shape),
                block_tables=tables.to(device), q_lens=q_lens, seq_lens=seq_lens)


def check_paged_attention(s: dict, device, dtype, gen) -> None:
    from llmplug.layers.kernels.paged_attention import paged_attention
    from llmplug.layers.kernels.reference import paged_attention_ref

    b = paged_batch(s, device, dtype, gen)
    qsl = torch.tensor([0, *torch.tensor(b["q_lens"]).cumsum(0).tolist()], device=device)
    seq_lens = torch.tensor(b["seq_lens"], device=device)
    heads = s["heads"]
    variants = {
        "plain": {},
        "window+softcap": {"sliding_window": 1000 if device.type == "cuda" else 9, "logit_softcap": 30.0},
        "alibi+sinks": {"alibi_slopes": torch.rand(heads, generator=gen).to(device),
                        "sinks": torch.randn(heads, generator=gen).to(device)},
    }
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for name, features in variants.items():
        out = torch.empty_like(b["q"])
        run = lambda: paged_attention(out, b["q"], b["key_cache"], b["value_cache"], b["block_tables"],  # noqa: E731
                                      seq_lens, qsl, max_query_len=max(b["q_lens"]), scale=s["head_dim"] ** -0.5,
                                      **features)
        run()
        ref = paged_attention_ref(b["q"], b["key_cache"], b["value_cache"], b["block_tables"], b["seq_lens"],
                                  b["q_lens"], scale=s["head_dim"] ** -0.5, **features)
        err = (out.float() - ref).abs().max().item()
        detail = f"{dtype_name(dtype)} max err {err:.2e}"
        if name == "plain":
            detail += f", {time_ms(run, device, s['timing_iters']):.3f} ms"
        record("kernels", f"paged_attention {name}", err < tolerance, detail)
    compare_decode_with_torch_sdpa(s, device, dtype, gen)


def compare_decode_with_torch_sdpa(s: dict, device, dtype, gen) -> None:
    """The triton backend vs torch_sdpa through the Attention layer on a decode batch: same output, and times."""
    from llmplug.layers.attention import Attention, bind_kv_cache
    from llmplug.layers.attention.torch_sdpa import TorchSDPABackend
    from llmplug.layers.attention.triton_backend import TritonAttentionBackend
    from llmplug.layers.forward_context import CommonAttentionMetadata, forward_context

    bs, d, hkv, h = s["block_size"], s["head_dim"], s["kv_heads"], s["heads"]
    n, ctx = s["decode_batch"], s["context"]
    per_req = -(-ctx // bs)
    tables = torch.randperm(n * per_req, generator=gen).view(n, per_req)
    slots = tables[:, (ctx - 1) // bs] * bs + (ctx - 1) % bs
    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(n + 1, device=device), seq_lens=torch.full((n,), ctx, device=device),
        num_computed_tokens=torch.full((n,), ctx - 1, device=device), block_tables=tables.to(device),
        slot_mapping=slots.to(device), positions=torch.full((n,), ctx - 1, device=device), block_size=bs,
        num_reqs=n, num_tokens=n, max_query_len=1, max_seq_len=ctx, query_lens_list=(1,) * n,
        seq_lens_list=(ctx,) * n,
    )
    keys = torch.randn(n * per_req * bs, hkv, d, generator=gen).to(device, dtype)
    values = torch.randn(n * per_req * bs, hkv, d, generator=gen).to(device, dtype)
    q = torch.randn(n, h * d, generator=gen).to(device, dtype)
    k, v = keys[slots].reshape(n, -1), values[slots].reshape(n, -1)
    outs, times = {}, {}
    for backend in (TorchSDPABackend, TritonAttentionBackend):
        layer = Attention(h, d, d**-0.5, hkv, prefix="check")
        cache = torch.empty(backend.kv_cache_shape(n * per_req, bs, hkv, d), device=device, dtype=dtype)
        if backend is TorchSDPABackend:  # [2, Hkv, blocks, bs, D]
            cache[0].copy_(keys.view(-1, bs, hkv, d).permute(2, 0, 1, 3))
            cache[1].copy_(values.view(-1, bs, hkv, d).permute(2, 0, 1, 3))
        else:  # [2, blocks, bs, Hkv, D]
            cache[0].copy_(keys.view(-1, bs, hkv, d))
            cache[1].copy_(values.view(-1, bs, hkv, d))
        bind_kv_cache(layer, [cache], backend)
        metadata = backend.build_metadata(common)

        def step(layer=layer, metadata=metadata):
            with forward_context(metadata):
                return layer(q, k, v)

        outs[backend.name] = step().float()
        times[backend.name] = time_ms(step, device, s["timing_iters"])
    err = (outs["triton"] - outs["torch_sdpa"]).abs().max().item()
    ratio = times["torch_sdpa"] / times["triton"]
    record("kernels", "decode attention vs torch_sdpa", err < (1e-4 if dtype == torch.float32 else 3e-2),
           f"{dtype_name(dtype)} batch {n} x {ctx} keys: max diff {err:.2e}; triton {times['triton']:.3f} ms, "
           f"torch_sdpa {times['torch_sdpa']:.3f} ms ({ratio:.2f}x)")


def check_row_kernels(s: dict, device, dtype, gen) -> None:
    from llmplug.layers.kernels import reference as ref
    from llmplug.layers.kernels.activation import silu_and_mul
    from llmplug.layers.kernels.bitmask import apply_token_bitmask_
    from llmplug.layers.kernels.reshape_and_cache import reshape_and_cache
    from llmplug.layers.kernels.rms_norm import rms_norm
    from llmplug.layers.kernels.rotary import rotary_embedding_

    t, hid, iters = s["tokens"], s["hidden"], s["timing_iters"]
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    name = dtype_name(dtype)

    x, res, w = rand(t, hid), rand(t, hid), (torch.rand(hid, generator=gen) + 0.5).to(device, dtype)
    expected, _ = ref.rms_norm_ref(x.clone(), w, 1e-6, res)
    err = (rms_norm(x.clone(), w, 1e-6, res).float() - expected).abs().max().item() / expected.abs().max().item()
    kernel = time_ms(lambda: rms_norm(x, w, 1e-6, res), device, iters)
    torch_ms = time_ms(lambda: torch.nn.functional.rms_norm(x.add(res), (hid,), w, 1e-6), device, iters)
    record("kernels", "rms_norm + residual", err < tol, f"{name} rel err {err:.2e}; {kernel:.3f} ms vs torch "
           f"{torch_ms:.3f} ms")

    gate_up = rand(t, 2 * hid)
    err = (silu_and_mul(gate_up).float() - ref.silu_and_mul_ref(gate_up)).abs().max().item()
    kernel = time_ms(lambda: silu_and_mul(gate_up), device, iters)
    torch_ms = time_ms(lambda: torch.nn.functional.silu(gate_up[:, :hid]) * gate_up[:, hid:], device, iters)
    record("kernels", "silu_and_mul", err < tol * 10, f"{name} max err {err:.2e}; {kernel:.3f} ms vs torch "
           f"{torch_ms:.3f} ms")

    from llmplug.layers.rotary import get_rope

    d = s["head_dim"]
    for neox in (True, False):
        rope = get_rope(d, d, 8192, 10000.0, is_neox_style=neox).to(device)
        positions = torch.randint(0, 8192, (t,), generator=gen).to(device)
        qk = rand(t, s["heads"] + s["kv_heads"], d)
        expected = ref.rotary_ref(qk, positions, rope.cos_sin_cache, neox)
        err = (rotary_embedding_(qk.clone(), positions, rope.cos_sin_cache, neox).float() - expected).abs().max().item()
        record("kernels", f"rotary {'neox' if neox else 'interleaved'}", err < tol * 10, f"{name} max err {err:.2e}")

    k, v = rand(t, s["kv_heads"] * d), rand(t, s["kv_heads"] * d)
    blocks = -(-t // s["block_size"]) + 1
    slots = torch.randperm(blocks * s["block_size"], generator=gen)[:t].to(device)
    got = torch.zeros(2, blocks, s["block_size"], s["kv_heads"], d, device=device, dtype=dtype)
    want = got.clone()
    reshape_and_cache(k, v, got[0], got[1], slots)
    ref.reshape_and_cache_ref(k, v, want[0], want[1], slots)
    record("kernels", "reshape_and_cache", bool(torch.equal(got, want)), f"{name} {t} tokens, exact")

    if dtype == torch.float32:  # logits are float32 whatever the model's dtype
        vocab = s["vocab"]
        words = -(-vocab // 32)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (64, words), generator=gen, dtype=torch.int64)
        bitmask = bitmask.to(torch.int32).to(device)
        logits = torch.randn(64, vocab, generator=gen).to(device)
        ok = torch.equal(apply_token_bitmask_(logits.clone(), bitmask), ref.token_bitmask_ref(logits, bitmask))
        kernel = time_ms(lambda: apply_token_bitmask_(logits.clone(), bitmask), device, iters)
        torch_ms = time_ms(lambda: ref.token_bitmask_ref(logits, bitmask), device, iters)
        record("kernels", "token bitmask", ok, f"64 x {vocab}, exact; {kernel:.3f} ms vs torch {torch_ms:.3f} ms")


def check_moe_align(s: dict, device, gen) -> None:
    """MoE token grouping (64 experts, top 8, block size 64) exact against its reference; timed against the
    stable argsort + bincount it replaces."""
    from llmplug.layers.kernels.moe_align import moe_align_block_size
    from llmplug.layers.kernels.reference import moe_align_block_size_ref

    t, experts, top_k = s["tokens"], 64, 8
    ids = torch.rand(t, experts, generator=gen).argsort(dim=1)[:, :top_k].to(device)
    got = [x.cpu() for x in moe_align_block_size(ids, experts, 64)]
    ok = all(torch.equal(g, w) for g, w in zip(got, moe_align_block_size_ref(ids.cpu(), experts, 64)))
    kernel = time_ms(lambda: moe_align_block_size(ids, experts, 1), device, s["timing_iters"])
    flat = ids.flatten()
    torch_ms = time_ms(lambda: (flat.argsort(stable=True), torch.bincount(flat, minlength=experts)), device,
                       s["timing_iters"])
    record("kernels", "moe_align_block_size", ok, f"{t} x {top_k} of {experts} experts, exact; "
           f"{kernel:.3f} ms vs torch {torch_ms:.3f} ms")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_kernels(s: dict, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    for name in s["dtypes"]:
        dtype = getattr(torch, name)
        guarded("kernels", lambda: check_paged_attention(s, device, dtype, gen))
        guarded("kernels", lambda: check_row_kernels(s, device, dtype, gen))
    guarded("kernels", lambda: check_moe_align(s, device, gen))


# ---- 2. models end to end ------------------------------------------------------------------------------


def tiny_qwen3(folder: str, smoke: bool) -> str:
    """A random Qwen3 (GQA 4, q/k norm, head_dim 64) saved by transformers."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=512, hidden_size=128 if smoke else 512, intermediate_size=256 if smoke else 1024,
                         num_hidden_layers=2 if smoke else 4, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():  # large enough for distinct greedy choices
            param.copy_(torch.randn(param.shape) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(folder)
    return folder


def hf_greedy(hf, prompts: list[list[int]], new_tokens: int, eos: int | None) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=hf.device)
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=eos if eos is not None else 0)
            out.append(gen[0, len(p):].tolist())
    return out


def tiny_prompts(n: int) -> list[list[int]]:
    """n random prompts for the tiny Qwen3, of lengths around and across 16-token blocks."""
    gen = torch.Generator().manual_seed(1)
    lens = [5, 17, 33, 64, 1, 100, 16, 48]
    return [torch.randint(0, 512, (lens[i % len(lens)],), generator=gen).tolist() for i in range(n)]


def check_parity(label: str, model: str, prompts: list[list[int]], s: dict, device, hf_loader) -> None:
    from llmplug import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", quantization="none", attention_backend="triton",
              gpu_memory_utilization=0.4, max_model_len=1024, max_num_seqs=len(prompts), skip_tokenizer_init=True)
    blocks = llm.llm_engine.engine_core.kv_cache_manager.num_blocks
    params = SamplingParams(temperature=0.0, max_tokens=s["parity_tokens"])
    ours = [list(o.outputs[0].token_ids) for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    llm.shutdown()
    del llm
    free_device_memory(device)
    hf = hf_loader().to(device).eval()
    eos = hf.config.eos_token_id
    expected = hf_greedy(hf, prompts, s["parity_tokens"], eos)
    del hf
    free_device_memory(device)
    same = sum(_same_greedy(got, want, eos) for got, want in zip(ours, expected))
    record("end to end", f"{label} greedy == transformers", same == len(prompts),
           f"{same}/{len(prompts)} prompts x {s['parity_tokens']} tokens equal (float32, triton backend); "
           f"KV cache {blocks} blocks")


def _same_greedy(got: list[int], want: list[int], eos: int | None) -> bool:
    """Equal, or both stopped at EOS (transformers pads after it)."""
    if got and got[-1] == eos:
        return want[: len(got)] == got
    return got == want


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def default_model_prompts(n: int, tail: int | None = None) -> list[list[int]]:
    """n chat prompts for the default model; only their last `tail` tokens when given (the interpreter is slow)."""
    from transformers import AutoTokenizer

    from llmplug.core.config import DEFAULT_MODEL
    from llmplug.loaders.default_model import resolve_model_path

    gguf = resolve_model_path(DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    return [p[-tail:] if tail else p for p in throughput.make_prompts(tok, n)]


def check_models(s: dict, device: torch.device, tiny_path: str) -> None:
    from transformers import AutoModelForCausalLM

    from llmplug.core.config import DEFAULT_MODEL
    from llmplug.loaders.default_model import resolve_model_path

    gguf = resolve_model_path(DEFAULT_MODEL)
    prompts = default_model_prompts(s["parity_prompts"], s["prompt_tail"])
    guarded("end to end", lambda: check_parity(
        "default model (SmolLM2)", gguf, prompts, s, device, lambda: throughput.load_hf(gguf, "float32")))
    guarded("end to end", lambda: check_parity(
        "tiny Qwen3", tiny_path, tiny_prompts(s["parity_prompts"]), s, device,
        lambda: AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)))


# ---- 3. throughput ------------------------------------------------------------------------------------------


def check_throughput(s: dict, device: torch.device, model: str, label: str, dtype: str,
                     prompts: list[list[int]]) -> None:
    ours = throughput.bench_llmplug(model, prompts, s["bench_tokens"], dtype, attention_backend="triton",
                                    gpu_memory_utilization=0.4, max_model_len=1024)
    free_device_memory(device)
    hf = throughput.load_hf(model, dtype).to(device).eval()
    theirs = throughput.bench_hf_generate(hf, prompts, s["bench_tokens"], hf.config.eos_token_id or 0)
    del hf
    free_device_memory(device)
    record("throughput", f"{label} {dtype}, {len(prompts)} prompts x {s['bench_tokens']} tokens", True,  # measured
           f"llmplug {ours:.1f} tok/s, transformers generate {theirs:.1f} tok/s, ratio {ours / theirs:.2f}x")


# ---- main -------------------------------------------------------------------------------------------------------


def main() -> int:
    import triton

    from llmplug.core.config import DEFAULT_MODEL
    from llmplug.loaders.default_model import resolve_model_path

    mode = "smoke" if ARGS.cpu_smoke else "gpu"
    if mode == "gpu" and not torch.cuda.is_available():
        print("no CUDA/ROCm GPU visible to torch: run on a GPU machine, or use --cpu-smoke", file=sys.stderr)
        return 2
    device = torch.device("cpu") if ARGS.cpu_smoke else torch.device("cuda", 0)
    s = SIZES[mode]
    where = "CPU under TRITON_INTERPRET=1" if ARGS.cpu_smoke else torch.cuda.get_device_name(0)
    print(f"gpu_check ({mode}): {where}; torch {torch.__version__}, triton {triton.__version__}", flush=True)
    check_kernels(s, device)
    with tempfile.TemporaryDirectory() as folder:
        tiny_path = tiny_qwen3(folder, ARGS.cpu_smoke)
        check_models(s, device, tiny_path)
        if ARGS.cpu_smoke:  # the default model through the interpreter would take many minutes
            guarded("throughput", lambda: check_throughput(
                s, device, tiny_path, "tiny Qwen3", "float32", tiny_prompts(s["bench_prompts"])))
        else:
            gguf = resolve_model_path(DEFAULT_MODEL)
            guarded("throughput", lambda: check_throughput(
                s, device, gguf, "default model", "bfloat16", default_model_prompts(s["bench_prompts"])))
    elapsed = time.perf_counter() - START
    failed = [c for c in RESULTS if not c.ok]
    print(f"\nsummary ({mode}, {where}, {elapsed:.0f} s): {len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    for c in RESULTS:
        print(f"  {'PASS' if c.ok else 'FAIL'}  {c.section:10s}  {c.name}: {c.detail}")
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump({"mode": mode, "where": where, "seconds": elapsed, "checks": [asdict(c) for c in RESULTS]}, f,
                      indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
