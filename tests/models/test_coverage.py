"""Every architecture llmplug registers has a parity case (DESIGN.md: no registered name without proof)."""

from __future__ import annotations

from importlib.metadata import distribution

from .cases import CASES, POOLING_CASES, PP_CASES, TP_CASES, architecture
from .cases_transformers_backend import BACKEND_CASES, BACKEND_POOLING_CASES

ALL_CASES = [*CASES, *POOLING_CASES, *BACKEND_CASES, *BACKEND_POOLING_CASES]
# vision-language families, proven with images against transformers by their own tests (the harness's cases are
# token prompts): architecture -> the test module
MULTIMODAL_PARITY = {
    "LlavaForConditionalGeneration": "tests/multimodal/test_llava.py",
    "LlavaNextForConditionalGeneration": "tests/multimodal/test_llava_next.py",
    "Gemma3ForConditionalGeneration": "tests/multimodal/test_gemma3_vision.py",
    "Idefics3ForConditionalGeneration": "tests/multimodal/test_idefics3.py",
    "SmolVLMForConditionalGeneration": "tests/multimodal/test_idefics3.py",
    "Qwen2VLForConditionalGeneration": "tests/multimodal/test_qwen2_vl.py",
    "Qwen2_5_VLForConditionalGeneration": "tests/multimodal/test_qwen2_vl.py",
    "Qwen3VLForConditionalGeneration": "tests/multimodal/test_qwen3_vl.py",
    "AyaVisionForConditionalGeneration": "tests/multimodal/test_aya_vision.py",
    "InternVLForConditionalGeneration": "tests/multimodal/test_internvl.py",
    "Mistral3ForConditionalGeneration": "tests/multimodal/test_mistral3.py",
    "Llama4ForConditionalGeneration": "tests/multimodal/test_llama4_vision.py",
    "PaliGemmaForConditionalGeneration": "tests/multimodal/test_paligemma.py",
    "WhisperForConditionalGeneration": "tests/audio/test_whisper.py",  # encoder-decoder, with audio
    "Qwen2AudioForConditionalGeneration": "tests/audio/test_audio_language_models.py",  # with audio
    "AudioFlamingo3ForConditionalGeneration": "tests/audio/test_audio_language_models.py",
    "UltravoxModel": "tests/audio/test_ultravox.py",  # against a reference composed of transformers' parts
}


def registered_architectures() -> set[str]:
    """The names llmplug's own distribution registers in `llmplug.models`."""
    return {ep.name for ep in distribution("llmplug").entry_points if ep.group == "llmplug.models"}


def test_every_registered_architecture_has_a_parity_case() -> None:
    missing = registered_architectures() - {architecture(c) for c in ALL_CASES} - set(MULTIMODAL_PARITY)
    assert not missing, (
        f"registered in pyproject.toml without a parity case in tests/models/cases.py: {sorted(missing)}"
    )


def test_every_parity_case_proves_a_registered_architecture() -> None:
    unknown = {architecture(c) for c in ALL_CASES} - registered_architectures()
    assert not unknown, f"parity cases of unregistered architectures: {sorted(unknown)}"


def test_case_names_are_unique_and_parallel_cases_exist() -> None:
    names = [c.name for c in ALL_CASES]
    assert len(names) == len(set(names))
    assert set(TP_CASES) <= set(names) and set(PP_CASES) <= set(names)
