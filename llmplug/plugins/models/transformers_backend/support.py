"""Which checkpoints the transformers backend can run: the transformers class of a config, and the checks
that refuse what the backend cannot run (no attention interface, layers that are not attention).

Kept free of torch-heavy work: the loader asks these questions before anything is built.
"""

from __future__ import annotations

from typing import Iterable

from transformers import PretrainedConfig

__all__ = [
    "ATTENTION_LAYER_TYPES",
    "base_model_class",
    "causal_lm_architectures",
    "causal_lm_class",
    "image_text_to_text_class",
    "is_encoder",
    "multimodal_unsupported_reason",
    "sequence_classification_class",
    "unsupported_reason",
]

# the per-layer kinds (config.layer_types) the backend's paged attention runs; others (mamba, linear
# attention, ...) keep state the backend has no cache for
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def causal_lm_class(config: PretrainedConfig) -> type | None:
    """transformers' causal-LM class for the config's model type (what AutoModelForCausalLM builds), or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return _lookup(MODEL_FOR_CAUSAL_LM_MAPPING, config)


def base_model_class(config: PretrainedConfig) -> type | None:
    """transformers' bare model class for the config's model type (what AutoModel builds), or None."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    return _lookup(MODEL_MAPPING, config)


def image_text_to_text_class(config: PretrainedConfig) -> type | None:
    """transformers' image-text-to-text class for the config's model type (AutoModelForImageTextToText's), or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    return _lookup(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, config)


def sequence_classification_class(config: PretrainedConfig) -> type | None:
    """transformers' sequence-classification class for the config's model type, or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    return _lookup(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING, config)


def is_encoder(config: PretrainedConfig) -> bool:
    """Whether the model type is a bidirectional encoder: transformers has a masked-LM class for it (BERT's kin)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING

    return _lookup(MODEL_FOR_MASKED_LM_MAPPING, config) is not None


def _lookup(mapping: object, config: PretrainedConfig) -> type | None:
    try:
        found = mapping[type(config)]  # type: ignore[index]
    except KeyError:
        return None
    return found[0] if isinstance(found, (tuple, list)) else found


def unsupported_reason(hf_class: type, config: PretrainedConfig) -> str | None:
    """Why the backend cannot run `hf_class` on `config` (None: it can)."""
    reason = _interface_reason(hf_class)
    if reason is not None:
        return reason
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - ATTENTION_LAYER_TYPES:
        return (
            f"{hf_class.__name__} has layers of kind {sorted(layer_types - ATTENTION_LAYER_TYPES)}; the backend "
            f"runs only {sorted(ATTENTION_LAYER_TYPES)} layers"
        )
    return None


# image-text-to-text model types whose language model needs more than image rows in its input embeddings and
# causal attention: masks the backend's paged attention does not build (their modeling adds a bidirectional
# `or_mask_function` over the causal mask), or layers it has no cache for
_BIDIRECTIONAL = "its image tokens attend to each other both ways, a mask paged attention does not build"
MULTIMODAL_GAPS = {
    "paligemma": "its prefix (image and prompt) attends bidirectionally, a mask paged attention does not build",
    "gemma3": _BIDIRECTIONAL,
    "gemma4": _BIDIRECTIONAL,
    "gemma4_unified": _BIDIRECTIONAL,
    "step3p7": _BIDIRECTIONAL,
    "unlimited_ocr": _BIDIRECTIONAL,
    "mllama": "its images enter through cross-attention layers, which have no paged KV cache",
}


def multimodal_unsupported_reason(hf_class: type, config: PretrainedConfig) -> str | None:
    """Why the backend cannot run image-text-to-text `hf_class` on `config` (None: it can): its language model's
    reason, a known gap, or multimodal rotary positions (a `get_rope_index`, Qwen2-VL's M-RoPE)."""
    gap = MULTIMODAL_GAPS.get(config.model_type)
    if gap is not None:
        return f"{hf_class.__name__}: {gap}"
    if _computes_rope_index(hf_class):
        return (f"{hf_class.__name__} positions its image tokens with multimodal rotary positions (M-RoPE), which "
                "the backend does not compute")
    return unsupported_reason(hf_class, config.get_text_config())


def _computes_rope_index(hf_class: type) -> bool:
    """Whether a class of `hf_class`'s modeling module computes M-RoPE indices (`get_rope_index`, Qwen2-VL's)."""
    import sys

    module = sys.modules[hf_class.__module__]
    return any(isinstance(obj, type) and obj.__module__ == module.__name__ and hasattr(obj, "get_rope_index")
               for obj in vars(module).values())


def causal_lm_architectures(model_types: Iterable[str] | None = None) -> dict[str, tuple[str | None, bool]]:
    """transformers' causal-LM class names (of `model_types`, default every one) -> (why the backend cannot run
    them or None, whether their config has a tensor-parallel plan); the class check only (a config's layer kinds
    are checked when it is loaded)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = {}
    for model_type in sorted(model_types or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
        hf_class = getattr(transformers, name, None)
        why = f"transformers does not export {name}" if hf_class is None else _interface_reason(hf_class)
        found[name] = (why, bool(getattr(CONFIG_MAPPING[model_type], "base_model_tp_plan", None)))
    return found


# classes that claim the attention interface but whose output through it differs from transformers' own (found by
# the parity tests): refused rather than run wrong
KNOWN_MISMATCHES = {
    "DiffLlamaForCausalLM": "differential attention combines two attention maps outside the interface call",
    "DogeForCausalLM": "its dynamic mask is applied by its own attention code, which the interface call skips",
    "Cohere2MoeForCausalLM": "its log-probabilities differ from transformers' in the backend (not yet explained)",
}


def _interface_reason(hf_class: type) -> str | None:
    mismatch = KNOWN_MISMATCHES.get(hf_class.__name__)
    if mismatch is not None:
        return f"{hf_class.__name__} gives other tokens than transformers through the backend: {mismatch}"
    if getattr(hf_class, "_supports_attention_backend", False):
        return None
    return (
        f"transformers' {hf_class.__name__} does not support the attention interface "
        "(_supports_attention_backend is False), so its attention cannot run on llmplug's paged KV cache"
    )
