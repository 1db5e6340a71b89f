"""Vision-language models through the transformers backend (transformers' own image-text-to-text class, its
language model on llmplug's paged attention): LLaVA forced through it (model_impl="transformers"), LLaVA-NeXT's
anyres tiles (`image_sizes` through `get_image_features`) and Idefics2 (a perceiver resampler; no native row) give
transformers' greedy tokens with log-probabilities within 1e-4 (float32) on drawn pictures of two sizes, one and
two per prompt, under chunked prefill whose budget is smaller than an image (Idefics2: also preempted); LLaVA's
tokens equal the native row's; a prefix-cache hit for the same image and a miss for another; families whose merge
is more than image rows at the placeholders are refused by name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.core.config import EngineConfig
from llmplug.loaders.default import DefaultLoader
from llmplug.plugins.models.llava import LlavaForConditionalGeneration as NativeLlava
from llmplug.plugins.models.transformers_backend import TransformersForMultimodalLM, backend_class
from llmplug.testing.tiny import randomize_
from tests.multimodal.conftest import IMAGE_TOKEN, gradient, images, tiny_llava  # noqa: F401  (fixtures)
from tests.multimodal.test_llava_next import tiny_llava_next  # noqa: F401  (a fixture)

MAX_TOKENS = 6
ONE = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TWO = "USER: <image> and <image>\nWhich one is brighter? ASSISTANT:"


@dataclass
class TinyVlm:
    path: Path
    processor: object
    hf_model: torch.nn.Module


@pytest.fixture(scope="module")
def tiny_idefics2(tmp_path_factory) -> TinyVlm:
    """A tiny random Idefics2 (SigLIP-layout ViT 32x32, patch 8, with a pixel mask; a perceiver resampler to 8
    latents; a 2-layer Mistral), saved with its processor (PIL image processor, no image splitting): each image is
    8 placeholders between two `<fake_token_around_image>`."""
    from transformers import Idefics2Config, Idefics2ForConditionalGeneration, Idefics2Processor
    from transformers.models.idefics2.image_processing_pil_idefics2 import Idefics2ImageProcessorPil

    from tests.models.tiny_models import train_llama_tokenizer

    path = tmp_path_factory.mktemp("tiny_idefics2")
    tokenizer = train_llama_tokenizer(path / "tokenizer")
    tokenizer.add_tokens(["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>"], special_tokens=True)
    text = dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    perceiver = dict(hidden_size=64, resampler_n_latents=8, resampler_depth=1, resampler_n_heads=2,
                     resampler_head_dim=8, num_key_value_heads=1)
    config = Idefics2Config(vision_config=vision, text_config=text, perceiver_config=perceiver,
                            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    model = Idefics2ForConditionalGeneration(config).eval()
    randomize_(model)  # transformers' init leaves the resampled rows too alike for the picture to change the tokens
    model.save_pretrained(path)
    image_processor = Idefics2ImageProcessorPil(do_image_splitting=False,
                                                size={"shortest_edge": 32, "longest_edge": 32})
    Idefics2Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=8).save_pretrained(path)
    processor = Idefics2Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=8)
    return TinyVlm(path, processor, model)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)


def make_llm(path: Path, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "block_size": 4, "num_gpu_blocks_override": 128,
              "limit_mm_per_prompt": {"image": 2}, "device": {"num_threads": 1}, **kwargs}
    return LLM(str(path), **kwargs)


def model_class(path: Path, model_impl: str = "auto") -> type:
    loader = DefaultLoader(EngineConfig().load)
    return loader.get_model_class(loader.load_hf_config(EngineConfig(model={"model": str(path)}).model), model_impl)


def assert_matches_hf(vlm, output, text: str, pictures: list) -> None:
    """Greedy tokens equal to transformers' `generate` on the same processor output, log-probabilities within 1e-4."""
    inputs = vlm.processor(text=text, images=pictures, return_tensors="pt")
    image_inputs = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    with torch.inference_mode():
        full = vlm.hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)[0]
        logits = vlm.hf_model(input_ids=full[None, :-1], **image_inputs).logits[0]
    log_probs = torch.log_softmax(logits.float(), -1)
    completion, prompt_len = output.outputs[0], len(output.prompt_token_ids)
    assert list(completion.token_ids) == full[inputs["input_ids"].shape[1]:].tolist()
    assert prompt_len == inputs["input_ids"].shape[1]
    for t, position in enumerate(completion.logprobs):
        for token, logprob in position.items():
            assert logprob.logprob == pytest.approx(float(log_probs[prompt_len - 1 + t, token]), abs=1e-4)


def prompts(images):  # noqa: F811
    g, s = images["gradient"], images["shapes"]
    return [(ONE, [g]), (ONE, [s]), (TWO, [g, s])]


def generate(llm: LLM, cases) -> list:
    return llm.generate([{"prompt": text, "multi_modal_data": {"image": pics}} for text, pics in cases], greedy(),
                        use_tqdm=False)


def test_llava_through_the_backend_matches_transformers_and_the_native_row(tiny_llava, images):  # noqa: F811
    assert model_class(tiny_llava.path, "transformers") is TransformersForMultimodalLM
    assert model_class(tiny_llava.path) is NativeLlava
    cases = prompts(images)
    llm = make_llm(tiny_llava.path, model_impl="transformers", max_num_batched_tokens=6)  # 16-token images chunked
    try:
        backend = generate(llm, cases)
    finally:
        llm.shutdown()
    for (text, pictures), output in zip(cases, backend):
        assert_matches_hf(tiny_llava, output, text, pictures)
    assert backend[0].outputs[0].token_ids != backend[1].outputs[0].token_ids  # the picture matters
    llm = make_llm(tiny_llava.path, model_impl="native")
    try:
        native = generate(llm, cases)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in backend] == [o.outputs[0].token_ids for o in native]


def test_llava_next_anyres_images_through_the_backend_match_transformers(tiny_llava_next, images):  # noqa: F811
    cases = prompts(images)  # landscape and portrait: the 2x2 grid unpadded in rows or in columns, other counts
    llm = make_llm(tiny_llava_next.path, model_impl="transformers", max_num_batched_tokens=16, max_model_len=512)
    try:
        outputs = generate(llm, cases)
    finally:
        llm.shutdown()
    for (text, pictures), output in zip(cases, outputs):
        assert_matches_hf(tiny_llava_next, output, text, pictures)


@pytest.mark.parametrize("engine_kwargs", [
    {"max_num_batched_tokens": 6},  # chunks smaller than an image's 8 placeholders
    {"max_num_batched_tokens": 6, "num_gpu_blocks_override": 20, "max_num_seqs": 3},  # and preempted, recomputed
], ids=["chunked_prefill", "chunked_and_preempted"])
def test_a_family_without_a_native_row_runs_on_the_backend(tiny_idefics2, images, engine_kwargs):  # noqa: F811
    assert model_class(tiny_idefics2.path) is TransformersForMultimodalLM
    cases = prompts(images)
    llm = make_llm(tiny_idefics2.path, **engine_kwargs)
    try:
        outputs = generate(llm, cases)
        preemptions = llm.llm_engine.engine_core.scheduler.num_preemptions
        unseen = (ONE, [gradient(44, 52)])
        same, other = generate(llm, [cases[0], unseen])  # after the first round: the same image, then a new one
    finally:
        llm.shutdown()
    for (text, pictures), output in zip(cases, outputs):
        assert_matches_hf(tiny_idefics2, output, text, pictures)
    assert (preemptions > 0) == ("num_gpu_blocks_override" in engine_kwargs)
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids  # the picture matters
    image_token = tiny_idefics2.hf_model.config.image_token_id
    assert outputs[2].prompt_token_ids.count(image_token) == 16  # two images, 8 placeholders each
    image_start = outputs[0].prompt_token_ids.index(image_token)
    if "num_gpu_blocks_override" not in engine_kwargs:  # (a small cache may have evicted the first round's blocks)
        assert same.num_cached_tokens > image_start + 8  # the blocks holding the image are reused
    assert other.num_cached_tokens <= image_start  # only the text before the image: its blocks name the image
    assert same.outputs[0].token_ids == outputs[0].outputs[0].token_ids
    assert_matches_hf(tiny_idefics2, other, *unseen)


@pytest.mark.parametrize(("model_type", "why"), [
    ("paligemma", "prefix .* attends bidirectionally"),
    ("gemma3", "attend to each other both ways"),  # also a causal LM in transformers: taken as the VLM it is
    ("qwen2_vl", "multimodal rotary positions"),
    ("mllama", "cross-attention"),
])
def test_families_whose_merge_the_backend_cannot_run_are_refused_by_name(model_type, why):
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    config = AutoConfig.for_model(model_type)
    config.architectures = [MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type]]
    with pytest.raises(ValueError, match=why):
        backend_class(config)
