"""Gemma 3 with pan-and-scan against transformers, and vLLM's `mm_processor_kwargs` (the engine's and a request's).

The tiny Gemma 3 of test_gemma3_vision.py (32x32 SigLIP pooled to 16 tokens an image) with the processor's
pan-and-scan on and its smallest crop 8 px: a wide 48x24 picture becomes the picture and 2 crops, a tall 20x60 one the
picture and 3, each its own run of 16 soft tokens between `<start_of_image>` and `<end_of_image>` with the
processor's text between them. Greedy tokens equal and log-probabilities within 1e-4 of transformers' `generate` on
the same processor output (its `token_type_ids`: each run attends to itself both ways, never the text between
crops), plain and in chunks of 20 tokens (chunks end between an image's crops); a request's own kwargs over the
engine's; a name the processor does not take refused by name, the next request served."""

from __future__ import annotations

import pytest

from llmplug.core.config import ModelConfig
from llmplug.core.errors import ConfigError, InvalidRequestError
from llmplug.engine.multimodal import MultiModalProcessor, bidirectional_spans
from llmplug.testing import MultimodalParityCase, MultimodalPrompt
from tests.multimodal.conftest import gradient, images, shapes, tiny_llava  # noqa: F401 - fixtures
from tests.multimodal.test_gemma3_vision import MAX_TOKENS, NUM_IMAGE_TOKENS, ONE, greedy, tiny_gemma3  # noqa: F401

PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8}
CROPS = {"wide": 2, "tall": 3}


@pytest.fixture(scope="module")
def pictures() -> dict:
    """Wide 48x24 (2 crops of 24x24) and tall 20x60 (3 crops of 20x20)."""
    return {"wide": gradient(48, 24), "tall": shapes(20, 60)}


def with_kwargs(kwargs: dict):
    """transformers' inputs for a prompt processed with `kwargs`; `generate` takes its token_type_ids."""
    def hf_inputs(processor, text, images):
        return dict(processor(text=text, images=list(images), return_tensors="pt", **kwargs))
    return hf_inputs


@pytest.fixture(scope="module")
def case(tiny_gemma3, pictures) -> MultimodalParityCase:
    """The engine's mm_processor_kwargs turn pan-and-scan on; 20 tokens a step, less than one image's span."""
    prompts = (MultimodalPrompt(ONE, (pictures["wide"],)), MultimodalPrompt(ONE, (pictures["tall"],)))
    return MultimodalParityCase("Gemma3ForConditionalGeneration[pan-and-scan]", tiny_gemma3.path,
                                tiny_gemma3.processor, tiny_gemma3.hf_model, prompts, chunk_budget=20,
                                max_tokens=MAX_TOKENS, engine_kwargs={"mm_processor_kwargs": PAN_AND_SCAN},
                                hf_inputs=with_kwargs(PAN_AND_SCAN))


def test_crops_are_runs_of_one_item_each_its_own_bidirectional_span(case, llm, pictures):
    mm_processor = llm.llm_engine.processor.mm_processor
    for name, picture in pictures.items():
        rows = case.processor(text=ONE, images=[picture], return_tensors="pt", **PAN_AND_SCAN)["pixel_values"]
        assert rows.shape[0] == 1 + CROPS[name]  # transformers made crops
        ids, (feature,) = mm_processor.process(ONE, None, [picture])
        assert feature.data["pixel_values"].shape[0] == 1 + CROPS[name]
        assert feature.num_embeds == (1 + CROPS[name]) * NUM_IMAGE_TOKENS
        runs = bidirectional_spans("image", [feature], len(ids))
        assert [end - start for start, end in runs] == [NUM_IMAGE_TOKENS] * (1 + CROPS[name])
        assert all(set(ids[start:end]) == {case.image_token_id()} for start, end in runs)
        assert all(ids[end] != case.image_token_id() for _, end in runs)  # text between the crops
        assert runs[-1][1] - runs[0][0] > case.chunk_budget  # a chunk of 20 ends inside the image


def test_engine_kwargs_match_transformers_and_a_request_overrides_them(mm_parity, case, llm, pictures):
    mm_parity.check(case, "plain", llm)
    plain = MultimodalParityCase("Gemma3ForConditionalGeneration[no crops]", case.model, case.processor,
                                 case.hf_model, case.prompts, max_tokens=MAX_TOKENS)
    prompt = MultimodalPrompt(ONE, (pictures["wide"],))
    request = {**prompt.engine_prompt(), "mm_processor_kwargs": {"do_pan_and_scan": False}}
    (output,) = llm.generate(request, greedy(), use_tqdm=False)
    mm_parity.assert_matches(plain, output, prompt)


def test_a_kwarg_the_processor_does_not_take_is_refused_by_name_and_the_next_request_is_served(mm_parity, case, llm,
                                                                                                pictures):
    prompt = MultimodalPrompt(ONE, (pictures["tall"],))
    with pytest.raises(InvalidRequestError, match="do_pan_and_scn"):
        llm.generate({**prompt.engine_prompt(), "mm_processor_kwargs": {"do_pan_and_scn": True}}, greedy(),
                     use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="do_pan_and_scan"):  # transformers' type check
        llm.generate({**prompt.engine_prompt(), "mm_processor_kwargs": {"do_pan_and_scan": "yes"}}, greedy(),
                     use_tqdm=False)
    (output,) = llm.generate(prompt.engine_prompt(), greedy(), use_tqdm=False)
    mm_parity.assert_matches(case, output, prompt)


def test_chunked_prefill_between_crops_matches_transformers(mm_parity, case):
    mm_parity.check(case, "chunked_prefill")


def test_engine_kwargs_come_from_json_and_an_unknown_name_is_refused_at_start(case):
    assert ModelConfig(mm_processor_kwargs='{"do_pan_and_scan": true}').mm_processor_kwargs == {
        "do_pan_and_scan": True}
    with pytest.raises(ConfigError, match=r"mm_processor_kwargs.*\['pan_and_scan'\]"):
        MultiModalProcessor(str(case.model), case.image_token_id(), {"image": 1}, processor_kwargs={"pan_and_scan": 1})


def test_chat_completions_pass_mm_processor_kwargs_and_refuse_an_unknown_one_with_a_400(tiny_llava, images):
    """The server's chat field reaches the processor (a value of the wrong type is transformers' 400); an unknown
    name is a 400 naming it; the next request is answered. (LLaVA: its chat renders token ids the processor expands,
    as every family's but Gemma 3's, which needs text prompts.)"""
    import base64
    import io

    from llmplug import AsyncLLM
    from tests.entrypoints.openai.conftest import serve
    from tests.entrypoints.openai.test_errors import assert_openai_error, post

    png = io.BytesIO()
    images["gradient"].save(png, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}]
    request = {"messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0}
    engine = AsyncLLM(str(tiny_llava.path), dtype="float32", max_model_len=128, block_size=16)
    try:
        with serve(engine) as server:
            for kwargs, named in (({"do_normalise": False}, "do_normalise"), ({"do_normalize": "no"}, "do_normalize")):
                status, body, _ = post(server, "/v1/chat/completions", {**request, "mm_processor_kwargs": kwargs})
                error = assert_openai_error(body, 400)
                assert status == 400 and named in error["message"], body
            status, body, _ = post(server, "/v1/chat/completions",
                                   {**request, "mm_processor_kwargs": {"do_normalize": False}})
            assert status == 200 and body["usage"]["prompt_tokens"] > 16, body
    finally:
        engine.shutdown()
