"""An answer never depends on what else is in the batch with the default settings (batch-invariant mode,
model.batch_invariant, is on by default), on the default model in bf16 with chunked prefill and prefix caching on: a seeded sampled request alone and inside
batches of 1, 7 and 32; 32 chat prompts each alone and all together, greedy and seeded. And the compiled
forward gives the eager engine's greedy tokens and log-probabilities, bit for bit (on a tiny Llama)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from llmplug import LLM, SamplingParams
from llmplug.testing.tiny import save_tiny_checkpoint, tiny_config

PROBE = "Tell me a short story about a lighthouse keeper."
OTHERS = [f"Question {i}: what is {i} times {i + 3}, and why does it matter?" for i in range(32)]
# sampled, not greedy: a different rounding anywhere shows as a different draw sooner than as a new argmax
PROBE_PARAMS = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
OTHER_PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# each answer's tokens and log-probabilities compared bitwise at every step: the prefill and 16 decode steps beside
# 31 others exercise every batch-dependent path (the alone runs, one request at a time, are most of the time)
CHAT_TOKENS = 16
CHAT_TOPICS = [
    "the tides", "a bicycle", "bread", "volcanoes", "chess", "the moon", "bees", "rainbows", "glaciers", "owls",
    "compilers", "tea", "lightning", "maps", "coral reefs", "violins", "deserts", "clocks", "whales", "paper",
    "bridges", "mushrooms", "comets", "kites", "salt", "fireflies", "caves", "trains", "honey", "wind", "ink", "snow",
]


@pytest.fixture(scope="module")
def invariant_llm():
    """The default model with every setting at its default (the mode is on by default) but room for 32 requests."""
    llm = LLM(max_num_seqs=32)
    assert llm.llm_engine.config.model.batch_invariant is True
    yield llm
    llm.shutdown()


def probe_tokens(llm: LLM, batch_size: int) -> list[int]:
    """The probe's tokens when it runs with `batch_size - 1` other requests in the same steps."""
    prompts = [PROBE, *OTHERS[: batch_size - 1]]
    params = [PROBE_PARAMS] + [OTHER_PARAMS] * (batch_size - 1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return list(outputs[0].outputs[0].token_ids)


@pytest.mark.slow
def test_seeded_request_gives_the_same_tokens_alone_and_in_batches_of_1_7_32(invariant_llm) -> None:
    alone = probe_tokens(invariant_llm, 1)
    assert len(alone) == PROBE_PARAMS.max_tokens
    for batch_size in (1, 7, 32):
        assert probe_tokens(invariant_llm, batch_size) == alone, f"the probe's tokens changed in a batch of {batch_size}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=CHAT_TOKENS, logprobs=0),
        SamplingParams(temperature=0.8, seed=123, max_tokens=CHAT_TOKENS, logprobs=0),
    ],
    ids=["greedy", "seeded"],
)
def test_32_chat_prompts_alone_and_in_a_batch_of_32_are_identical(invariant_llm, params) -> None:
    """Tokens and their log-probabilities, bitwise; prompts share the chat template's prefix (prefix-cache hits)."""
    conversations = [[{"role": "user", "content": f"Tell me one fact about {topic}."}] for topic in CHAT_TOPICS]

    def answers(batch: list) -> list[tuple[list[int], list[float]]]:
        outputs = invariant_llm.chat(batch, params, use_tqdm=False)
        return [
            (list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outputs
        ]

    alone = [answers([c])[0] for c in conversations]
    together = answers(conversations)
    same = sum(a == t for a, t in zip(alone, together))
    assert same == len(conversations), f"only {same}/{len(conversations)} answers identical alone and in the batch"


@pytest.mark.slow
def test_compiled_forward_greedy_equals_eager(tmp_path) -> None:
    """With device.compile the greedy tokens and their log-probabilities equal the eager engine's bit for bit (dense
    bf16): llmplug's CPU kernels are opaque calls in the compiled graph, so it computes what eager does (before they
    were, inductor's fused bf16 element-wise code changed 4-5 of 8 of the default model's answers by token 10-23).
    A two-layer Llama of the default model's kinds of blocks keeps inductor's compile to seconds (the default
    model's 30 layers took minutes on a cold cache); the eager engine runs with the mode off, as the compiled one
    resolves it."""
    config = tiny_config(LlamaConfig, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
    path = str(save_tiny_checkpoint(config, tmp_path / "llama").path)
    generator = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 512, (n,), generator=generator).tolist()}
               for n in (9, 23, 4, 40, 17, 2, 31, 12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    engine = dict(dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=32, enable_prefix_caching=False)
    eager = LLM(path, batch_invariant=False, **engine)
    try:
        expected = [_tokens_and_logprobs(o) for o in eager.generate(prompts, greedy, use_tqdm=False)]
    finally:
        eager.shutdown()
    compiled = LLM(path, **engine, **{"device.compile": True})
    try:
        runner_forward = compiled.llm_engine.engine_core.executor.worker.model_runner.forward
        got = [_tokens_and_logprobs(o) for o in compiled.generate(prompts, greedy, use_tqdm=False)]
        assert runner_forward.failed is None, runner_forward.failed  # really compiled, not the eager fallback
        assert got == expected
    finally:
        compiled.shutdown()


def _tokens_and_logprobs(output) -> list[tuple[int, float]]:
    """Each generated token with its log-probability."""
    completion = output.outputs[0]
    return [(token, step[token].logprob) for token, step in zip(completion.token_ids, completion.logprobs)]


def test_prompt_attention_rows_do_not_depend_on_chunks_batches_prefix_hits_or_turns(tmp_path) -> None:
    """Prompt rows of head dim 64 in blocks of 16 take the CPU attention's prompt kernel (AMX tiles of 16 rows where
    AMX is on, docs/kernels.md) and generated rows the float32 rows: each answer is bitwise the same alone,
    prefilled in chunks of 24 tokens (tiles cut mid-way) beside the others' decodes, after a prefix-cache hit, and
    as a second turn whose prompt holds the first answer (computed as generated rows)."""
    config = tiny_config(LlamaConfig, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
    path = str(save_tiny_checkpoint(config, tmp_path / "llama").path)
    generator = torch.Generator().manual_seed(0)
    first = torch.randint(0, 512, (100,), generator=generator).tolist()
    prompts = [first, first[:64] + [5, 6, 7], *(torch.randint(0, 512, (n,), generator=generator).tolist()
                                               for n in (37, 70, 5))]
    def answers(batches: list[list[list[int]]], max_tokens: int = 12, **engine) -> list[list[tuple[int, float]]]:
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        llm = LLM(path, dtype="bfloat16", skip_tokenizer_init=True, max_num_seqs=8, **engine)
        try:
            return [_tokens_and_logprobs(o) for batch in batches
                    for o in llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)]
        finally:
            llm.shutdown()

    alone = answers([[p] for p in prompts], enable_prefix_caching=False)
    assert answers([prompts], max_num_batched_tokens=24, enable_prefix_caching=False) == alone
    assert answers([[p] for p in prompts], enable_prefix_caching=True) == alone  # prompt 1 hits prompt 0's blocks
    # 40 generated tokens fill the blocks of positions 96..127: cached, but named apart from a prompt's
    second = first + [token for token, _ in answers([[first]], max_tokens=40)[0]] + [8, 9]
    turns = answers([[first], [second]], enable_prefix_caching=True, max_tokens=40)
    assert turns[1] == answers([[second]], enable_prefix_caching=False, max_tokens=40)[0]
