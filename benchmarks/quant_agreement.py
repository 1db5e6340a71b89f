"""How far each weight mode is from the dense model: top-1 agreement and KL on 32 chat prompts.

    python benchmarks/quant_agreement.py                  # the default SmolLM2 GGUF, 32 prompts x 64 tokens
    python benchmarks/quant_agreement.py --model DIR --output-len 32

The reference is the dense model in float32 (`quantization=none`). It answers each chat prompt greedily; then
every mode reads the same prompts and the same answers (teacher forcing: a per-request logits processor records
the mode's full next-token distribution and then forces the reference's token), so every position is compared on
the same context. Reported per mode: top-1 agreement (the share of positions whose argmax is the reference's)
and the mean KL(reference || mode) in nats per position. The first row, the reference run again against itself,
checks the method (100 %, 0). Results go to docs/quantization.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from unittest import mock

from llmplug.platforms.cpu_threads import configure_cpu_threads

configure_cpu_threads()

import torch  # noqa: E402

from throughput import load_tokenizer, make_prompts  # noqa: E402 - benchmarks/ is on sys.path when a script runs

# (name, engine settings): the dense reference first; then what a user can pick for a GGUF. Outside the
# batch-invariant mode int4 serves calls of at most 8 rows, so that mode is measured one stream at a time
MODES = [
    ("none, float32 (reference)", {"dtype": "float32", "quantization": "none"}),
    ("none, bf16 (dense)", {"dtype": "bfloat16", "quantization": "none"}),
    ("auto, bf16 (the default: dense prompt, int4 generated tokens, W4A8)", {"dtype": "bfloat16"}),
    ("auto, bf16, LLMPLUG_CPU_W4A8=0 (generated tokens with bf16 activations)",
     {"dtype": "bfloat16", "env": {"LLMPLUG_CPU_W4A8": "0"}}),
    ("auto, no batch invariance, one stream (int4 for calls of <= 8 tokens)",
     {"dtype": "bfloat16", "quantization": "auto", "batch_invariant": False, "max_num_seqs": 1}),
    ("int4 + batch_invariant (LM head requantized)", {"dtype": "bfloat16", "quantization": "int4",
                                                      "batch_invariant": True}),
    ("int8 (w8a8: per-channel weights, per-token activations)", {"dtype": "bfloat16", "quantization": "int8"}),
]


class ForcedRecorder:
    """A logits processor that records the row's log-probabilities and then forces the reference's next token."""

    def __init__(self, answer: list[int], rows: list[torch.Tensor]) -> None:
        self.answer, self.rows = answer, rows

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.rows.append(torch.log_softmax(logits.float(), dim=-1))
        forced = torch.full_like(logits, float("-inf"))
        forced[self.answer[len(output_token_ids)]] = 0.0
        return forced


def distributions(model: str, prompts: list[list[int]], answers: list[list[int]], engine: dict) -> list[torch.Tensor]:
    """Each prompt's next-token log-probabilities [len(answer), V] along its reference answer, under `engine`."""
    from llmplug import LLM, SamplingParams

    engine = dict(engine)
    with mock.patch.dict(os.environ, engine.pop("env", {})):  # process settings the mode loads its engine under
        llm = LLM(model=model, **{"max_num_seqs": len(prompts), "enable_prefix_caching": False, **engine})
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    params = [
        SamplingParams(temperature=0.0, max_tokens=len(answer), ignore_eos=True,
                       logits_processors=[ForcedRecorder(answer, rows[i])])
        for i, answer in enumerate(answers)
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    for out, answer in zip(outputs, answers):
        assert list(out.outputs[0].token_ids) == answer, "teacher forcing failed: the forced tokens were not taken"
    return [torch.stack(r) for r in rows]


def compare(reference: list[torch.Tensor], mode: list[torch.Tensor]) -> dict[str, float]:
    """Top-1 agreement and mean KL(reference || mode) over every position of every prompt."""
    ref, got = torch.cat(reference), torch.cat(mode)
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = (ref.exp() * (ref - got)).sum(-1).clamp_min(0).mean().item()
    return {"top1_agreement": agree, "kl_nats": kl, "positions": ref.shape[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model dir or .gguf; default: the embedded SmolLM2")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()

    from llmplug import LLM, SamplingParams
    from llmplug.core.config import DEFAULT_MODEL
    from llmplug.loaders.default_model import resolve_model_path

    model = resolve_model_path(args.model or DEFAULT_MODEL)
    prompts = make_prompts(load_tokenizer(model), args.num_prompts)
    reference_engine = MODES[0][1]  # no "env"
    llm = LLM(model=model, max_num_seqs=len(prompts), enable_prefix_caching=False, **reference_engine)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    answers = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                   greedy, use_tqdm=False)]
    llm.shutdown()
    reference = distributions(model, prompts, answers, reference_engine)
    results = {}
    for name, engine in MODES:
        results[name] = compare(reference, distributions(model, prompts, answers, engine))
        r = results[name]
        print(f"{name:55s} top-1 {100 * r['top1_agreement']:6.2f} %   KL {r['kl_nats']:.5f} nats   "
              f"({r['positions']} positions)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "prompts": len(prompts), "output_len": args.output_len, "modes": results}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
