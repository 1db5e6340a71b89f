"""Idefics3 and SmolVLM against transformers on tiny random checkpoints and drawn pictures: each image split into
tiles plus a global view (several runs of `<image>` placeholders with tile tags between them, one item with an
`is_embed` mask), greedy tokens equal and log-probabilities within 1e-4 (float32), plain and under chunked prefill
whose budget is smaller than one tile; prefix caching by image content; the encoder computed once per image."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmplug import SamplingParams
from llmplug.core.errors import InvalidRequestError
from llmplug.testing import MultimodalParityCase, MultimodalPrompt
from tests.models.tiny_models import train_llama_tokenizer
from tests.multimodal.conftest import TinyVLM, model_runner, shapes

MAX_TOKENS = 8
TOKENS_PER_TILE = 4  # (32 / 8) ** 2 patches, pixel-shuffled by 2
SPECIAL_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                  *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))]
ONE = "User:<image>What is in the picture?<end_of_utterance>\nAssistant:"
TWO = "User:<image> and <image>Which one is brighter?<end_of_utterance>\nAssistant:"


def save_tiny(path: Path, family: str) -> TinyVLM:
    """A SigLIP-layout ViT on 32x32 tiles (patch 8), scale factor 2, a 2-layer Llama, and an Idefics3Processor that
    resizes the longest edge to 64 and splits into 32x32 tiles (up to 2 x 2, plus the global view).

    SmolVLM is saved with the Idefics3 processor too: SmolVLMProcessor needs num2words and a video processor
    (torchvision), which this environment lacks; its image expansion is Idefics3's, token for token."""
    import transformers
    from transformers import Idefics3Processor, LlamaConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = train_llama_tokenizer(path / "tokenizer")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    prefix = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[family]
    vision = getattr(transformers, f"{prefix}VisionConfig")(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                       eos_token_id=None, pad_token_id=None)
    config = getattr(transformers, f"{prefix}Config")(
        vision_config=vision.to_dict(), text_config=text.to_dict(), scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0 if family == "idefics3" else 1)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).eval()
    with torch.no_grad():  # transformers' init leaves the tiny connector's rows small: make the pictures matter
        model.model.connector.modality_projection.proj.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  image_seq_len=TOKENS_PER_TILE)
    processor.save_pretrained(path)
    return TinyVLM(path, processor, model)


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def tiny(request, tmp_path_factory) -> TinyVLM:
    return save_tiny(tmp_path_factory.mktemp(f"tiny_{request.param}"), request.param)


def greedy(logprobs: int = 2) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)


@pytest.fixture(scope="module")
def pictures(images) -> dict:
    """Landscape 60x40 and portrait 48x64 (2 x 2 tiles each), and a wide 96x30 (1 x 2 tiles)."""
    return {**images, "wide": shapes(96, 30)}


@pytest.fixture(scope="module")
def case(tiny, pictures) -> MultimodalParityCase:
    """Chunks of 3 tokens: every tile's 4 placeholders, and the tags between them, span two or more steps."""
    g, s, w = pictures["gradient"], pictures["shapes"], pictures["wide"]
    prompts = (MultimodalPrompt(ONE, (g,)), MultimodalPrompt(ONE, (w,)), MultimodalPrompt(TWO, (g, w)),
               MultimodalPrompt(TWO, (w, s)))
    return MultimodalParityCase(tiny.hf_model.config.architectures[0], tiny.path, tiny.processor, tiny.hf_model,
                                prompts, chunk_budget=3, max_tokens=MAX_TOKENS)


def test_greedy_tokens_and_logprobs_match_transformers_and_the_prefix_cache_follows_the_image(mm_parity, case, llm):
    assert type(model_runner(llm).model).__name__ == case.name  # ours, not the fallback
    mm_parity.check(case, "plain", llm)
    calls = model_runner(llm).encoder_cache.num_encoder_calls
    mm_parity.check_prefix_cache(case, llm)
    assert model_runner(llm).encoder_cache.num_encoder_calls == calls + 1  # the other picture; the same one: cached


def test_chunked_prefill_matches_transformers_and_encodes_each_image_once(mm_parity, case, pictures):
    """Chunks of 3 tokens, no prefix caching: an image's five tiles' placeholders take a dozen chunks and one
    encoder call; an image of an earlier request comes from the encoder cache."""
    with mm_parity.engine(case, "chunked_prefill", encoder_cache_size=128, enable_prefix_caching=False) as llm:
        cache = model_runner(llm).encoder_cache
        g, w = pictures["gradient"], pictures["wide"]
        llm.generate({"prompt": ONE, "multi_modal_data": {"image": g}}, greedy(), use_tqdm=False)
        assert cache.num_encoder_calls == 1
        out = llm.generate({"prompt": TWO, "multi_modal_data": {"image": [w, g]}}, greedy(), use_tqdm=False)[0]
        assert cache.num_encoder_calls == 2  # the gradient came from the cache
        mm_parity.assert_matches(case, out, MultimodalPrompt(TWO, (w, g)))
        mm_parity.check(case, "chunked_prefill", llm)


def test_an_image_is_one_item_whose_mask_skips_the_tile_tags(case, llm, pictures):
    ids, features = llm.llm_engine.processor.mm_processor.process(
        TWO, None, [pictures["gradient"], pictures["wide"]])
    image_token = case.image_token_id()
    assert [f.num_embeds for f in features] == [5 * TOKENS_PER_TILE, 3 * TOKENS_PER_TILE]
    assert [f.data["pixel_values"].shape[1] for f in features] == [5, 3]  # tiles, the global view last
    for feature in features:
        span = ids[feature.offset : feature.end]
        assert span[0] == span[-1] == image_token
        assert feature.is_embed.tolist() == [t == image_token for t in span]
    assert features[0].end < features[1].offset


def test_a_token_id_prompt_with_one_placeholder_per_image_is_refused_and_an_expanded_one_matches(mm_parity, case, llm,
                                                                                                  pictures):
    """The processor's expansion holds tile tags, which single placeholders in token ids cannot become."""
    g = pictures["gradient"]
    ids = case.processor.tokenizer.encode(ONE)
    with pytest.raises(InvalidRequestError, match="send the prompt as text"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": g}}, greedy(), use_tqdm=False)
    expanded = case.processor(text=ONE, images=[g], return_tensors="pt")["input_ids"][0].tolist()
    (output,) = llm.generate({"prompt_token_ids": expanded, "multi_modal_data": {"image": g}}, greedy(),
                             use_tqdm=False)
    mm_parity.assert_matches(case, output, MultimodalPrompt(ONE, (g,)))


def test_tensor_parallel_encodes_on_every_rank(mm_parity, case):
    """TP=2: each rank runs its half of the vision heads (the connector is replicated) on the same tiles, in chunks
    of 8 (each ends inside an image; fewer steps than chunks of 3, each a round trip to two workers)."""
    with mm_parity.engine(case, "tp2", max_num_batched_tokens=8) as llm:
        mm_parity.check(case, "tp2", llm)
