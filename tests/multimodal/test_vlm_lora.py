"""LoRA on the language model of a vision-language model (the tiny LLaVA), against peft's own PeftModel over
transformers' LlavaForConditionalGeneration on the same images: a batch mixing two adapters and the base model
gives each request its adapter's greedy tokens and log-probabilities (within 1e-4, float32); the prefix cache
keeps adapters apart with the same image; an adapter in transformers' older checkpoint layout loads alike; one
that adapts the vision tower or the projector is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmplug import LLM, SamplingParams
from llmplug.lora import LoRARequest
from llmplug.lora.adapter import LoRALoadError
from llmplug.testing import MultimodalParityCase, MultimodalPrompt
from tests.multimodal.conftest import NUM_IMAGE_TOKENS

MAX_TOKENS = 8
PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"
LANGUAGE = r".*language_model.*\."  # peft's regex targets: the language model's modules only
# name -> (rank, alpha, peft target_modules); "b" adapts the LM head too (the top-level `lm_head`)
SPECS = {
    "a": (8, 16, LANGUAGE + r"(q_proj|v_proj)"),
    "b": (4, 8, rf"{LANGUAGE}(k_proj|o_proj|gate_proj|down_proj)|lm_head"),
    "tower": (4, 8, ["q_proj", "v_proj"]),  # peft's usual list: CLIP's attention has q_proj / v_proj as well
    "projector": (4, 8, ["linear_1"]),
    "idefics3": (8, 16, r".*text_model.*\.(q_proj|v_proj|up_proj)"),  # Idefics3 names its language model so
}


def save_adapter(base: Path, name: str, path: Path, seed: int, model_class: str = "LlavaForConditionalGeneration"
                 ) -> torch.nn.Module:
    """Adapter `name` of SPECS over the checkpoint at `base`, every lora_A / lora_B random (std 0.1); returns peft's
    (unmerged) model of it over transformers' `model_class`, the reference."""
    import transformers
    from peft import LoraConfig, get_peft_model

    rank, alpha, targets = SPECS[name]
    model = getattr(transformers, model_class).from_pretrained(base, dtype=torch.float32).eval()
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in peft_model.named_parameters():
            if ".lora_A." in param_name or ".lora_B." in param_name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    peft_model.save_pretrained(path)
    return peft_model.eval()


def save_in_old_layout(source: Path, target: Path) -> None:
    """The same adapter as transformers before 5 names it (`language_model.model.*`, `language_model.lm_head`)."""
    import shutil

    from safetensors.torch import load_file, save_file

    renames = {"base_model.model.model.language_model.": "base_model.model.language_model.model.",
               "base_model.model.lm_head.": "base_model.model.language_model.lm_head."}
    tensors = {}
    for key, tensor in load_file(source / "adapter_model.safetensors").items():
        old = next(p for p in renames if key.startswith(p))
        tensors[renames[old] + key[len(old):]] = tensor
    target.mkdir()
    shutil.copy(source / "adapter_config.json", target / "adapter_config.json")
    save_file(tensors, target / "adapter_model.safetensors", metadata={"format": "pt"})


def case_of(tiny, name: str, hf_model: torch.nn.Module) -> MultimodalParityCase:
    """The kit's case of `hf_model` (transformers, or peft over it) on the tiny checkpoint's processor."""
    return MultimodalParityCase(name, tiny.path, tiny.processor, hf_model, prompts=(), max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def adapters(tiny_llava, tmp_path_factory) -> dict[str, tuple[LoRARequest, torch.nn.Module | None]]:
    """Every adapter of SPECS, plus "a_old" ("a" in the older layout): its request and peft's model (None where
    the engine refuses it)."""
    root = tmp_path_factory.mktemp("vlm_lora")
    found = {}
    for i, name in enumerate(("a", "b", "tower", "projector")):
        model = save_adapter(tiny_llava.path, name, root / name, seed=i + 1)
        found[name] = (LoRARequest(name, i + 1, str(root / name)), model if name in ("a", "b") else None)
    save_in_old_layout(root / "a", root / "a_old")
    found["a_old"] = (LoRARequest("a_old", len(found) + 1, str(root / "a_old")), found["a"][1])
    return found


@pytest.fixture(scope="module")
def llm(tiny_llava):
    engine = LLM(str(tiny_llava.path), dtype="float32", block_size=4, num_gpu_blocks_override=128,
                 device={"num_threads": 1}, enable_lora=True, max_loras=3, max_lora_rank=8, enable_prefix_caching=True)
    yield engine
    engine.shutdown()


def generate(llm: LLM, cases: list[tuple[str | None, object]], adapters, text: str = PROMPT) -> list:
    prompts = [{"prompt": text, "multi_modal_data": {"image": image}} for _, image in cases]
    loras = [None if name is None else adapters[name][0] for name, _ in cases]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    return llm.generate(prompts, params, lora_request=loras, use_tqdm=False)


def test_mixed_adapters_with_images_match_peft_and_the_prefix_cache_keeps_them_apart(
    mm_parity, tiny_llava, images, adapters, llm
):
    g, s = images["gradient"], images["shapes"]
    cases = {name: case_of(tiny_llava, f"llava+{name}", tiny_llava.hf_model if name is None else adapters[name][1])
             for name in (None, "a", "b")}
    tokens = {(name, key): mm_parity.reference(cases[name], MultimodalPrompt(PROMPT, (images[key],))).tokens
              for name, key in [(None, "gradient"), (None, "shapes"), ("a", "gradient"), ("b", "gradient"),
                                ("b", "shapes")]}
    # the adapters matter: without them the test would fail
    assert tokens["a", "gradient"] != tokens[None, "gradient"] != tokens["b", "gradient"]
    assert tokens["b", "shapes"] != tokens[None, "shapes"]

    def assert_matches(output, name, key):
        mm_parity.assert_matches(cases[name], output, MultimodalPrompt(PROMPT, (images[key],)))

    first = generate(llm, [("a", g), ("b", g), (None, s)], adapters)
    for output, (name, key) in zip(first, [("a", "gradient"), ("b", "gradient"), (None, "shapes")]):
        assert_matches(output, name, key)
    # the same image again: with the same adapter its blocks are reused; with another, at most the text before the
    # image that this adapter ran before ("b" on the gradient), and for a new adapter ("a" in the older layout:
    # the same weights under another id) nothing
    again = generate(llm, [("a", g), ("b", s), ("a_old", g)], adapters)
    image_start = again[0].prompt_token_ids.index(tiny_llava.hf_model.config.image_token_index)
    assert again[0].num_cached_tokens > image_start + NUM_IMAGE_TOKENS
    assert again[1].num_cached_tokens <= image_start
    assert again[2].num_cached_tokens == 0
    for output, (name, key) in zip(again, [("a", "gradient"), ("b", "shapes"), ("a", "gradient")]):
        assert_matches(output, name, key)


@pytest.mark.parametrize("name, module", [
    ("tower", r"model\.vision_tower\.encoder\.layers\.\d\.self_attn\.[qv]_proj"),
    ("projector", r"model\.multi_modal_projector\.linear_1"),
], ids=["vision_tower", "projector"])
def test_an_adapter_of_the_vision_tower_or_projector_is_refused_by_name(tiny_llava, images, adapters, llm, name,
                                                                        module):
    with pytest.raises(LoRALoadError, match=f"adapts '{module}', a module of its .* adapts the language model only"):
        generate(llm, [(name, images["gradient"])], adapters)
    (after,) = generate(llm, [(None, images["gradient"])], adapters)  # the engine goes on
    assert len(after.outputs[0].token_ids) == MAX_TOKENS


def test_an_idefics3_adapter_of_its_text_model_matches_peft(mm_parity, images, tmp_path_factory):
    """Another naming of the language model (`model.text_model.*`): the family's checkpoint prefixes map it."""
    from tests.multimodal.test_idefics3 import ONE, save_tiny

    root = tmp_path_factory.mktemp("idefics3_lora")
    tiny = save_tiny(root / "model", "idefics3")
    peft_model = save_adapter(tiny.path, "idefics3", root / "adapter", seed=7,
                              model_class="Idefics3ForConditionalGeneration")
    prompt = MultimodalPrompt(ONE, (images["gradient"],))
    base, adapted = case_of(tiny, "idefics3-base", tiny.hf_model), case_of(tiny, "idefics3+lora", peft_model)
    assert mm_parity.reference(base, prompt).tokens != mm_parity.reference(adapted, prompt).tokens
    llm = LLM(str(tiny.path), dtype="float32", block_size=4, num_gpu_blocks_override=256, device={"num_threads": 1},
              enable_lora=True, max_lora_rank=8)
    try:
        adapters = {"idefics3": (LoRARequest("idefics3", 1, str(root / "adapter")), peft_model)}
        outputs = generate(llm, [("idefics3", images["gradient"]), (None, images["gradient"])], adapters, ONE)
    finally:
        llm.shutdown()
    mm_parity.assert_matches(adapted, outputs[0], prompt)
    mm_parity.assert_matches(base, outputs[1], prompt)
