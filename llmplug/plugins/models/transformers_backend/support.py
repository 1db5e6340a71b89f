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
