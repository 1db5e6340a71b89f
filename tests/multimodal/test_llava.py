"""LLaVA 1.5 against transformers on a tiny random checkpoint and drawn pictures: greedy tokens equal and
log-probabilities within 1e-4 (float32), plain, under chunked prefill whose budget is smaller than one image, and
with preemption; prefix caching by image content; the encoder cache; bad inputs refused before queueing."""

from __future__ import annotations

import asyncio
import base64
import copy
import dataclasses
import io

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.core.errors import InvalidRequestError
from llmplug.testing import MultimodalParityCase, MultimodalPrompt
from tests.multimodal.conftest import NUM_IMAGE_TOKENS, copy_with_renamed_weights, gradient, model_runner, shapes

MAX_TOKENS = 8
ONE = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TWO = "USER: <image> and <image>\nWhich one is brighter? ASSISTANT:"


def greedy(logprobs: int = 2) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)


@pytest.fixture(scope="module")
def case(tiny_llava, images) -> MultimodalParityCase:
    """One and two pictures a prompt, each picture first and second; chunks of 6 tokens (an image's 16
    placeholders span three steps), and 26 KV blocks for four prompts."""
    g, s = images["gradient"], images["shapes"]
    prompts = tuple(MultimodalPrompt(text, imgs) for text, imgs in [(ONE, (g,)), (ONE, (s,)), (TWO, (g, s)),
                                                                    (TWO, (s, g))])
    return MultimodalParityCase("LlavaForConditionalGeneration", tiny_llava.path, tiny_llava.processor,
                                tiny_llava.hf_model, prompts, chunk_budget=6, preemption_blocks=26,
                                max_tokens=MAX_TOKENS, engine_kwargs={"limit_mm_per_prompt": {"image": 2}})


def assert_matches_hf(mm_parity, case, output, text: str, images: list) -> None:
    mm_parity.assert_matches(case, output, MultimodalPrompt(text, tuple(images)))


def test_greedy_tokens_and_logprobs_match_transformers_and_the_prefix_cache_follows_the_image(mm_parity, case, llm):
    report = mm_parity.check(case, "plain", llm)
    for prompt, output in zip(case.prompts, report.outputs):
        assert output.prompt_token_ids.count(case.image_token_id()) == NUM_IMAGE_TOKENS * len(prompt.images)
    mm_parity.check_prefix_cache(case, llm)


@pytest.mark.parametrize("variant", ["preemption", "tp2"])
def test_chunked_inside_an_image_preempted_and_tensor_parallel_match_transformers(mm_parity, case, variant):
    """preemption: chunks of 6 and too few blocks, requests preempted and recomputed; tp2: each rank runs its half
    of the vision tower's heads and of the projector on the same image, in chunks of 6."""
    mm_parity.check(case, variant)


def test_the_kit_fails_for_another_model_and_refuses_a_case_whose_pictures_do_not_matter(mm_parity, case, llm):
    """The kit's checks can fail: transformers with the projector's output doubled is not the model the engine runs;
    with the projector zeroed, the pictures change nothing transformers says, and the case is refused as one that
    could not tell an engine that ignores them."""
    (output,) = mm_parity.generate(case, llm, case.prompts[:1])
    doubled, blind = copy.deepcopy(case.hf_model), copy.deepcopy(case.hf_model)
    with torch.no_grad():
        doubled.model.multi_modal_projector.linear_2.weight.mul_(2)
        for param in blind.model.multi_modal_projector.parameters():
            param.zero_()
    with pytest.raises(AssertionError, match="differ from transformers"):
        mm_parity.assert_matches(dataclasses.replace(case, name="llava-doubled", hf_model=doubled), output,
                                 case.prompts[0])
    with pytest.raises(ValueError, match="alike whatever the picture"):
        mm_parity.check(dataclasses.replace(case, name="llava-blind", hf_model=blind), "plain", llm)


def test_token_ids_prompt_with_one_placeholder_per_image_is_expanded(mm_parity, case, llm, images):
    ids = case.processor.tokenizer.encode(TWO)
    imgs = [images["shapes"], images["gradient"]]
    (output,) = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}, greedy(),
                             use_tqdm=False)
    assert_matches_hf(mm_parity, case, output, TWO, imgs)


def test_numpy_and_torch_images_are_the_pil_image(llm, images):
    import numpy as np

    array = np.array(images["gradient"])
    forms = [images["gradient"], array, torch.from_numpy(array).permute(2, 0, 1), torch.from_numpy(array)]
    outputs = llm.generate([{"prompt": ONE, "multi_modal_data": {"image": f}} for f in forms], greedy(),
                           use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1


def make_llm(case, **kwargs) -> LLM:
    """An engine of settings the shared one lacks."""
    return LLM(str(case.model), **{"dtype": "float32", "block_size": 4, "num_gpu_blocks_override": 128,
                                   "limit_mm_per_prompt": {"image": 2}, "device": {"num_threads": 1}, **kwargs})


def test_encoder_runs_once_per_image_across_chunks_and_requests(mm_parity, case, images):
    llm = make_llm(case, max_num_batched_tokens=6, enable_prefix_caching=False)
    cache = model_runner(llm).encoder_cache
    g, s = images["gradient"], images["shapes"]
    llm.generate({"prompt": ONE, "multi_modal_data": {"image": g}}, greedy(), use_tqdm=False)
    assert cache.num_encoder_calls == 1  # its 16 placeholders took three chunks
    llm.generate({"prompt": TWO, "multi_modal_data": {"image": [g, s]}}, greedy(), use_tqdm=False)
    assert cache.num_encoder_calls == 2  # the gradient came from the cache
    out = llm.generate({"prompt": TWO, "multi_modal_data": {"image": [s, s]}}, greedy(), use_tqdm=False)[0]
    assert cache.num_encoder_calls == 2
    assert_matches_hf(mm_parity, case, out, TWO, [s, s])
    llm.shutdown()


def test_encoder_cache_evicts_unused_images_beyond_its_size(mm_parity, case):
    llm = make_llm(case, encoder_cache_size=NUM_IMAGE_TOKENS, enable_prefix_caching=False)
    cache = model_runner(llm).encoder_cache
    pictures = [gradient(40 + 4 * i, 40) for i in range(3)]
    outputs = llm.generate([{"prompt": ONE, "multi_modal_data": {"image": p}} for p in pictures], greedy(),
                           use_tqdm=False)
    assert cache.num_encoder_calls == 3 and len(cache.outputs) == 1  # room for one image: the others dropped
    for picture, output in zip(pictures, outputs):
        assert_matches_hf(mm_parity, case, output, ONE, [picture])
    llm.shutdown()


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_chat_takes_image_url_and_pil_parts(mm_parity, case, llm, images):
    g = images["gradient"]
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(g)}}, {"type": "text", "text": "What is it?"}]}]
    pil = [{"role": "user", "content": [
        {"type": "image_pil", "image_pil": g}, {"type": "text", "text": "What is it?"}]}]
    by_url = llm.chat(messages, greedy(), use_tqdm=False)[0]
    by_pil = llm.chat(pil, greedy(), use_tqdm=False)[0]
    text = case.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}],
        tokenize=False, add_generation_prompt=True)
    assert by_url.outputs[0].token_ids == by_pil.outputs[0].token_ids
    assert_matches_hf(mm_parity, case, by_url, text, [g])  # (PNG is lossless: the same pixels)


def test_async_llm_processes_images_off_the_event_loop(mm_parity, case, images):
    from llmplug.engine.async_llm import AsyncLLM

    engine = AsyncLLM(str(case.model), dtype="float32", block_size=4, num_gpu_blocks_override=128,
                      device={"num_threads": 1})

    async def run():
        last = None
        async for out in engine.generate({"prompt": ONE, "multi_modal_data": {"image": images["shapes"]}}, greedy(),
                                          "r1"):
            last = out
        return last

    try:
        output = asyncio.run(run())
    finally:
        engine.shutdown()
    assert_matches_hf(mm_parity, case, output, ONE, [images["shapes"]])


def test_bad_images_are_refused_before_queueing_and_the_next_request_works(mm_parity, case, llm, images):
    g = images["gradient"]
    with pytest.raises(InvalidRequestError, match="3 images, but at most 2.*limit-mm-per-prompt"):
        llm.generate({"prompt": TWO + " <image>", "multi_modal_data": {"image": [g, g, g]}}, greedy(),
                     use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"multi_modal_data\['image'\]\[0\] is a str"):
        llm.generate({"prompt": ONE, "multi_modal_data": {"image": "cat.png"}}, greedy(), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="has shape"):
        llm.generate({"prompt": ONE, "multi_modal_data": {"image": torch.zeros(5)}}, greedy(), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="audio"):
        llm.generate({"prompt": ONE, "multi_modal_data": {"audio": g}}, greedy(), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="processor refused.*<image>"):  # no placeholder in the prompt
        llm.generate({"prompt": "USER: hi ASSISTANT:", "multi_modal_data": {"image": g}}, greedy(), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    output = llm.generate({"prompt": ONE, "multi_modal_data": {"image": g}}, greedy(), use_tqdm=False)[0]
    assert_matches_hf(mm_parity, case, output, ONE, [g])


def test_a_text_model_refuses_images_by_name(tiny_text_model, images):
    llm = LLM(str(tiny_text_model), dtype="float32", num_gpu_blocks_override=32)
    with pytest.raises(InvalidRequestError, match="takes text only"):
        llm.generate({"prompt": "Hello", "multi_modal_data": {"image": images["gradient"]}}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="takes text only"):
        llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": images["gradient"]}]}],
                 use_tqdm=False)
    assert llm.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()


def test_transformers_5_weight_names_load_the_same_model(mm_parity, case, images, tmp_path):
    """`model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head.*` (the layout
    transformers 5 holds in memory) as well as the older one transformers saves."""
    renames = {"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.",
               "vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector."}
    copy_with_renamed_weights(case.model, tmp_path, renames)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_gpu_blocks_override=64, device={"num_threads": 1})
    output = llm.generate({"prompt": ONE, "multi_modal_data": {"image": images["gradient"]}}, greedy(),
                          use_tqdm=False)[0]
    assert_matches_hf(mm_parity, case, output, ONE, [images["gradient"]])
    llm.shutdown()


def test_an_image_prompt_gives_bitwise_the_same_result_alone_and_in_a_batch(case):
    llm = make_llm(case, batch_invariant=True, enable_prefix_caching=False)
    prompts = [p.engine_prompt() for p in case.prompts]
    alone = llm.generate(prompts[2], greedy(), use_tqdm=False)[0]
    batched = llm.generate(prompts[:2] + [prompts[2]] + ["a text prompt beside them"], greedy(), use_tqdm=False)[2]
    assert alone.outputs[0].token_ids == batched.outputs[0].token_ids
    assert [{t: lp.logprob for t, lp in p.items()} for p in alone.outputs[0].logprobs] == \
        [{t: lp.logprob for t, lp in p.items()} for p in batched.outputs[0].logprobs]
    llm.shutdown()


def test_a_prefix_hit_that_ends_inside_an_image_computes_the_rest_of_it(mm_parity, case, images):
    """A prompt that ends with its image: the second time, the cached blocks end inside the image, and the rest of
    its placeholders take rows of the image's encoder output (computed again: the cache evicted it meanwhile)."""
    llm = make_llm(case, encoder_cache_size=NUM_IMAGE_TOKENS)
    cache = model_runner(llm).encoder_cache
    text, g = "USER: <image>", images["gradient"]
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": g}}, greedy(), use_tqdm=False)[0]
    llm.generate({"prompt": ONE, "multi_modal_data": {"image": images["shapes"]}}, greedy(), use_tqdm=False)
    again = llm.generate({"prompt": text, "multi_modal_data": {"image": g}}, greedy(), use_tqdm=False)[0]
    image_start = first.prompt_token_ids.index(case.image_token_id())
    assert image_start < again.num_cached_tokens < len(again.prompt_token_ids)
    assert cache.num_encoder_calls == 3
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_matches_hf(mm_parity, case, again, text, [g])
    llm.shutdown()


def test_max_model_len_counts_the_image_tokens(case, images):
    imgs = [images["gradient"], images["shapes"]]
    one_image = case.processor(text=ONE, images=imgs[:1], return_tensors="pt")["input_ids"].shape[1]
    llm = make_llm(case, max_model_len=one_image + 4)  # the text of TWO alone would fit
    assert len(case.processor.tokenizer.encode(TWO)) < one_image
    too_long = rf"the prompt has \d+ tokens, but the context length is {one_image + 4}"
    with pytest.raises(InvalidRequestError, match=too_long):
        llm.generate({"prompt": TWO, "multi_modal_data": {"image": imgs}}, greedy(), use_tqdm=False)
    assert llm.generate({"prompt": ONE, "multi_modal_data": {"image": imgs[0]}}, SamplingParams(max_tokens=2),
                        use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()


def test_resetting_the_prefix_cache_drops_the_encoder_outputs_too(llm):
    """New weights (update_weights resets the prefix cache): an image cached under the old ones is encoded again."""
    cache = model_runner(llm).encoder_cache
    prompt = {"prompt": ONE, "multi_modal_data": {"image": shapes(40, 52)}}  # a picture no other test sends
    llm.generate(prompt, greedy(), use_tqdm=False)
    calls = cache.num_encoder_calls
    llm.reset_prefix_cache()
    again = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    assert cache.num_encoder_calls == calls + 1 and again.num_cached_tokens == 0 and len(cache.outputs) == 1


def test_an_image_that_fails_to_encode_ends_only_its_own_request(mm_parity, case, llm, images, monkeypatch):
    """The encoder raises for one image: that request ends with the error, the other image request and a text
    request in the same steps are answered as transformers answers them, and no block of the failed request is
    left named in the prefix cache — the same image, once it encodes, is computed afresh and answered right."""
    model = model_runner(llm).model
    g, s = images["gradient"], gradient(44, 56)  # a picture no other test sends: nothing of it cached yet
    real = model.embed_multimodal
    broken = case.processor(text=ONE, images=[s], return_tensors="pt")["pixel_values"]

    def flaky(**data):
        if torch.equal(data["pixel_values"].reshape(broken.shape), broken):
            raise RuntimeError("vision tower out of memory")
        return real(**data)

    monkeypatch.setattr(model, "embed_multimodal", flaky)
    text = "USER: What is in the picture? ASSISTANT:"
    outs = llm.generate([{"prompt": ONE, "multi_modal_data": {"image": s}},
                         {"prompt": ONE, "multi_modal_data": {"image": g}}, text], greedy(), use_tqdm=False)
    failed = outs[0].outputs[0]
    assert failed.finish_reason == "abort" and "vision tower out of memory" in failed.error
    assert_matches_hf(mm_parity, case, outs[1], ONE, [g])
    assert outs[2].outputs[0].finish_reason == "length" and outs[2].outputs[0].error is None
    monkeypatch.setattr(model, "embed_multimodal", real)
    again = llm.generate({"prompt": ONE, "multi_modal_data": {"image": s}}, greedy(), use_tqdm=False)[0]
    image_start = again.prompt_token_ids.index(case.image_token_id())
    assert again.num_cached_tokens <= image_start  # nothing the failed request wrote past its text is reused
    assert_matches_hf(mm_parity, case, again, ONE, [s])
