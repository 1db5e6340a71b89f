"""Idefics3 and SmolVLM against transformers on tiny random checkpoints and drawn pictures: each image split into
tiles plus a global view (several runs of `<image>` placeholders with tile tags between them, one item with an
`is_embed` mask), greedy tokens equal and log-probabilities within 1e-4 (float32), plain and under chunked prefill
whose budget is smaller than one tile; prefix caching by image content; the encoder computed once per image."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.core.errors import InvalidRequestError
from tests.models.tiny_models import train_llama_tokenizer
from tests.multimodal.conftest import shapes

MAX_TOKENS = 8
TOKENS_PER_TILE = 4  # (32 / 8) ** 2 patches, pixel-shuffled by 2
SPECIAL_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                  *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))]
ONE = "User:<image>What is in the picture?<end_of_utterance>\nAssistant:"
TWO = "User:<image> and <image>Which one is brighter?<end_of_utterance>\nAssistant:"


@dataclass
class TinyIdefics3:
    path: Path
    processor: object
    hf_model: torch.nn.Module


def save_tiny(path: Path, family: str) -> TinyIdefics3:
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
    return TinyIdefics3(path, processor, model)


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def tiny(request, tmp_path_factory) -> TinyIdefics3:
    return save_tiny(tmp_path_factory.mktemp(f"tiny_{request.param}"), request.param)


def greedy(logprobs: int = 2) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)


def make_llm(tiny: TinyIdefics3, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "block_size": 4, "num_gpu_blocks_override": 256,
              "limit_mm_per_prompt": {"image": 2}, **kwargs}
    return LLM(str(tiny.path), **kwargs)


def hf_reference(tiny: TinyIdefics3, text: str, images: list) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens from the same processor output, and its log-softmax rows over prompt + tokens."""
    inputs = tiny.processor(text=text, images=images, return_tensors="pt")
    with torch.inference_mode():
        out = tiny.hf_model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        full = out[0]
        logits = tiny.hf_model(input_ids=full[None, :-1], pixel_values=inputs["pixel_values"],
                               pixel_attention_mask=inputs["pixel_attention_mask"]).logits[0]
    return full[inputs["input_ids"].shape[1]:].tolist(), torch.log_softmax(logits.float(), -1)


def assert_matches_hf(tiny: TinyIdefics3, output, text: str, images: list) -> None:
    tokens, log_probs = hf_reference(tiny, text, images)
    completion = output.outputs[0]
    assert list(completion.token_ids) == tokens
    prompt_len = len(output.prompt_token_ids)
    assert log_probs.shape[0] == prompt_len + MAX_TOKENS - 1  # the engine's prompt holds the processor's expansion
    for t, position in enumerate(completion.logprobs):
        for token, logprob in position.items():
            assert logprob.logprob == pytest.approx(float(log_probs[prompt_len - 1 + t, token]), abs=1e-4)


@pytest.fixture(scope="module")
def pictures(images) -> dict:
    """Landscape 60x40 and portrait 48x64 (2 x 2 tiles each), and a wide 96x30 (1 x 2 tiles)."""
    return {**images, "wide": shapes(96, 30)}


def cases(pictures):
    g, s, w = pictures["gradient"], pictures["shapes"], pictures["wide"]
    return [(ONE, [g]), (ONE, [w]), (TWO, [g, w]), (TWO, [w, s])]


def runner(llm):
    return llm.llm_engine.engine_core.executor.worker.model_runner


@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 3}], ids=["plain", "chunked_prefill"])
def test_greedy_tokens_and_logprobs_match_transformers(tiny, pictures, engine_kwargs):
    """Chunks of 3 tokens: every tile's 4 placeholders, and the tags between them, span two or more steps."""
    llm = make_llm(tiny, **engine_kwargs)
    assert type(runner(llm).model).__name__ == tiny.hf_model.config.architectures[0]  # ours, not the fallback
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in cases(pictures)]
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    for (text, imgs), output in zip(cases(pictures), outputs):
        assert_matches_hf(tiny, output, text, imgs)
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids  # the picture matters
    llm.shutdown()


def test_an_image_is_one_item_whose_mask_skips_the_tile_tags(tiny, pictures):
    llm = make_llm(tiny)
    ids, features = llm.llm_engine.processor.mm_processor.process(
        TWO, None, [pictures["gradient"], pictures["wide"]])
    image_token = tiny.hf_model.config.image_token_id
    assert [f.num_embeds for f in features] == [5 * TOKENS_PER_TILE, 3 * TOKENS_PER_TILE]
    assert [f.data["pixel_values"].shape[1] for f in features] == [5, 3]  # tiles, the global view last
    for feature in features:
        span = ids[feature.offset : feature.end]
        assert span[0] == span[-1] == image_token
        assert feature.is_embed.tolist() == [t == image_token for t in span]
    assert features[0].end < features[1].offset
    llm.shutdown()


def test_prefix_cache_hits_for_the_same_image_and_misses_for_another(tiny, pictures):
    llm = make_llm(tiny)
    g, s = pictures["gradient"], pictures["shapes"]
    first = llm.generate({"prompt": ONE, "multi_modal_data": {"image": g}}, greedy(), use_tqdm=False)[0]
    same = llm.generate({"prompt": ONE, "multi_modal_data": {"image": g}}, greedy(), use_tqdm=False)[0]
    other = llm.generate({"prompt": ONE, "multi_modal_data": {"image": s}}, greedy(), use_tqdm=False)[0]
    image_token = tiny.hf_model.config.image_token_id
    first_image, last_image = (first.prompt_token_ids.index(image_token),
                               len(first.prompt_token_ids) - first.prompt_token_ids[::-1].index(image_token))
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens >= last_image - 3  # every block holding the image is reused (block size 4)
    assert other.num_cached_tokens <= first_image  # only the text before the image: its blocks name the image
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    assert runner(llm).encoder_cache.num_encoder_calls == 2  # the gradient once, the shapes once
    assert_matches_hf(tiny, same, ONE, [g])
    assert_matches_hf(tiny, other, ONE, [s])
    llm.shutdown()


def test_encoder_runs_once_per_image_across_chunks(tiny, pictures):
    llm = make_llm(tiny, max_num_batched_tokens=3, encoder_cache_size=128, enable_prefix_caching=False)
    cache = runner(llm).encoder_cache
    g, w = pictures["gradient"], pictures["wide"]
    llm.generate({"prompt": ONE, "multi_modal_data": {"image": g}}, greedy(), use_tqdm=False)
    assert cache.num_encoder_calls == 1  # its five tiles' placeholders took a dozen chunks
    out = llm.generate({"prompt": TWO, "multi_modal_data": {"image": [w, g]}}, greedy(), use_tqdm=False)[0]
    assert cache.num_encoder_calls == 2  # the gradient came from the cache
    assert_matches_hf(tiny, out, TWO, [w, g])
    llm.shutdown()


def test_a_token_id_prompt_with_one_placeholder_per_image_is_refused_and_an_expanded_one_matches(tiny, pictures):
    """The processor's expansion holds tile tags, which single placeholders in token ids cannot become."""
    llm = make_llm(tiny)
    g = pictures["gradient"]
    ids = tiny.processor.tokenizer.encode(ONE)
    with pytest.raises(InvalidRequestError, match="send the prompt as text"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": g}}, greedy(), use_tqdm=False)
    expanded = tiny.processor(text=ONE, images=[g], return_tensors="pt")["input_ids"][0].tolist()
    (output,) = llm.generate({"prompt_token_ids": expanded, "multi_modal_data": {"image": g}}, greedy(),
                             use_tqdm=False)
    assert_matches_hf(tiny, output, ONE, [g])
    llm.shutdown()


def test_tensor_parallel_encodes_on_every_rank(tiny, pictures):
    """TP=2: each rank runs its half of the vision heads (the connector is replicated) on the same tiles."""
    llm = make_llm(tiny, tensor_parallel_size=2, max_num_batched_tokens=5)
    try:
        outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": imgs}} for text, imgs in cases(pictures)],
                               greedy(), use_tqdm=False)
    finally:
        llm.shutdown()
    for (text, imgs), output in zip(cases(pictures), outputs):
        assert_matches_hf(tiny, output, text, imgs)
