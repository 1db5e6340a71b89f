"""Prompts given as embeddings (`{"prompt_embeds": tensor}`): the same tokens' embeddings give the tokens' output
and transformers' `generate(inputs_embeds=...)`, in mixed, chunked and preempted batches; prefix caching never
mixes them up with token prompts; bad embeddings and a disabled engine are clear errors."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import GemmaConfig, GraniteConfig

from llmplug import LLM, AsyncLLM, SamplingParams
from llmplug.core.config import EngineConfig, ModelConfig, ParallelConfig
from llmplug.core.errors import ConfigError, InvalidRequestError
from llmplug.engine.prompt_embeds import PLACEHOLDER_TOKEN_ID, check_engine, check_model
from llmplug.testing import save_tiny_checkpoint, tiny_config
from tests.models.tiny_models import make_tiny

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
KWARGS = {"dtype": "float32", "skip_tokenizer_init": True, "block_size": 4, "enable_prompt_embeds": True}
LENGTHS = (3, 11, 7, 20, 1, 14)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llm(tiny_llama):
    engine = LLM(str(tiny_llama.path), **KWARGS)
    yield engine
    engine.shutdown()


def token_prompts(seed: int = 0, lengths=LENGTHS, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_embeds(hf_model, ids: list[int]) -> torch.Tensor:
    """What users pass: transformers' own input embeddings of the tokens."""
    with torch.inference_mode():
        return hf_model.get_input_embeddings()(torch.tensor(ids)).clone()


def hf_greedy_from_embeds(hf_model, embeds: torch.Tensor, max_tokens: int = MAX_TOKENS) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, len(embeds), dtype=torch.long),
                                max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0].tolist()  # only new tokens: generate() had no ids to echo


def output_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def assert_no_leak(engine: LLM) -> None:
    kv = engine.llm_engine.engine_core.kv_cache_manager
    assert not engine.llm_engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks


def test_embeddings_of_the_tokens_give_the_tokens_output_and_transformers_generate(llm, tiny_llama):
    ids = token_prompts()
    embeds = [hf_embeds(tiny_llama.hf_model, p) for p in ids]
    by_tokens = output_ids(llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY, use_tqdm=False))
    outs = llm.generate([{"prompt_embeds": e} for e in embeds], GREEDY, use_tqdm=False)
    assert output_ids(outs) == by_tokens
    assert output_ids(outs) == [hf_greedy_from_embeds(tiny_llama.hf_model, e) for e in embeds]
    # vLLM's output of an embeddings prompt: no text, placeholder ids (one per row)
    assert [o.prompt for o in outs] == [None] * len(ids)
    assert [o.prompt_token_ids for o in outs] == [[PLACEHOLDER_TOKEN_ID] * n for n in LENGTHS]
    assert_no_leak(llm)


def test_our_embed_input_ids_equals_transformers_input_embeddings(tiny_llama):
    model = tiny_llama.load()
    ids = token_prompts(lengths=(9,))[0]
    with torch.inference_mode():
        ours = model.embed_input_ids(torch.tensor(ids))
    torch.testing.assert_close(ours, hf_embeds(tiny_llama.hf_model, ids), rtol=0, atol=0)


def test_a_mixed_batch_of_embeddings_text_less_token_prompts_and_n_completions(llm, tiny_llama):
    ids = token_prompts(seed=1)
    expected = output_ids(llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY, use_tqdm=False))
    mixed = [{"prompt_embeds": hf_embeds(tiny_llama.hf_model, p)} if i % 2 else {"prompt_token_ids": p}
             for i, p in enumerate(ids)]
    assert output_ids(llm.generate(mixed, GREEDY, use_tqdm=False)) == expected
    two = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    [out] = llm.generate({"prompt_embeds": hf_embeds(tiny_llama.hf_model, ids[3])}, two, use_tqdm=False)
    assert [list(c.token_ids) for c in out.outputs] == [expected[3]] * 2
    assert_no_leak(llm)


@pytest.mark.parametrize("engine_kwargs", [
    {"max_num_batched_tokens": 6},  # every prompt longer than 6 rows is prefilled in chunks
    {"max_num_batched_tokens": 8, "num_gpu_blocks_override": 12, "max_num_seqs": 4},  # and preempted, recomputed
], ids=["chunked_prefill", "chunked_and_preempted"])
def test_chunked_prefill_and_preemption_keep_the_embeddings(tiny_llama, engine_kwargs):
    engine = LLM(str(tiny_llama.path), **KWARGS, **engine_kwargs)
    ids = token_prompts(seed=2)
    expected = output_ids(engine.generate([{"prompt_token_ids": p} for p in ids], GREEDY, use_tqdm=False))
    preemptions = engine.llm_engine.engine_core.scheduler.num_preemptions
    mixed = [{"prompt_embeds": hf_embeds(tiny_llama.hf_model, p)} if i != 1 else {"prompt_token_ids": p}
             for i, p in enumerate(ids)]
    assert output_ids(engine.generate(mixed, GREEDY, use_tqdm=False)) == expected
    if "num_gpu_blocks_override" in engine_kwargs:
        assert engine.llm_engine.engine_core.scheduler.num_preemptions > preemptions
    assert_no_leak(engine)
    engine.shutdown()


def test_prefix_caching_tells_embeddings_from_their_placeholder_tokens(llm, tiny_llama):
    hf = tiny_llama.hf_model
    zeros = [PLACEHOLDER_TOKEN_ID] * 20  # what an embeddings prompt's ids look like
    embeds = torch.randn(20, hf.config.hidden_size, generator=torch.Generator().manual_seed(3)) * 0.5
    stats = lambda: llm.llm_engine.engine_core.kv_cache_manager.prefix_cache_stats  # noqa: E731
    by_zeros = output_ids(llm.generate({"prompt_token_ids": zeros}, GREEDY, use_tqdm=False))[0]
    hits = stats().hits
    by_embeds = output_ids(llm.generate({"prompt_embeds": embeds}, GREEDY, use_tqdm=False))[0]
    assert stats().hits == hits  # the zeros' cached blocks were not taken for the embeddings
    assert by_embeds == hf_greedy_from_embeds(hf, embeds) != by_zeros
    again = output_ids(llm.generate({"prompt_embeds": embeds.clone()}, GREEDY, use_tqdm=False))[0]
    assert stats().hits > hits and again == by_embeds  # equal embeddings share their blocks
    hits = stats().hits
    other = embeds.clone()
    other[17] += 1.0  # the last full block differs: the first four blocks are shared, not the fifth
    llm.generate({"prompt_embeds": other}, GREEDY, use_tqdm=False)
    assert stats().hits == hits + 16
    assert output_ids(llm.generate({"prompt_token_ids": zeros}, GREEDY, use_tqdm=False))[0] == by_zeros
    assert_no_leak(llm)


@pytest.mark.parametrize("bad, message", [
    (lambda h: torch.zeros(4, h + 1), "must be [num_tokens, 64]"),
    (lambda h: torch.zeros(2, 4, h), "got shape [2, 4, 64]"),
    (lambda h: torch.zeros(0, h), "has 0 rows"),
    (lambda h: torch.zeros(256, h), "has 256 rows"),
    (lambda h: torch.zeros(4, h, dtype=torch.int64), "float dtype"),
    (lambda h: torch.full((4, h), float("nan")), "NaN or infinite"),
    (lambda h: torch.full((4, h), float("inf")), "NaN or infinite"),
    (lambda h: [[0.0] * h], "must be a torch.Tensor"),
])
def test_bad_embeddings_are_clear_errors_and_the_next_request_works(llm, tiny_llama, bad, message):
    with pytest.raises(InvalidRequestError, match="prompt_embeds") as error:
        llm.generate({"prompt_embeds": bad(64)}, GREEDY, use_tqdm=False)
    assert message in str(error.value) and error.value.param == "prompt_embeds"
    ids = token_prompts(lengths=(5,))[0]
    by_embeds = output_ids(llm.generate({"prompt_embeds": hf_embeds(tiny_llama.hf_model, ids)}, GREEDY,
                                        use_tqdm=False))
    assert by_embeds == output_ids(llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False))
    assert_no_leak(llm)


def test_bfloat16_embeddings_are_cast_to_the_model_dtype(llm, tiny_llama):
    ids = token_prompts(lengths=(6,))[0]
    embeds = hf_embeds(tiny_llama.hf_model, ids).bfloat16()
    [out] = llm.generate({"prompt_embeds": embeds}, GREEDY, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == hf_greedy_from_embeds(tiny_llama.hf_model, embeds.float())


def test_prompt_logprobs_of_an_embeddings_prompt_are_refused(llm):
    params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        llm.generate({"prompt_embeds": torch.zeros(3, 64)}, params, use_tqdm=False)


def test_an_engine_without_the_flag_names_it_and_keeps_working(tiny_llama):
    engine = LLM(str(tiny_llama.path), **{**KWARGS, "enable_prompt_embeds": False})
    with pytest.raises(InvalidRequestError, match=r"enable_prompt_embeds \(--enable-prompt-embeds\)"):
        engine.generate({"prompt_embeds": torch.zeros(3, 64)}, GREEDY, use_tqdm=False)
    assert len(output_ids(engine.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False))[0]) == MAX_TOKENS
    assert_no_leak(engine)
    engine.shutdown()


def test_async_llm_takes_embeddings(tiny_llama, llm):
    ids = token_prompts(lengths=(8,))[0]
    expected = output_ids(llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False))[0]
    engine = AsyncLLM(str(tiny_llama.path), **KWARGS)

    async def run():
        return [out async for out in engine.generate({"prompt_embeds": hf_embeds(tiny_llama.hf_model, ids)},
                                                     GREEDY, "embeds")]

    try:
        outs = asyncio.run(run())
    finally:
        engine.shutdown()
    assert outs[-1].finished and list(outs[-1].outputs[0].token_ids) == expected


# embedding scales in both places transformers puts them: in the embedding module (Gemma: users' embeddings are
# scaled) and in the forward, after the embeddings (Granite: users' embeddings are not)
SCALED = {
    "gemma": lambda: tiny_config(GemmaConfig, head_dim=16),
    "granite": lambda: tiny_config(GraniteConfig, embedding_multiplier=3.0, residual_multiplier=0.5,
                                   logits_scaling=2.0, attention_multiplier=0.2),
}


@pytest.mark.parametrize("family", sorted(SCALED))
def test_families_with_an_embedding_scale_take_transformers_input_embeddings(family, tmp_path):
    tiny = save_tiny_checkpoint(SCALED[family](), tmp_path)
    engine = LLM(str(tiny.path), **KWARGS)
    ids = token_prompts(seed=4, lengths=(5, 13))
    by_tokens = output_ids(engine.generate([{"prompt_token_ids": p} for p in ids], GREEDY, use_tqdm=False))
    embeds = [hf_embeds(tiny.hf_model, p) for p in ids]
    by_embeds = output_ids(engine.generate([{"prompt_embeds": e} for e in embeds], GREEDY, use_tqdm=False))
    assert by_embeds == by_tokens == [hf_greedy_from_embeds(tiny.hf_model, e) for e in embeds]
    engine.shutdown()


def test_models_and_combinations_that_cannot_take_embeddings_are_refused():
    class TokensOnlyForCausalLM(torch.nn.Module):
        pass

    with pytest.raises(ConfigError, match="TokensOnlyForCausalLM does not take prompt embeddings"):
        check_model(TokensOnlyForCausalLM())
    pooling = type("EmbedderModel", (torch.nn.Module,), {"is_pooling_model": True, "supports_prompt_embeds": True})
    with pytest.raises(ConfigError, match="EmbedderModel is a pooling model"):
        check_model(pooling())
    generating = type("Gen", (torch.nn.Module,), {"supports_prompt_embeds": True})()
    pp = EngineConfig(model=ModelConfig(enable_prompt_embeds=True), parallel=ParallelConfig(pipeline_parallel_size=2))
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        check_engine(pp, generating)
    spec = EngineConfig(model=ModelConfig(enable_prompt_embeds=True),
                        speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="speculative decoding"):
        check_engine(spec, generating)
    check_engine(EngineConfig(model=ModelConfig(enable_prompt_embeds=False)), TokensOnlyForCausalLM())  # off: no check


@pytest.mark.slow
def test_tensor_parallel_embeddings_bypass_the_vocab_parallel_table(tmp_path):
    from tests.engine.executors.parity import make_parallel_tiny

    tiny = make_parallel_tiny("llama", tmp_path)
    ids = token_prompts(seed=5, lengths=(4, 13), vocab=250)
    embeds = [hf_embeds(tiny.hf_model, p) for p in ids]
    engine = LLM(str(tiny.path), **KWARGS, tensor_parallel_size=2)
    try:
        assert engine.config.parallel.executor == "multiproc"  # the tensors travel to both worker processes
        mixed = [{"prompt_embeds": embeds[0]}, {"prompt_token_ids": ids[1]}, {"prompt_embeds": embeds[1]}]
        got = output_ids(engine.generate(mixed, GREEDY, use_tqdm=False))
    finally:
        engine.shutdown()
    expected = [hf_greedy_from_embeds(tiny.hf_model, e) for e in embeds]
    assert got == [expected[0], expected[1], expected[1]]
