"""Gemma 3 with images against transformers on a tiny random checkpoint (SigLIP 32x32, patch 4: an 8 x 8 grid pooled
to 16 image tokens; a 2-layer Gemma 3 decoder, one sliding-window layer of 8) and drawn pictures: greedy tokens equal
and log-probabilities within 1e-4 (float32), each image's tokens attending to one another both ways as transformers'
`token_type_ids` make them — plain, under chunked prefill (an image waits for a chunk boundary), preempted, on the
torch paths, one and two images, with prefix-cache hits; and the engine's rules for such spans (never split across
steps, a span larger than the budget refused, no prefix-cache hit ending inside one)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llmplug import SamplingParams
from llmplug.core.errors import InvalidRequestError
from llmplug.engine.kv_cache import KVCacheManager
from llmplug.layers.kernels.native import KERNELS_ENV
from llmplug.testing import MultimodalParityCase, MultimodalPrompt
from llmplug.testing.multimodal import processor_inputs
from tests.engine.test_scheduler import make_scheduler, run_until_done, scheduled, step
from tests.models.tiny_models import train_llama_tokenizer
from tests.multimodal.conftest import TinyVLM
from tests.multimodal.test_encoder_cache import feature, image_request

MAX_TOKENS = 6
NUM_IMAGE_TOKENS = 16
SPECIAL = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
# Gemma 3's turns, each image part as its placeholder
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
ONE = "User: <start_of_image> What is in the picture? Model:"
TWO = "User: <start_of_image> or <start_of_image> Which one is brighter? Model:"


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> TinyVLM:
    from transformers import (
        AutoTokenizer,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    path = tmp_path_factory.mktemp("tiny_gemma3")
    base = train_llama_tokenizer(path / "sp")
    base.add_tokens(list(SPECIAL.values()), special_tokens=True)
    base.save_pretrained(path / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer", extra_special_tokens=SPECIAL)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=4, vision_use_head=False)
    text = Gemma3TextConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                            sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                            max_position_embeddings=256)
    config = Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=NUM_IMAGE_TOKENS,
                          image_token_id=tokenizer.image_token_id, boi_token_id=tokenizer.boi_token_id,
                          eoi_token_id=tokenizer.eoi_token_id)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger than the init's (zeros for the projector), so that the image matters; larger
        for param in model.parameters():  # still makes one token win whatever the picture
            param.normal_(0, 0.05)
    model.save_pretrained(path)
    image_processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                image_seq_length=NUM_IMAGE_TOKENS, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    return TinyVLM(path, processor, model)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def case(tiny_gemma3, images) -> MultimodalParityCase:
    """One and two images a prompt; 20 tokens a step: a chunk that would end inside an image ([9, 25), and [34, 50)
    of TWO) stops before it; 26 KV blocks for three prompts. transformers' `generate` takes the processor's
    `token_type_ids` (each image's tokens see one another at prefill)."""
    g, s = images["gradient"], images["shapes"]
    prompts = (MultimodalPrompt(ONE, (g,)), MultimodalPrompt(ONE, (s,)), MultimodalPrompt(TWO, (g, s)))
    return MultimodalParityCase("Gemma3ForConditionalGeneration", tiny_gemma3.path, tiny_gemma3.processor,
                                tiny_gemma3.hf_model, prompts, chunk_budget=20, preemption_blocks=26,
                                max_tokens=MAX_TOKENS, engine_kwargs={"max_num_seqs": 4})


def test_greedy_tokens_and_logprobs_match_transformers_and_the_prefix_cache_follows_the_image(mm_parity, case, llm):
    mm_parity.check(case, "plain", llm)
    mm_parity.check_prefix_cache(case, llm)


@pytest.mark.parametrize("variant", ["preemption", "tp2", "torch_paths"])
def test_chunked_preempted_tensor_parallel_and_torch_paths_match_transformers(mm_parity, case, variant, monkeypatch):
    """preemption: an image waits for a chunk boundary, and too few blocks: requests preempted and recomputed; tp2:
    each rank runs half of the SigLIP tower's heads (the pooled projector is replicated) and of the decoder, chunked;
    torch_paths: the padded SDPA prefill under the spans, chunked."""
    if variant == "torch_paths":
        monkeypatch.setenv(KERNELS_ENV, "0")
        variant = "chunked_prefill"
    mm_parity.check(case, variant)


def test_chat_with_images_is_the_rendered_conversation_through_the_processor_as_transformers_runs_it(
        mm_parity, case, llm, images):
    """The image expands into delimiters and soft tokens (no token-id expansion could): LLM.chat renders the
    conversation, and the processor takes the text with its special tokens as the template wrote them (one BOS)."""
    messages = [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": images["shapes"]}, {"type": "text", "text": "What is it?"},
        {"type": "image_pil", "image_pil": images["gradient"]}]}]
    rendered = case.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}, {"type": "image"}]}],
        tokenize=False, add_generation_prompt=True)
    chat_case = replace(case, hf_inputs=lambda processor, text, pictures: processor_inputs(
        processor, text, pictures, add_special_tokens=False))
    (output,) = llm.chat(messages, greedy(), use_tqdm=False)
    assert output.prompt_token_ids.count(case.processor.tokenizer.bos_token_id) == 1
    mm_parity.assert_matches(chat_case, output, MultimodalPrompt(rendered, (images["shapes"], images["gradient"])))


def test_text_only_prompt_matches_transformers(mm_parity, case, llm):
    prompt = MultimodalPrompt("User: hello there, robot. Model:")
    (output,) = mm_parity.generate(case, llm, [prompt])
    mm_parity.assert_matches(case, output, prompt)


def test_a_hit_ending_inside_an_image_is_recomputed_from_its_block_and_matches_transformers(mm_parity, case, llm,
                                                                                              images):
    """A prompt that ends just after its image: its full blocks but the last end at token 24, inside the image
    [9, 25); the second request's hit stops at 8, the block holding the image's start, and computes it whole."""
    prompt = MultimodalPrompt("User: <start_of_image>", (images["gradient"],))
    first, second = (mm_parity.generate(case, llm, [prompt])[0] for _ in range(2))
    image_start = first.prompt_token_ids.index(case.image_token_id())
    assert (image_start, len(first.prompt_token_ids)) == (9, 28)  # full blocks without the last token: 24
    assert second.num_cached_tokens == 8
    mm_parity.assert_matches(case, second, prompt)


# -- the engine's rules for bidirectional spans ---------------------------------------------------------------------


def test_a_chunk_never_ends_inside_an_image_and_one_that_does_not_fit_waits():
    sched = make_scheduler(max_num_batched_tokens=20, bidirectional_spans="image")
    sched.add_request(image_request("a", [feature("x", 10), feature("y", 28, 8)]))  # images [10, 26), [28, 36)
    chunks = [scheduled(out).get("a") for out in run_until_done(sched)]
    assert chunks == [10, 18, 12, 1]  # [0, 10), [10, 28) (not into [28, 36)), [28, 40), a decode


def test_a_span_larger_than_the_step_budget_is_refused_with_its_size():
    sched = make_scheduler(max_num_batched_tokens=12, bidirectional_spans="image")
    with pytest.raises(InvalidRequestError, match=r"span of 16 tokens \(at 4\).*max_num_batched_tokens=12"):
        sched.add_request(image_request("a", [feature("x", 4)]))
    sched = make_scheduler(max_num_batched_tokens=32, bidirectional_spans="prompt")  # PaliGemma's: the prompt
    with pytest.raises(InvalidRequestError, match="span of 40 tokens"):
        sched.add_request(image_request("b", [feature("x", 4)]))
    sched = make_scheduler(max_num_batched_tokens=12)  # a model without spans chunks inside the image
    sched.add_request(image_request("c", [feature("x", 4)]))
    out, _ = step(sched)
    assert scheduled(out) == {"c": 12}


def test_a_prefix_cache_hit_never_ends_inside_a_span():
    kv = KVCacheManager(64, 4, bidirectional_spans="image")
    first = image_request("a", [feature("x", 6, 8)], num_tokens=15)  # image [6, 14), 15 tokens
    assert kv.allocate_slots(first, 15)
    kv.free(first)
    again = image_request("a2", [feature("x", 6, 8)], num_tokens=15)  # the same prompt and image
    assert kv.get_computed_blocks(again)[1] == 4  # 12 cached tokens end inside [6, 14): back to the block of 6
    plain = KVCacheManager(64, 4)
    assert plain.allocate_slots(first, 15)
    plain.free(first)
    assert plain.get_computed_blocks(again)[1] == 12


def test_a_backend_or_layer_without_spans_is_refused_by_name():
    from llmplug.core.errors import ConfigError
    from llmplug.layers.attention import Attention
    from llmplug.layers.attention.spans import check_spans_supported
    from llmplug.layers.attention.torch_sdpa import TorchSDPABackend
    from llmplug.layers.attention.triton_backend import TritonAttentionBackend

    class NoSpans(TorchSDPABackend):
        name = "no_spans"
        supports_bidirectional_spans = False

    window = Attention(4, 16, 0.25, 2, "window", sliding_window=8)
    for backend in (TorchSDPABackend, TritonAttentionBackend):
        check_spans_supported("Gemma3", backend, [window])
    with pytest.raises(ConfigError, match="Gemma3 lets prompt spans.*'no_spans'"):
        check_spans_supported("Gemma3", NoSpans, [window])
    capped = Attention(4, 16, 0.25, 2, "capped", logit_softcap=50.0)
    with pytest.raises(ConfigError, match=r"\['logit_softcap'\].*'capped'"):
        check_spans_supported("Gemma3", TorchSDPABackend, [window, capped])
